package capture

import (
	"context"
	"errors"
	"fmt"
	"strings"
)

// Chains of our own in the nat table, jumped to from OUTPUT and PREROUTING, so
// cleanup removes exactly what was installed.
const (
	iptOutputChain     = "MESHCAP_OUTPUT"
	iptPreroutingChain = "MESHCAP_PREROUTING"
)

// InstallIPTables installs the capture with iptables-restore and ip6tables-restore
// (nat table) inside the network namespace at netnsPath.
func InstallIPTables(ctx context.Context, netnsPath string, r Rules) (Cleanup, error) {
	r = r.withDefaults()
	if err := r.validate(); err != nil {
		return nil, err
	}
	cleanup := func(ctx context.Context) error {
		if gone(netnsPath) {
			return nil
		}
		var errs []error
		for _, bin := range []string{"iptables-restore", "ip6tables-restore"} {
			if err := runIn(ctx, netnsPath, iptablesCleanup(r), bin, "-w", "--noflush"); err != nil {
				errs = append(errs, fmt.Errorf("remove capture rules: %w", err))
			}
		}
		return errors.Join(errs...)
	}
	for _, fam := range []struct {
		bin string
		v6  bool
	}{{"iptables-restore", false}, {"ip6tables-restore", true}} {
		if err := runIn(ctx, netnsPath, iptablesRules(r, fam.v6), fam.bin, "-w", "--noflush"); err != nil {
			// Remove whatever part got installed; the rules are not usable half-done.
			return nil, errors.Join(fmt.Errorf("install capture rules in %s: %w", netnsPath, err), cleanup(ctx))
		}
	}
	return cleanup, nil
}

// iptablesRules is the iptables-restore input for one family. In --noflush mode the
// chain declarations create (or empty) our chains without touching anything else.
func iptablesRules(r Rules, v6 bool) string {
	var b strings.Builder
	line := func(format string, args ...any) { fmt.Fprintf(&b, format+"\n", args...) }
	line("*nat")
	line(":%s - [0:0]", iptOutputChain)
	line(":%s - [0:0]", iptPreroutingChain)
	for _, j := range outputJumps(r) {
		line("-A %s", j)
	}
	line("-A PREROUTING -p tcp -j %s", iptPreroutingChain)

	// Outbound: the proxy's own connections, anything staying on loopback (which
	// includes the pod's own addresses), excluded ports and destinations pass.
	line("-A %s -m mark --mark %#x -j RETURN", iptOutputChain, r.Mark)
	line("-A %s -o lo -j RETURN", iptOutputChain)
	if r.DNSPort != 0 {
		for _, proto := range []string{"udp", "tcp"} {
			line("-A %s -p %s --dport 53 -j REDIRECT --to-ports %d", iptOutputChain, proto, r.DNSPort)
		}
	}
	for _, p := range r.ExcludedPorts {
		line("-A %s -p tcp --dport %d -j RETURN", iptOutputChain, p)
	}
	for _, p := range prefixes(r.ExcludedCIDRs, v6) {
		line("-A %s -d %s -j RETURN", iptOutputChain, p)
	}
	line("-A %s -p tcp -j REDIRECT --to-ports %d", iptOutputChain, r.OutboundPort)

	// Inbound: everything arriving on the pod's interfaces, except excluded ports
	// and probe sources.
	line("-A %s -i lo -j RETURN", iptPreroutingChain)
	for _, p := range prefixes(r.InboundSkipSources, v6) {
		line("-A %s -s %s -j RETURN", iptPreroutingChain, p)
	}
	for _, p := range r.ExcludedPorts {
		line("-A %s -p tcp --dport %d -j RETURN", iptPreroutingChain, p)
	}
	line("-A %s -p tcp -j REDIRECT --to-ports %d", iptPreroutingChain, r.InboundPort)
	line("COMMIT")
	return b.String()
}

// outputJumps are the OUTPUT rules into our chain: TCP, and UDP only for the
// DNS redirect.
func outputJumps(r Rules) []string {
	jumps := []string{"OUTPUT -p tcp -j " + iptOutputChain}
	if r.DNSPort != 0 {
		jumps = append(jumps, "OUTPUT -p udp -j "+iptOutputChain)
	}
	return jumps
}

// iptablesCleanup is the iptables-restore input that removes the jumps and
// chains iptablesRules(r) installed.
func iptablesCleanup(r Rules) string {
	lines := []string{"*nat"}
	for _, j := range outputJumps(r) {
		lines = append(lines, "-D "+j)
	}
	return strings.Join(append(lines,
		"-D PREROUTING -p tcp -j "+iptPreroutingChain,
		"-F "+iptOutputChain,
		"-F "+iptPreroutingChain,
		"-X "+iptOutputChain,
		"-X "+iptPreroutingChain,
		"COMMIT",
		"",
	), "\n")
}
