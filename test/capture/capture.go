// Package capture installs the non-eBPF traffic capture that mesh-cni is measured
// against: iptables (and ip6tables) or nftables NAT rules inside a pod's network
// namespace, shaped like Istio ambient's in-pod rules. Outbound TCP that is not the
// proxy's own (marked) and not to loopback is REDIRECTed to the outbound proxy port;
// inbound TCP to a port that is not excluded is REDIRECTed to the inbound proxy port.
// A proxy then finds the original destination with SO_ORIGINAL_DST, as with
// mesh-cni's eBPF capture.
//
// InstallIstio applies Istio ambient's in-pod rules themselves, written by
// istio-cni's own code (hack/istio-inpod): the baseline of what Istio users run
// today, where the others are reconstructions that a test can vary.
//
// This is test code: it shells out to iptables-restore and nft. The product never does.
package capture

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"strings"

	"github.com/mesh-cni/mesh-cni/internal/netns"
)

// Defaults, the same as the proxy's and mesh-cni's data path.
const (
	DefaultOutboundPort = 15001
	DefaultInboundPort  = 15006
	DefaultMark         = 0x539
)

// DefaultExcludedPorts returns the mesh proxy's own ports (ztunnel's), never redirected.
func DefaultExcludedPorts() []uint16 {
	return []uint16{15001, 15006, 15008, 15020, 15021, 15053, 15090}
}

// Rules says what to capture. Zero ports and mark take their defaults.
type Rules struct {
	// OutboundPort receives outbound connections (on loopback).
	OutboundPort uint16
	// InboundPort receives inbound connections.
	InboundPort uint16
	// Mark is the proxy's SO_MARK: marked connections are never redirected, so the
	// proxy's onward connections are not captured again.
	Mark uint32
	// ExcludedPorts are destination ports left alone in both directions.
	ExcludedPorts []uint16
	// ExcludedCIDRs are outbound destinations left alone.
	ExcludedCIDRs []netip.Prefix
	// InboundSkipSources are inbound sources left alone (probe sources such as the
	// node's addresses, so kubelet probes reach the application directly).
	InboundSkipSources []netip.Prefix
	// DNSPort, when set, is the proxy's DNS listener on loopback: the pod's
	// own DNS (UDP and TCP to port 53, not the proxy's marked queries, not to
	// loopback) is REDIRECTed there, as Istio ambient's in-pod rules do.
	DNSPort uint16
}

// DefaultRules returns the default ports and mark with the proxy ports excluded.
func DefaultRules() Rules {
	return Rules{
		OutboundPort:  DefaultOutboundPort,
		InboundPort:   DefaultInboundPort,
		Mark:          DefaultMark,
		ExcludedPorts: DefaultExcludedPorts(),
	}
}

func (r Rules) withDefaults() Rules {
	if r.OutboundPort == 0 {
		r.OutboundPort = DefaultOutboundPort
	}
	if r.InboundPort == 0 {
		r.InboundPort = DefaultInboundPort
	}
	if r.Mark == 0 {
		r.Mark = DefaultMark
	}
	return r
}

func (r Rules) validate() error {
	for _, p := range append(append([]netip.Prefix(nil), r.ExcludedCIDRs...), r.InboundSkipSources...) {
		if !p.IsValid() {
			return fmt.Errorf("invalid prefix %v in rules", p)
		}
	}
	for _, port := range r.ExcludedPorts {
		if port == 0 {
			return errors.New("excluded port 0 in rules")
		}
	}
	return nil
}

// Cleanup removes installed rules. Deleting the namespace removes them too, so a
// cleanup after the namespace is gone succeeds.
type Cleanup func(ctx context.Context) error

// prefixes returns the prefixes of one family, masked.
func prefixes(ps []netip.Prefix, v6 bool) []netip.Prefix {
	var out []netip.Prefix
	for _, p := range ps {
		if p.Addr().Is6() == v6 {
			out = append(out, p.Masked())
		}
	}
	return out
}

// runIn runs a command with stdin inside the network namespace at path: the child
// is started from a thread in that namespace and inherits it.
func runIn(ctx context.Context, path, stdin, name string, args ...string) error {
	return netns.Do(path, func() error {
		cmd := exec.CommandContext(ctx, name, args...)
		cmd.Stdin = strings.NewReader(stdin)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, bytes.TrimSpace(out.Bytes()))
		}
		return nil
	})
}

// outputIn runs a command inside the namespace at path and returns its stdout.
func outputIn(ctx context.Context, path, name string, args ...string) (string, error) {
	var out []byte
	err := netns.Do(path, func() error {
		var err error
		out, err = exec.CommandContext(ctx, name, args...).Output()
		if err != nil {
			var ee *exec.ExitError
			if errors.As(err, &ee) {
				return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, bytes.TrimSpace(ee.Stderr))
			}
			return fmt.Errorf("%s %s: %w", name, strings.Join(args, " "), err)
		}
		return nil
	})
	return string(out), err
}

// gone reports whether the namespace no longer exists, so there is nothing to clean.
func gone(path string) bool {
	_, err := os.Stat(path)
	return errors.Is(err, os.ErrNotExist)
}
