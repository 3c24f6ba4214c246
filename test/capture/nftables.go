package capture

import (
	"context"
	"fmt"
	"strings"
)

// nftTable is the inet table holding the capture: one table for both families,
// deleted as a whole on cleanup.
const nftTable = "mesh_capture"

// InstallNFTables installs the capture as an nftables inet table (nat chains on the
// output and prerouting hooks) inside the network namespace at netnsPath.
func InstallNFTables(ctx context.Context, netnsPath string, r Rules) (Cleanup, error) {
	r = r.withDefaults()
	if err := r.validate(); err != nil {
		return nil, err
	}
	if err := runIn(ctx, netnsPath, nftRuleset(r), "nft", "-f", "-"); err != nil {
		return nil, fmt.Errorf("install capture table in %s: %w", netnsPath, err)
	}
	return func(ctx context.Context) error {
		if gone(netnsPath) {
			return nil
		}
		if err := runIn(ctx, netnsPath, "", "nft", "delete", "table", "inet", nftTable); err != nil {
			return fmt.Errorf("remove capture table: %w", err)
		}
		return nil
	}, nil
}

// nftRuleset is the nft script. It first declares and deletes the table so that
// loading it again replaces it instead of adding a second copy of each rule.
func nftRuleset(r Rules) string {
	var b strings.Builder
	line := func(format string, args ...any) { fmt.Fprintf(&b, format+"\n", args...) }
	line("table inet %s", nftTable)
	line("delete table inet %s", nftTable)
	line("table inet %s {", nftTable)

	line("\tchain output {")
	line("\t\ttype nat hook output priority -100; policy accept;")
	// UDP enters the chain only for the DNS redirect.
	protos := "tcp"
	if r.DNSPort != 0 {
		protos = "{ tcp, udp }"
	}
	line("\t\tmeta l4proto != %s return", protos)
	line("\t\tmeta mark %#x return", r.Mark)
	line("\t\toifname \"lo\" return")
	if r.DNSPort != 0 {
		line("\t\tudp dport 53 redirect to :%d", r.DNSPort)
		line("\t\ttcp dport 53 redirect to :%d", r.DNSPort)
		line("\t\tmeta l4proto != tcp return")
	}
	if len(r.ExcludedPorts) > 0 {
		line("\t\ttcp dport { %s } return", portList(r.ExcludedPorts))
	}
	// One rule per prefix: an anonymous set would reject overlapping prefixes.
	for _, p := range prefixes(r.ExcludedCIDRs, false) {
		line("\t\tip daddr %s return", p)
	}
	for _, p := range prefixes(r.ExcludedCIDRs, true) {
		line("\t\tip6 daddr %s return", p)
	}
	line("\t\tmeta l4proto tcp redirect to :%d", r.OutboundPort)
	line("\t}")

	line("\tchain prerouting {")
	line("\t\ttype nat hook prerouting priority -100; policy accept;")
	line("\t\tmeta l4proto != tcp return")
	line("\t\tiifname \"lo\" return")
	for _, p := range prefixes(r.InboundSkipSources, false) {
		line("\t\tip saddr %s return", p)
	}
	for _, p := range prefixes(r.InboundSkipSources, true) {
		line("\t\tip6 saddr %s return", p)
	}
	if len(r.ExcludedPorts) > 0 {
		line("\t\ttcp dport { %s } return", portList(r.ExcludedPorts))
	}
	line("\t\tmeta l4proto tcp redirect to :%d", r.InboundPort)
	line("\t}")
	line("}")
	return b.String()
}

func portList(ports []uint16) string {
	// nft rejects duplicate elements in an anonymous set.
	seen := map[uint16]bool{}
	var s []string
	for _, p := range ports {
		if !seen[p] {
			seen[p] = true
			s = append(s, fmt.Sprint(p))
		}
	}
	return strings.Join(s, ", ")
}
