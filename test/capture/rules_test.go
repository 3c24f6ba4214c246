package capture

import (
	"context"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

func testRules() Rules {
	r := DefaultRules()
	r.ExcludedCIDRs = []netip.Prefix{netip.MustParsePrefix("10.96.0.0/12"), netip.MustParsePrefix("fd00:96::/108")}
	r.InboundSkipSources = []netip.Prefix{netip.MustParsePrefix("169.254.7.127/32"), netip.MustParsePrefix("fd00:7::7/128")}
	return r
}

// wantLines fails t for each of wants that text, named what, does not hold.
func wantLines(t *testing.T, what, text string, wants ...string) {
	t.Helper()
	for _, want := range wants {
		if !strings.Contains(text, want) {
			t.Errorf("%s: %q missing from\n%s", what, want, text)
		}
	}
}

func TestIPTablesRulesText(t *testing.T) {
	v4 := iptablesRules(testRules(), false)
	wantLines(t, "IPv4 rules", v4,
		"-A OUTPUT -p tcp -j MESHCAP_OUTPUT\n",
		"-A PREROUTING -p tcp -j MESHCAP_PREROUTING\n",
		"-A MESHCAP_OUTPUT -m mark --mark 0x539 -j RETURN\n",
		"-A MESHCAP_OUTPUT -o lo -j RETURN\n",
		"-A MESHCAP_OUTPUT -p tcp --dport 15008 -j RETURN\n",
		"-A MESHCAP_OUTPUT -d 10.96.0.0/12 -j RETURN\n",
		"-A MESHCAP_OUTPUT -p tcp -j REDIRECT --to-ports 15001\n",
		"-A MESHCAP_PREROUTING -s 169.254.7.127/32 -j RETURN\n",
		"-A MESHCAP_PREROUTING -p tcp --dport 15006 -j RETURN\n",
		"-A MESHCAP_PREROUTING -p tcp -j REDIRECT --to-ports 15006\nCOMMIT\n",
	)
	if strings.Contains(v4, "fd00") {
		t.Errorf("IPv4 rules hold IPv6 prefixes:\n%s", v4)
	}
	v6 := iptablesRules(testRules(), true)
	wantLines(t, "IPv6 rules", v6, "-d fd00:96::/108 -j RETURN", "-s fd00:7::7/128 -j RETURN")
	if strings.Contains(v6, "10.96") || strings.Contains(v6, "169.254") {
		t.Errorf("IPv6 rules hold IPv4 prefixes:\n%s", v6)
	}
	// The REDIRECT must come after every exemption in its chain.
	if strings.Index(v4, "REDIRECT --to-ports 15001") < strings.Index(v4, "-d 10.96.0.0/12") {
		t.Errorf("outbound REDIRECT before the exemptions:\n%s", v4)
	}
}

func TestNFTRulesetText(t *testing.T) {
	got := nftRuleset(testRules())
	wantLines(t, "ruleset", got,
		"delete table inet mesh_capture\n",
		"meta mark 0x539 return\n",
		"tcp dport { 15001, 15006, 15008, 15020, 15021, 15053, 15090 } return\n",
		"ip daddr 10.96.0.0/12 return\n",
		"ip6 daddr fd00:96::/108 return\n",
		"ip saddr 169.254.7.127/32 return\n",
		"meta l4proto tcp redirect to :15001\n",
		"meta l4proto tcp redirect to :15006\n",
	)
	// Without exclusions no empty set (a syntax error) is written.
	if bare := nftRuleset(Rules{}.withDefaults()); strings.Contains(bare, "{  }") || strings.Contains(bare, "dport") {
		t.Errorf("ruleset without exclusions:\n%s", bare)
	}
}

// The DNS redirect (port 53, UDP and TCP) comes after the proxy's own and
// loopback exemptions, and without a DNS port no UDP enters the chains.
func TestDNSRulesText(t *testing.T) {
	r := testRules()
	r.DNSPort = 15053
	ipt, cleanup := iptablesRules(r, false), iptablesCleanup(r)
	wantLines(t, "iptables rules", ipt,
		"-A OUTPUT -p udp -j MESHCAP_OUTPUT\n",
		"-A MESHCAP_OUTPUT -p udp --dport 53 -j REDIRECT --to-ports 15053\n",
		"-A MESHCAP_OUTPUT -p tcp --dport 53 -j REDIRECT --to-ports 15053\n",
	)
	if strings.Index(ipt, "--dport 53") < strings.Index(ipt, "-o lo -j RETURN") {
		t.Errorf("DNS redirect before the loopback exemption:\n%s", ipt)
	}
	if !strings.Contains(cleanup, "-D OUTPUT -p udp -j MESHCAP_OUTPUT\n") {
		t.Errorf("cleanup leaves the UDP jump:\n%s", cleanup)
	}
	nft := nftRuleset(r)
	wantLines(t, "ruleset", nft, "meta l4proto != { tcp, udp } return\n", "udp dport 53 redirect to :15053\n", "tcp dport 53 redirect to :15053\n")
	plain := testRules()
	for _, text := range []string{iptablesRules(plain, false), iptablesCleanup(plain), nftRuleset(plain)} {
		if strings.Contains(text, "udp") {
			t.Errorf("rules without a DNS port mention UDP:\n%s", text)
		}
	}
}

func TestRulesDefaultsAndValidation(t *testing.T) {
	r := Rules{}.withDefaults()
	if r.OutboundPort != 15001 || r.InboundPort != 15006 || r.Mark != 0x539 {
		t.Errorf("defaults = %+v", r)
	}
	if err := (Rules{ExcludedCIDRs: []netip.Prefix{{}}}).validate(); err == nil {
		t.Error("invalid prefix accepted")
	}
	if err := (Rules{ExcludedPorts: []uint16{0}}).validate(); err == nil {
		t.Error("port 0 accepted")
	}
	if _, err := InstallNFTables(t.Context(), "/nonexistent", Rules{ExcludedPorts: []uint16{0}}); err == nil {
		t.Error("InstallNFTables accepted bad rules")
	}
}

// TestInstallAndCleanup installs each variant for real, sees the rules in the
// namespace, removes them, and sees them gone; a cleanup after the namespace is
// deleted succeeds.
func TestInstallAndCleanup(t *testing.T) {
	fixtures.RequireRoot(t, "creates network namespaces and netfilter rules")
	type lister func(ctx context.Context, path string) (string, error)
	iptablesList := func(ctx context.Context, path string) (string, error) {
		v4, err := outputIn(ctx, path, "iptables-save", "-t", "nat")
		if err != nil {
			return "", err
		}
		v6, err := outputIn(ctx, path, "ip6tables-save", "-t", "nat")
		return v4 + v6, err
	}
	nftList := func(ctx context.Context, path string) (string, error) {
		return outputIn(ctx, path, "nft", "list", "ruleset")
	}
	for _, tc := range []struct {
		name    string
		install func(context.Context, string, Rules) (Cleanup, error)
		list    lister
		marker  string
		count   int // how often marker appears once installed
	}{
		{"iptables", InstallIPTables, iptablesList, "REDIRECT", 4},
		{"nftables", InstallNFTables, nftList, "redirect", 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
			defer cancel()
			a, b := fixtures.NewPodPair(t)
			cleanup, err := tc.install(ctx, a.Path, testRules())
			if err != nil {
				t.Fatal(err)
			}
			listed, err := tc.list(ctx, a.Path)
			if err != nil {
				t.Fatal(err)
			}
			if n := strings.Count(listed, tc.marker); n != tc.count {
				t.Fatalf("want %d %q rules after install, got %d:\n%s", tc.count, tc.marker, n, listed)
			}
			if err := cleanup(ctx); err != nil {
				t.Fatalf("cleanup: %v", err)
			}
			listed, err = tc.list(ctx, a.Path)
			if err != nil {
				t.Fatal(err)
			}
			if strings.Contains(listed, tc.marker) || strings.Contains(listed, "MESHCAP") || strings.Contains(listed, nftTable) {
				t.Fatalf("rules left after cleanup:\n%s", listed)
			}

			// Installed in B, then B deleted: the cleanup has nothing to do.
			cleanupB, err := tc.install(ctx, b.Path, testRules())
			if err != nil {
				t.Fatal(err)
			}
			if err := netns.Remove(b.Path); err != nil {
				t.Fatal(err)
			}
			if err := cleanupB(ctx); err != nil {
				t.Fatalf("cleanup after netns removal: %v", err)
			}
		})
	}
}
