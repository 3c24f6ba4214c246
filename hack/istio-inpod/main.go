// Command istio-inpod applies istio-cni's own in-pod traffic rules to a pod's
// network namespace, or removes them: the rules an Istio ambient user's pods
// get, built by istio-cni's code (istio.io/istio/cni/pkg/iptables through its
// trafficmanager), not a reconstruction. test/capture runs it as the baseline
// mesh-cni's capture is measured against.
//
//	istio-inpod -netns /run/netns/pod           # add, as on pod add
//	istio-inpod -netns /run/netns/pod -delete   # remove, as on pod delete
//
// Like istio-cni's node agent, it runs on the host and switches into the
// pod's namespace only to write the rules.
//
// The defaults are istio-cni's: DNS capture and IPv6 on (its chart's
// ambient.dnsCapture and ambient.ipv6), kubelet probes SNATed to its
// HOST_PROBE_SNAT_IP and HOST_PROBE_SNAT_IPV6, iptables (not native nftables).
// The iptables variant is pinned to nft (Debian's iptables is iptables-nft)
// instead of detected as istio-cni does by default: its detection picks
// legacy wherever a legacy table exists, and its own probe makes one, so the
// baseline would change with what ran on the host before.
// It lives in a module of its own so that Istio's dependencies stay out of
// mesh-cni's go.mod.
package main

import (
	"flag"
	"fmt"
	"net/netip"
	"os"

	"github.com/containernetworking/plugins/pkg/ns"
	"istio.io/istio/cni/pkg/config"
	"istio.io/istio/cni/pkg/iptables"
	"istio.io/istio/cni/pkg/trafficmanager"
	istiolog "istio.io/istio/pkg/log"
	dep "istio.io/istio/tools/istio-iptables/pkg/dependencies"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintf(os.Stderr, "istio-inpod: %v\n", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	fs := flag.NewFlagSet("istio-inpod", flag.ContinueOnError)
	netnsPath := fs.String("netns", "", "the pod's network namespace (a path; required)")
	del := fs.Bool("delete", false, "remove the rules instead of adding them")
	dns := fs.Bool("dns", true, "capture the pod's DNS (istio-cni's REDIRECT_DNS)")
	ipv6 := fs.Bool("ipv6", true, "IPv6 rules too (istio-cni's ENABLE_INBOUND_IPV6)")
	nft := fs.Bool("nftables", false, "istio-cni's native nftables backend instead of iptables")
	binary := fs.String("iptables-binary", "nft", "the iptables variant, nft or legacy (istio-cni's FORCE_IPTABLES_BINARY); empty detects it on the host as istio-cni does, which picks legacy wherever a legacy table exists")
	probe4 := fs.String("probe-snat-ip", "169.254.7.127", "kubelet probes' SNAT source (HOST_PROBE_SNAT_IP)")
	probe6 := fs.String("probe-snat-ipv6", "fd16:9254:7127:1337:ffff:ffff:ffff:ffff", "the same for IPv6 (HOST_PROBE_SNAT_IPV6)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *netnsPath == "" {
		return fmt.Errorf("-netns is required")
	}
	p4, err := netip.ParseAddr(*probe4)
	if err != nil {
		return fmt.Errorf("-probe-snat-ip: %w", err)
	}
	p6, err := netip.ParseAddr(*probe6)
	if err != nil {
		return fmt.Errorf("-probe-snat-ipv6: %w", err)
	}
	cfg := &config.AmbientConfig{
		RedirectDNS:            *dns,
		EnableIPv6:             *ipv6,
		HostProbeSNATAddress:   p4,
		HostProbeV6SNATAddress: p6,
	}
	// Host and pod configuration are the same, as in istio-cni's node agent;
	// the host side is never used here.
	_, pod, err := trafficmanager.NewTrafficRuleManager(&trafficmanager.TrafficRuleManagerConfig{
		NativeNftables: *nft,
		HostConfig:     cfg,
		PodConfig:      cfg,
		// The dependencies istio-cni's node agent passes (its
		// realDependenciesHost and realDependenciesInpod), with
		// AMBIENT_USE_SCOPED_XTABLES_LOCKING at its default, on.
		HostDeps: &dep.RealDependencies{ForceIptablesBinary: *binary},
		PodDeps:  &dep.RealDependencies{UsePodScopedXtablesLock: true, ForceIptablesBinary: *binary},
		NlDeps:   iptables.RealNlDeps(),
	})
	if err != nil {
		return fmt.Errorf("istio-cni traffic manager: %w", err)
	}
	log := istiolog.RegisterScope("istio-inpod", "istio-cni's in-pod rules")
	// The iptables commands are started from the locked thread, in the pod's
	// namespace, as istio-cni's node agent starts them.
	return ns.WithNetNSPath(*netnsPath, func(ns.NetNS) error {
		if *del {
			return pod.DeleteInpodRules(log)
		}
		return pod.CreateInpodRules(log, config.PodLevelOverrides{})
	})
}
