package redirect

import (
	"net/netip"
	"reflect"
	"strings"
	"testing"
)

func TestSettingsValidate(t *testing.T) {
	many := make([]uint16, MaxExcludedPorts+1)
	for i := range many {
		many[i] = uint16(i + 1)
	}
	for _, tc := range []struct {
		name    string
		mutate  func(*Settings)
		wantErr string
	}{
		{"defaults", func(*Settings) {}, ""},
		{"no mark", func(s *Settings) { s.ProxyMark, s.ProxyMarkMask = 0, 0 }, ""},
		{"exact mark", func(s *Settings) { s.ProxyMarkMask = 0 }, ""},
		{"zero outbound", func(s *Settings) { s.OutboundPort = 0 }, "outbound port is 0"},
		{"zero inbound", func(s *Settings) { s.InboundPort = 0 }, "inbound port is 0"},
		{"same ports", func(s *Settings) { s.InboundPort = s.OutboundPort }, "both 15001"},
		{"mark outside mask", func(s *Settings) { s.ProxyMark = 0x1539 }, "outside mask"},
		{"port 0 excluded inbound", func(s *Settings) { s.InboundExcludedPorts = append(s.InboundExcludedPorts, 0) }, "inbound excluded port 0"},
		{"port 0 excluded outbound", func(s *Settings) { s.OutboundExcludedPorts = []uint16{0} }, "outbound excluded port 0"},
		{"too many ports", func(s *Settings) { s.OutboundExcludedPorts = many }, "outbound excluded ports, at most"},
		{"duplicate ports are fine", func(s *Settings) { s.InboundExcludedPorts = append(s.InboundExcludedPorts, s.InboundExcludedPorts...) }, ""},
		{"invalid CIDR", func(s *Settings) { s.ExcludedCIDRs = []netip.Prefix{{}} }, "invalid excluded CIDR"},
		{"kubelet ports", func(s *Settings) { s.KubeletPortsOnly, s.KubeletPorts = true, []uint16{8080, 8080} }, ""},
		{"kubelet to no port", func(s *Settings) { s.KubeletPortsOnly = true }, ""},
		{"kubelet ports unused", func(s *Settings) { s.KubeletPorts = []uint16{8080} }, "without KubeletPortsOnly"},
		{"kubelet port 0", func(s *Settings) { s.KubeletPortsOnly, s.KubeletPorts = true, []uint16{0} }, "kubelet port 0"},
		{"too many kubelet ports", func(s *Settings) { s.KubeletPortsOnly, s.KubeletPorts = true, many[:MaxKubeletPorts+1] }, "probes and hooks, at most"},
		{"invalid probe source", func(s *Settings) {
			s.ProbeSources = []netip.Prefix{netip.PrefixFrom(netip.MustParseAddr("10.0.0.1"), 33)}
		}, "invalid probe source"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := testSettings()
			tc.mutate(&s)
			err := s.Validate()
			switch {
			case tc.wantErr == "" && err != nil:
				t.Errorf("unexpected error: %v", err)
			case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
				t.Errorf("error %v, want one containing %q", err, tc.wantErr)
			}
		})
	}
}

func TestSettingsRoundTrip(t *testing.T) {
	uid := uint32(1337)
	s := Settings{
		OutboundPort:          15001,
		InboundPort:           15006,
		ProxyMark:             0x539,
		ProxyUID:              &uid,
		InboundExcludedPorts:  []uint16{22, 15001, 22},
		OutboundExcludedPorts: []uint16{443},
		ExcludedCIDRs: []netip.Prefix{
			netip.MustParsePrefix("10.0.0.7/8"),
			netip.MustParsePrefix("::ffff:192.168.0.0/112"), // IPv4-mapped: stored as IPv4
			netip.MustParsePrefix("fd00::/8"),
			netip.MustParsePrefix("10.0.0.0/8"),
		},
		ProbeSources:     []netip.Prefix{netip.MustParsePrefix("169.254.7.1/32")},
		FailOpen:         true,
		ReplyMark:        0x111,
		BypassInbound:    true,
		KubeletPortsOnly: true,
		KubeletPorts:     []uint16{8080, 80, 8080},
	}
	n := s.normalized()
	want := Settings{
		OutboundPort:          15001,
		InboundPort:           15006,
		ProxyMark:             0x539,
		ProxyMarkMask:         0xffffffff,
		ProxyUID:              &uid,
		InboundExcludedPorts:  []uint16{22, 15001},
		OutboundExcludedPorts: []uint16{443},
		ExcludedCIDRs: []netip.Prefix{
			netip.MustParsePrefix("10.0.0.0/8"),
			netip.MustParsePrefix("192.168.0.0/16"),
			netip.MustParsePrefix("fd00::/8"),
		},
		ProbeSources:     []netip.Prefix{netip.MustParsePrefix("169.254.7.1/32")},
		FailOpen:         true,
		ReplyMark:        0x111,
		ReplyMarkMask:    0xffffffff,
		BypassInbound:    true,
		KubeletPortsOnly: true,
		KubeletPorts:     []uint16{80, 8080},
	}
	if !reflect.DeepEqual(n, want) {
		t.Fatalf("normalized:\n%+v\nwant\n%+v", n, want)
	}

	// Through the map value and the set keys and back.
	const set = 0x11223344
	var excluded, probes []netip.Prefix
	for _, p := range n.ExcludedCIDRs {
		id, back, ok := prefixFromLPM(lpmKey(set, p))
		if !ok || id != set || back != p {
			t.Errorf("trie key of %s read back as %d %s %v", p, id, back, ok)
		}
		excluded = append(excluded, back)
	}
	for _, p := range n.ProbeSources {
		_, back, _ := prefixFromLPM(lpmKey(set, p))
		probes = append(probes, back)
	}
	addrs := podAddrs{
		all:  []netip.Addr{netip.MustParseAddr("10.1.2.3"), netip.MustParseAddr("fd00::3"), netip.MustParseAddr("fe80::3")},
		src4: netip.MustParseAddr("10.1.2.3"), src6: netip.MustParseAddr("fd00::3"), scope: 2,
	}
	v := n.toBPF(podSets{excluded: 1, probes: 2, inPorts: 3, outPorts: 4})
	net := addrs.toBPF(n)
	if got := podAddrsFromBPF(net); !reflect.DeepEqual(got, addrs.all) {
		t.Errorf("addresses read back as %v, want %v", got, addrs.all)
	}
	if got := settingsFromBPF(v, &net, excluded, probes, n.InboundExcludedPorts, n.OutboundExcludedPorts); !reflect.DeepEqual(got, n) {
		t.Errorf("map round trip:\n%+v\nwant\n%+v", got, n)
	}
	d := DefaultSettings().normalized()
	dnet := podAddrs{}.toBPF(d)
	if got := settingsFromBPF(d.toBPF(podSets{inPorts: 1}), &dnet, nil, nil, d.InboundExcludedPorts, nil); !reflect.DeepEqual(got, d) {
		t.Errorf("defaults do not round-trip: %+v", got)
	}
}

func TestLPMKeyLayout(t *testing.T) {
	k := lpmKey(1, netip.MustParsePrefix("10.1.2.0/24"))
	if k.Prefixlen != 32+96+24 {
		t.Errorf("IPv4 prefix length %d", k.Prefixlen)
	}
	b := wordsAddr(k.Addr)
	if want := netip.MustParseAddr("::ffff:10.1.2.0").As16(); b != want {
		t.Errorf("IPv4 key address %v, want IPv4-mapped %v", b, want)
	}
	k6 := lpmKey(1, netip.MustParsePrefix("fd00::/8"))
	if k6.Prefixlen != 32+8 {
		t.Errorf("IPv6 prefix length %d", k6.Prefixlen)
	}
	if _, _, ok := prefixFromLPM(redirectLpmKey{Prefixlen: 10}); ok {
		t.Error("a prefix shorter than the set id must not parse")
	}
}

func TestParseCgroup2Mount(t *testing.T) {
	for _, tc := range []struct {
		name, mountinfo, want string
		wantErr               bool
	}{
		{
			name: "unified",
			mountinfo: "24 1 0:22 / /sys/fs/cgroup rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate\n" +
				"25 24 0:23 / /sys/fs/bpf rw - bpf bpf rw\n",
			want: "/sys/fs/cgroup",
		},
		{
			name: "hybrid",
			mountinfo: "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n" +
				"32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n" +
				"41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n",
			want: "/sys/fs/cgroup/unified",
		},
		{
			name: "sub-tree first, root later",
			mountinfo: "50 1 0:40 /kubepods /run/cg rw - cgroup2 cgroup2 rw\n" +
				"51 1 0:40 / /mnt/cg\\040root rw - cgroup2 cgroup2 rw\n",
			want: "/mnt/cg root",
		},
		{
			name:      "only a sub-tree",
			mountinfo: "50 1 0:40 /kubepods /sys/fs/cgroup rw master:1 - cgroup2 cgroup2 rw\n",
			want:      "/sys/fs/cgroup",
		},
		{name: "none", mountinfo: "25 24 0:23 / /sys/fs/bpf rw - bpf bpf rw\n", wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseCgroup2Mount(strings.NewReader(tc.mountinfo))
			if (err != nil) != tc.wantErr || got != tc.want {
				t.Errorf("got %q, %v; want %q (error %v)", got, err, tc.want, tc.wantErr)
			}
		})
	}
}
