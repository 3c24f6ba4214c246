package redirect

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// A pod root with CAP_NET_RAW (a default capability) crafts SYNs from a raw socket
// in packet shapes a packet parser might not read: IPv4 fragments, IPv4 options,
// IPv6 fragment headers (split and atomic), IPv6 extension headers. The server
// pod's application listens, its inbound proxy does not: every shape must be
// refused (reset), none answered by the application. The same shapes sent to the
// pod once it is released are answered, which shows each one reaches the stack.
func TestCraftedSYNsFailClosed(t *testing.T) {
	d, a, b := parallelRig(t)
	startApp(t, b, appPort)

	shapes := []struct {
		name  string
		build func(src, dst netip.Addr, sport, dport uint16) [][]byte
	}{
		{"plain", plainSYN},
		{"IPv4 in two fragments", fragmentedSYN4},
		{"IPv4 with options", optionsSYN4},
		{"IPv6 in two fragments", fragmentedSYN6},
		{"IPv6 atomic fragment", atomicFragmentSYN6},
		{"IPv6 hop-by-hop and destination options", extHeadersSYN6},
	}
	send := func(t *testing.T, build func(src, dst netip.Addr, sport, dport uint16) [][]byte, src, dst netip.Addr) (reply uint8, ok bool) {
		sport := uint16(20000 + rand.IntN(20000))
		pkts := build(src, dst, sport, appPort)
		if pkts == nil {
			t.Skip("shape not of this family")
		}
		return rawExchange(t, a, src, dst, sport, appPort, pkts)
	}
	for _, fam := range []struct {
		name     string
		src, dst netip.Addr
	}{{"ipv4", a.addr4, b.addr4}, {"ipv6", a.addr6, b.addr6}} {
		for _, sh := range shapes {
			t.Run(fam.name+"/"+sh.name, func(t *testing.T) {
				if (sh.name[:4] == "IPv4" && fam.dst.Is6()) || (sh.name[:4] == "IPv6" && fam.dst.Is4()) {
					t.Skip("shape of the other family")
				}
				enroll(t, d, b, testSettings())
				flags, ok := send(t, sh.build, fam.src, fam.dst)
				if !ok || flags&tcpRST == 0 || flags&tcpSYN != 0 {
					t.Errorf("enrolled, no inbound proxy: reply flags %#x (seen %v), want a reset", flags, ok)
				}
				if err := d.Release(t.Context(), b.cookie); err != nil {
					t.Fatal(err)
				}
				flags, ok = send(t, sh.build, fam.src, fam.dst)
				if !ok || flags&(tcpSYN|tcpACK) != tcpSYN|tcpACK {
					t.Errorf("released: reply flags %#x (seen %v), want the application's SYN-ACK", flags, ok)
				}
			})
		}
	}
}

const (
	tcpSYN = 0x02
	tcpRST = 0x04
	tcpACK = 0x10
)

// rawExchange sends pkts (whole IP packets) from inside p and returns the TCP flags
// of the first packet from dst:dport to src:sport seen on p's eth0.
func rawExchange(t *testing.T, p *pod, src, dst netip.Addr, sport, dport uint16, pkts [][]byte) (flags uint8, seen bool) {
	t.Helper()
	var capture, raw int
	p.do(t, func() error {
		var err error
		capture, err = unix.Socket(unix.AF_PACKET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_ALL)))
		if err != nil {
			return fmt.Errorf("packet socket: %w", err)
		}
		iface, err := net.InterfaceByName(ifName)
		if err != nil {
			return err
		}
		if err := unix.Bind(capture, &unix.SockaddrLinklayer{Protocol: htons(unix.ETH_P_ALL), Ifindex: iface.Index}); err != nil {
			return fmt.Errorf("bind packet socket: %w", err)
		}
		fam := unix.AF_INET
		if dst.Is6() {
			fam = unix.AF_INET6
		}
		raw, err = unix.Socket(fam, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW)
		if err != nil {
			return fmt.Errorf("raw socket: %w", err)
		}
		return nil
	})
	defer unix.Close(capture)
	defer unix.Close(raw)
	tv := unix.NsecToTimeval(int64(200 * time.Millisecond))
	if err := unix.SetsockoptTimeval(capture, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		t.Fatal(err)
	}
	var to unix.Sockaddr = &unix.SockaddrInet6{Addr: dst.As16()}
	if dst.Is4() {
		to = &unix.SockaddrInet4{Addr: dst.As4()}
	}
	for _, pkt := range pkts {
		if err := unix.Sendto(raw, pkt, 0, to); err != nil {
			t.Fatalf("send crafted packet: %v", err)
		}
	}
	buf := make([]byte, 2048)
	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) {
		n, _, err := unix.Recvfrom(capture, buf, 0)
		if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			t.Fatalf("capture: %v", err)
		}
		if f, ok := tcpReply(buf[:n], dst, src, dport, sport); ok {
			return f, true
		}
	}
	return 0, false
}

// tcpReply parses an IP packet and reports its TCP flags when it goes from from:fport
// to to:tport (an unfragmented packet, as replies are).
func tcpReply(b []byte, from, to netip.Addr, fport, tport uint16) (uint8, bool) {
	var l4 []byte
	switch {
	case len(b) >= 20 && b[0]>>4 == 4:
		ihl := int(b[0]&0x0f) * 4
		if b[9] != unix.IPPROTO_TCP || len(b) < ihl+14 ||
			netip.AddrFrom4([4]byte(b[12:16])) != from || netip.AddrFrom4([4]byte(b[16:20])) != to {
			return 0, false
		}
		l4 = b[ihl:]
	case len(b) >= 40 && b[0]>>4 == 6:
		if b[6] != unix.IPPROTO_TCP || len(b) < 54 ||
			netip.AddrFrom16([16]byte(b[8:24])) != from || netip.AddrFrom16([16]byte(b[24:40])) != to {
			return 0, false
		}
		l4 = b[40:]
	default:
		return 0, false
	}
	if binary.BigEndian.Uint16(l4[0:]) != fport || binary.BigEndian.Uint16(l4[2:]) != tport {
		return 0, false
	}
	return l4[13], true
}

// synSegment is a TCP SYN with a 20-byte header and data (none for most shapes),
// with its checksum over the family's pseudo header.
func synSegment(src, dst netip.Addr, sport, dport uint16, data ...byte) []byte {
	tcp := make([]byte, 20, 20+len(data))
	binary.BigEndian.PutUint16(tcp[0:], sport)
	binary.BigEndian.PutUint16(tcp[2:], dport)
	binary.BigEndian.PutUint32(tcp[4:], rand.Uint32())
	tcp[12] = 5 << 4
	tcp[13] = tcpSYN
	binary.BigEndian.PutUint16(tcp[14:], 64240)
	tcp = append(tcp, data...)
	var pseudo []byte
	pseudo = append(pseudo, src.AsSlice()...)
	pseudo = append(pseudo, dst.AsSlice()...)
	if src.Is4() {
		pseudo = append(pseudo, 0, unix.IPPROTO_TCP, 0, byte(len(tcp)))
	} else {
		pseudo = append(pseudo, 0, 0, 0, byte(len(tcp)), 0, 0, 0, unix.IPPROTO_TCP)
	}
	binary.BigEndian.PutUint16(tcp[16:], checksum(append(pseudo, tcp...)))
	return tcp
}

func checksum(b []byte) uint16 {
	var sum uint32
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(binary.BigEndian.Uint16(b[i:]))
	}
	if len(b)%2 == 1 {
		sum += uint32(b[len(b)-1]) << 8
	}
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	return ^uint16(sum)
}

// ipv4 is an IPv4 header (the kernel fills in the checksum for IP_HDRINCL).
func ipv4(src, dst netip.Addr, id uint16, fragWord uint16, options []byte, payload []byte) []byte {
	ihl := 20 + len(options)
	h := make([]byte, ihl, ihl+len(payload))
	h[0] = 0x40 | byte(ihl/4)
	binary.BigEndian.PutUint16(h[2:], uint16(ihl+len(payload)))
	binary.BigEndian.PutUint16(h[4:], id)
	binary.BigEndian.PutUint16(h[6:], fragWord)
	h[8] = 64
	h[9] = unix.IPPROTO_TCP
	copy(h[12:], src.AsSlice())
	copy(h[16:], dst.AsSlice())
	copy(h[20:], options)
	return append(h, payload...)
}

// ipv6 is an IPv6 header followed by ext (extension headers, first next header
// given) and payload.
func ipv6(src, dst netip.Addr, next uint8, ext, payload []byte) []byte {
	h := make([]byte, 40, 40+len(ext)+len(payload))
	h[0] = 0x60
	binary.BigEndian.PutUint16(h[4:], uint16(len(ext)+len(payload)))
	h[6] = next
	h[7] = 64
	copy(h[8:], src.AsSlice())
	copy(h[24:], dst.AsSlice())
	return append(append(h, ext...), payload...)
}

const (
	ipv6HopByHop = 0
	ipv6Fragment = 44
	ipv6DestOpts = 60
	ipv4MoreFrag = 0x2000
)

func plainSYN(src, dst netip.Addr, sport, dport uint16) [][]byte {
	tcp := synSegment(src, dst, sport, dport)
	if src.Is4() {
		return [][]byte{ipv4(src, dst, uint16(rand.Uint32()), 0, nil, tcp)}
	}
	return [][]byte{ipv6(src, dst, unix.IPPROTO_TCP, nil, tcp)}
}

// fragmentedSYN4: the first fragment carries the ports and sequence number, the
// second (offset 8) the flags.
func fragmentedSYN4(src, dst netip.Addr, sport, dport uint16) [][]byte {
	if !src.Is4() {
		return nil
	}
	tcp := synSegment(src, dst, sport, dport)
	id := uint16(rand.Uint32())
	return [][]byte{
		ipv4(src, dst, id, ipv4MoreFrag, nil, tcp[:8]),
		ipv4(src, dst, id, 1, nil, tcp[8:]),
	}
}

func optionsSYN4(src, dst netip.Addr, sport, dport uint16) [][]byte {
	if !src.Is4() {
		return nil
	}
	nops := []byte{1, 1, 1, 1} // four NOPs: IHL 6
	return [][]byte{ipv4(src, dst, uint16(rand.Uint32()), 0, nops, synSegment(src, dst, sport, dport))}
}

func fragHeader(next uint8, offset8 uint16, more bool, id uint32) []byte {
	h := make([]byte, 8)
	h[0] = next
	w := offset8 << 3
	if more {
		w |= 1
	}
	binary.BigEndian.PutUint16(h[2:], w)
	binary.BigEndian.PutUint32(h[4:], id)
	return h
}

// fragmentedSYN6 carries data in the SYN so that it can be split after the TCP
// header: an IPv6 first fragment that cuts the upper-layer header short is dropped
// by the receiver (RFC 8200).
func fragmentedSYN6(src, dst netip.Addr, sport, dport uint16) [][]byte {
	if !src.Is6() {
		return nil
	}
	tcp := synSegment(src, dst, sport, dport, make([]byte, 12)...)
	id := rand.Uint32()
	return [][]byte{
		ipv6(src, dst, ipv6Fragment, fragHeader(unix.IPPROTO_TCP, 0, true, id), tcp[:24]),
		ipv6(src, dst, ipv6Fragment, fragHeader(unix.IPPROTO_TCP, 3, false, id), tcp[24:]),
	}
}

// atomicFragmentSYN6 has a fragment header that says offset 0, no more fragments.
func atomicFragmentSYN6(src, dst netip.Addr, sport, dport uint16) [][]byte {
	if !src.Is6() {
		return nil
	}
	return [][]byte{ipv6(src, dst, ipv6Fragment, fragHeader(unix.IPPROTO_TCP, 0, false, rand.Uint32()),
		synSegment(src, dst, sport, dport))}
}

func extHeadersSYN6(src, dst netip.Addr, sport, dport uint16) [][]byte {
	if !src.Is6() {
		return nil
	}
	// Each 8-byte header is padded with PadN.
	hop := []byte{ipv6DestOpts, 0, 1, 4, 0, 0, 0, 0}
	dest := []byte{unix.IPPROTO_TCP, 0, 1, 4, 0, 0, 0, 0}
	return [][]byte{ipv6(src, dst, ipv6HopByHop, append(hop, dest...), synSegment(src, dst, sport, dport))}
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }
