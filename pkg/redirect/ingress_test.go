package redirect

import (
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/mesh-cni/mesh-cni/pkg/netns"
)

// TCX verdicts (enum tcx_action_base).
const (
	tcxNext = -1
	tcxDrop = 2
)

const (
	tcpFIN = 0x01
	tcpSYN = 0x02
	tcpACK = 0x10
)

// pkt describes a hand-built Ethernet frame for BPF_PROG_TEST_RUN.
type pkt struct {
	etherType uint16 // 0: from the address family
	src, dst  netip.Addr
	proto     uint8 // 0: TCP
	sport     uint16
	dport     uint16
	flags     uint8
	fragment  bool // IPv4 MF set / IPv6 fragment header
	hopByHop  bool // IPv6 hop-by-hop options header before TCP
}

func (p pkt) bytes() []byte {
	proto := p.proto
	if proto == 0 {
		proto = 6
	}
	tcp := make([]byte, 20)
	binary.BigEndian.PutUint16(tcp[0:], p.sport)
	binary.BigEndian.PutUint16(tcp[2:], p.dport)
	binary.BigEndian.PutUint32(tcp[4:], 1)
	tcp[12] = 5 << 4
	tcp[13] = p.flags
	binary.BigEndian.PutUint16(tcp[14:], 65535)

	eth := make([]byte, 14)
	copy(eth[0:6], []byte{2, 0, 0, 0, 0, 1})
	copy(eth[6:12], []byte{2, 0, 0, 0, 0, 2})
	var ip []byte
	if p.src.Is4() {
		binary.BigEndian.PutUint16(eth[12:], 0x0800)
		ip = make([]byte, 20)
		ip[0] = 0x45
		binary.BigEndian.PutUint16(ip[2:], uint16(20+len(tcp)))
		if p.fragment {
			binary.BigEndian.PutUint16(ip[6:], 0x2000) // MF
		}
		ip[8] = 64
		ip[9] = proto
		copy(ip[12:16], p.src.AsSlice())
		copy(ip[16:20], p.dst.AsSlice())
	} else {
		binary.BigEndian.PutUint16(eth[12:], 0x86dd)
		var ext []byte
		next := proto
		if p.fragment {
			ext = append(ext, next, 0, 0, 1, 0, 0, 0, 1) // offset 0, MF
			next = 44
		}
		if p.hopByHop {
			// PadN filling the 8 bytes of an empty hop-by-hop header.
			ext = append([]byte{next, 0, 1, 4, 0, 0, 0, 0}, ext...)
			next = 0
		}
		ip = make([]byte, 40)
		ip[0] = 0x60
		binary.BigEndian.PutUint16(ip[4:], uint16(len(ext)+len(tcp)))
		ip[6] = next
		ip[7] = 64
		copy(ip[8:24], p.src.AsSlice())
		copy(ip[24:40], p.dst.AsSlice())
		ip = append(ip, ext...)
	}
	if p.etherType != 0 {
		binary.BigEndian.PutUint16(eth[12:], p.etherType)
	}
	out := append(eth, ip...)
	return append(out, tcp...)
}

// mustRun runs the ingress program on one packet inside the netns at path (the
// test run's device is that netns's loopback) and returns its verdict.
func mustRun(t *testing.T, prog *ebpf.Program, path string, data []byte) int32 {
	t.Helper()
	var ret uint32
	err := netns.Do(path, func() error {
		var err error
		ret, err = prog.Run(&ebpf.RunOptions{Data: data})
		return err
	})
	if err != nil {
		t.Fatalf("run ingress program: %v", err)
	}
	return int32(ret)
}

func readCounters(t *testing.T, m *ebpf.Map) [counterMax]uint64 {
	t.Helper()
	var out [counterMax]uint64
	for i := range counterMax {
		var perCPU []uint64
		if err := m.Lookup(i, &perCPU); err != nil {
			t.Fatal(err)
		}
		for _, v := range perCPU {
			out[i] += v
		}
	}
	return out
}

// TestIngressDecisions runs the TCX program on hand-built packets. The objects are
// loaded but attached nowhere.
func TestIngressDecisions(t *testing.T) {
	requireRoot(t)
	var objs redirectObjects
	if err := loadRedirectObjects(&objs, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { objs.Close() })

	enrolled := newNetns(t, "enrolled")
	other := newNetns(t, "other")
	s := DefaultSettings()
	s.ProbeSources = []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24"), netip.MustParsePrefix("2001:db8::/32")}
	s = s.normalized()
	if err := objs.Settings.Put(enrolled.cookie, s.toBPF()); err != nil {
		t.Fatal(err)
	}
	for _, p := range s.ProbeSources {
		if err := objs.ProbeSrcs.Put(lpmKey(enrolled.cookie, p), uint8(1)); err != nil {
			t.Fatal(err)
		}
	}
	failOpen := newNetns(t, "failopen")
	fo := DefaultSettings()
	fo.FailOpen = true
	if err := objs.Settings.Put(failOpen.cookie, fo.normalized().toBPF()); err != nil {
		t.Fatal(err)
	}

	listening := newNetns(t, "listening")
	if err := objs.Settings.Put(listening.cookie, DefaultSettings().normalized().toBPF()); err != nil {
		t.Fatal(err)
	}
	listening.listen(t, "[::]:15006")

	client4, pod4 := netip.MustParseAddr("10.1.0.1"), netip.MustParseAddr("10.1.0.2")
	client6, pod6 := netip.MustParseAddr("fd00:1::1"), netip.MustParseAddr("fd00:1::2")
	probe4, probe6 := netip.MustParseAddr("192.0.2.10"), netip.MustParseAddr("2001:db8::10")
	syn := func(src, dst netip.Addr, dport uint16) pkt {
		return pkt{src: src, dst: dst, sport: 40000, dport: dport, flags: tcpSYN}
	}

	type counterDelta struct{ passed, dropped uint64 }
	for _, tc := range []struct {
		name string
		ns   *pod
		p    pkt
		want int32
		in   counterDelta
	}{
		{"arp", enrolled, pkt{etherType: 0x0806, src: client4, dst: pod4}, tcxNext, counterDelta{}},
		{"udp", enrolled, pkt{src: client4, dst: pod4, proto: 17, dport: 53}, tcxNext, counterDelta{}},
		{"ipv4 fragment", enrolled, pkt{src: client4, dst: pod4, dport: 80, flags: tcpSYN, fragment: true}, tcxNext, counterDelta{}},
		{"ipv6 fragment", enrolled, pkt{src: client6, dst: pod6, dport: 80, flags: tcpSYN, fragment: true}, tcxNext, counterDelta{}},
		{"netns not enrolled", other, syn(client4, pod4, 80), tcxNext, counterDelta{}},
		{"excluded port v4", enrolled, syn(client4, pod4, 15008), tcxNext, counterDelta{passed: 1}},
		{"excluded port v6", enrolled, syn(client6, pod6, 15090), tcxNext, counterDelta{passed: 1}},
		{"probe source v4", enrolled, syn(probe4, pod4, 80), tcxNext, counterDelta{passed: 1}},
		{"probe source v6", enrolled, syn(probe6, pod6, 80), tcxNext, counterDelta{passed: 1}},
		{"no proxy v4", enrolled, syn(client4, pod4, 80), tcxDrop, counterDelta{dropped: 1}},
		{"no proxy v6", enrolled, syn(client6, pod6, 80), tcxDrop, counterDelta{dropped: 1}},
		{"no proxy v6 after hop-by-hop", enrolled, pkt{src: client6, dst: pod6, sport: 40000, dport: 80, flags: tcpSYN, hopByHop: true}, tcxDrop, counterDelta{dropped: 1}},
		{"no proxy, fail-open", failOpen, syn(client4, pod4, 80), tcxNext, counterDelta{passed: 1}},
		// BPF_PROG_TEST_RUN is not tc ingress, where alone bpf_sk_assign works: the
		// listener is found but cannot be assigned, which must fail closed too.
		// Real traffic tests cover the assignment.
		{"proxy listening, assignment fails", listening, syn(client4, pod4, 80), tcxDrop, counterDelta{dropped: 1}},
		{"ack without a socket", enrolled, pkt{src: client4, dst: pod4, sport: 40000, dport: 80, flags: tcpACK}, tcxNext, counterDelta{}},
		{"syn-ack without a socket", enrolled, pkt{src: client4, dst: pod4, sport: 80, dport: 40000, flags: tcpSYN | tcpACK}, tcxNext, counterDelta{}},
		{"fin without a socket", enrolled, pkt{src: client6, dst: pod6, sport: 40000, dport: 80, flags: tcpFIN | tcpACK}, tcxNext, counterDelta{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := readCounters(t, objs.Counters)
			if got := mustRun(t, objs.MeshIngress, tc.ns.path, tc.p.bytes()); got != tc.want {
				t.Errorf("verdict %d, want %d", got, tc.want)
			}
			after := readCounters(t, objs.Counters)
			got := counterDelta{
				passed:  after[counterInPassed] - before[counterInPassed],
				dropped: after[counterInDropped] - before[counterInDropped],
			}
			if got != tc.in {
				t.Errorf("inbound counters moved by %+v, want %+v", got, tc.in)
			}
			if r := after[counterInRedirected] - before[counterInRedirected]; r != 0 {
				t.Errorf("redirected moved by %d", r)
			}
		})
	}
	// Nothing was assigned, so nothing may have been recorded for getsockopt.
	var (
		k redirectTupleKey
		v redirectOrigDst
	)
	if it := objs.OrigDsts.Iterate(); it.Next(&k, &v) {
		t.Errorf("original destination recorded without an assignment: %+v -> %+v", k, v)
	}
}
