package capture

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/internal/netns"
)

// Pod is a test pod: a network namespace with loopback up and one interface, eth0,
// holding an IPv4 and an IPv6 test address.
type Pod struct {
	NetNS string
	IPv4  netip.Addr
	IPv6  netip.Addr
}

// Addr returns the pod's IPv6 address when v6 is set, its IPv4 address otherwise.
func (p Pod) Addr(v6 bool) netip.Addr {
	if v6 {
		return p.IPv6
	}
	return p.IPv4
}

// Test addresses of the two pods of NewPodPair. They live only inside the pair's
// own namespaces, so every pair can use the same ones.
var (
	podPrefix4 = netip.MustParsePrefix("10.199.0.0/24")
	podPrefix6 = netip.MustParsePrefix("fd00:199::/64")
)

// NewPodPair creates two pod namespaces joined by a veth pair, A (10.199.0.1,
// fd00:199::1) and B (10.199.0.2, fd00:199::2). Everything is removed in
// tb.Cleanup. Namespace names carry the pid and a random suffix, so parallel tests
// and other processes never collide.
func NewPodPair(tb testing.TB) (a, b Pod) {
	tb.Helper()
	var suffix [4]byte
	if _, err := rand.Read(suffix[:]); err != nil {
		tb.Fatalf("random suffix: %v", err)
	}
	base := fmt.Sprintf("meshcap-%d-%s", os.Getpid(), hex.EncodeToString(suffix[:]))
	a = Pod{
		NetNS: filepath.Join("/run/netns", base+"-a"),
		IPv4:  netip.MustParseAddr("10.199.0.1"),
		IPv6:  netip.MustParseAddr("fd00:199::1"),
	}
	b = Pod{
		NetNS: filepath.Join("/run/netns", base+"-b"),
		IPv4:  netip.MustParseAddr("10.199.0.2"),
		IPv6:  netip.MustParseAddr("fd00:199::2"),
	}
	for _, p := range []Pod{a, b} {
		if err := netns.Create(p.NetNS); err != nil {
			tb.Fatalf("create netns: %v", err)
		}
		tb.Cleanup(func() {
			if err := netns.Remove(p.NetNS); err != nil {
				tb.Errorf("remove netns: %v", err)
			}
		})
	}
	// The veth pair dies with the namespaces, so it needs no cleanup of its own.
	err := netns.Do(a.NetNS, func() error {
		peer, err := os.Open(b.NetNS)
		if err != nil {
			return err
		}
		defer peer.Close()
		veth := &netlink.Veth{
			LinkAttrs:     netlink.LinkAttrs{Name: "eth0"},
			PeerName:      "eth0",
			PeerNamespace: netlink.NsFd(int(peer.Fd())),
		}
		if err := netlink.LinkAdd(veth); err != nil {
			return fmt.Errorf("add veth pair: %w", err)
		}
		return nil
	})
	if err != nil {
		tb.Fatalf("link pods: %v", err)
	}
	for _, p := range []Pod{a, b} {
		if err := netns.Do(p.NetNS, func() error { return configurePod(p) }); err != nil {
			tb.Fatalf("configure pod %s: %v", p.NetNS, err)
		}
	}
	// The kernel turns carrier changes into "operationally up" (and swaps in a real
	// qdisc) from a deferred work item, up to a second later; packets sent before
	// that are dropped and a first connect waits for a SYN retransmit.
	for _, p := range []Pod{a, b} {
		if err := netns.Do(p.NetNS, waitOperUp); err != nil {
			tb.Fatalf("pod %s: %v", p.NetNS, err)
		}
	}
	return a, b
}

// waitOperUp polls until eth0 is operationally up.
func waitOperUp() error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		eth, err := netlinksafe.LinkByName("eth0")
		if err != nil {
			return fmt.Errorf("find eth0: %w", err)
		}
		if eth.Attrs().OperState == netlink.OperUp {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("eth0 not operationally up after 10s (state %s)", eth.Attrs().OperState)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func configurePod(p Pod) error {
	lo, err := netlinksafe.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("find lo: %w", err)
	}
	if err := netlink.LinkSetUp(lo); err != nil {
		return fmt.Errorf("set lo up: %w", err)
	}
	eth, err := netlinksafe.LinkByName("eth0")
	if err != nil {
		return fmt.Errorf("find eth0: %w", err)
	}
	for _, pfx := range []netip.Prefix{
		netip.PrefixFrom(p.IPv4, podPrefix4.Bits()),
		netip.PrefixFrom(p.IPv6, podPrefix6.Bits()),
	} {
		addr := &netlink.Addr{IPNet: &net.IPNet{
			IP:   pfx.Addr().AsSlice(),
			Mask: net.CIDRMask(pfx.Bits(), pfx.Addr().BitLen()),
		}}
		if pfx.Addr().Is6() {
			// Without NODAD the address stays tentative (unusable) for a second or more.
			addr.Flags = unix.IFA_F_NODAD
		}
		if err := netlink.AddrAdd(eth, addr); err != nil {
			return fmt.Errorf("add %s to eth0: %w", pfx, err)
		}
	}
	if err := netlink.LinkSetUp(eth); err != nil {
		return fmt.Errorf("set eth0 up: %w", err)
	}
	return nil
}

// Dial connects from inside the pod to dst.
func (p Pod) Dial(ctx context.Context, dst netip.AddrPort) (*net.TCPConn, error) {
	var c net.Conn
	err := netns.Do(p.NetNS, func() error {
		var d net.Dialer
		var err error
		c, err = d.DialContext(ctx, "tcp", dst.String())
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("dial %s from %s: %w", dst, p.NetNS, err)
	}
	return c.(*net.TCPConn), nil
}

// ServeEcho runs a plain TCP echo server in the pod on the wildcard address (IPv4
// and IPv6) at port until tb's cleanup.
func (p Pod) ServeEcho(tb testing.TB, port uint16) {
	tb.Helper()
	var ln net.Listener
	err := netns.Do(p.NetNS, func() error {
		var err error
		ln, err = net.Listen("tcp", fmt.Sprintf(":%d", port))
		return err
	})
	if err != nil {
		tb.Fatalf("echo server in %s: %v", p.NetNS, err)
	}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		conns = map[net.Conn]bool{}
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns[c] = true
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer func() {
					mu.Lock()
					delete(conns, c)
					mu.Unlock()
					c.Close()
				}()
				if _, err := io.Copy(c, c); err == nil {
					_ = c.(*net.TCPConn).CloseWrite()
				}
			}()
		}
	}()
	tb.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
}

// EchoRoundTrip sends payload on conn, half-closes it, reads until EOF and checks
// that exactly payload came back. It writes and reads at once, so payloads larger
// than the socket buffers cannot deadlock. conn is closed on return.
func EchoRoundTrip(ctx context.Context, conn *net.TCPConn, payload []byte) error {
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	writeErr := make(chan error, 1)
	go func() {
		if _, err := conn.Write(payload); err != nil {
			writeErr <- fmt.Errorf("write: %w", err)
			return
		}
		writeErr <- conn.CloseWrite()
	}()
	got, readErr := io.ReadAll(conn)
	err := errors.Join(<-writeErr, readErr)
	if ctx.Err() != nil {
		return fmt.Errorf("echo round trip: %w (%v)", ctx.Err(), err)
	}
	if err != nil {
		return fmt.Errorf("echo round trip: %w", err)
	}
	if !bytes.Equal(got, payload) {
		return fmt.Errorf("echo round trip: sent %d bytes, got %d bytes back that differ", len(payload), len(got))
	}
	return nil
}
