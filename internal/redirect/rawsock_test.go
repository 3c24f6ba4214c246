package redirect

import (
	"context"
	"errors"
	"math/rand/v2"
	"path/filepath"
	"testing"

	"go.uber.org/zap/zaptest"
	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// A pod's root with CAP_NET_RAW, a default capability, sends a SYN from a raw
// socket: the kernel's TCP stack never sees a connect(), so the outbound capture
// does not either, and the SYN reaches a server outside the mesh although the
// pod's outbound proxy is down (fail-closed for connects). With DenyRawSockets
// the pod cannot create the socket; every other socket, and raw sockets in pods
// without the setting or after the pod's release, are unaffected.
func TestDenyRawSockets(t *testing.T) {
	d, a, b := parallelRig(t)
	startApp(t, b, appPort)

	// Without the setting: the raw SYN gets the application's SYN-ACK.
	enroll(t, d, a, testSettings())
	sport := uint16(20000 + rand.IntN(20000))
	flags, ok := rawExchange(t, a, a.addr4, b.addr4, sport, appPort, plainSYN(a.addr4, b.addr4, sport, appPort))
	if !ok || flags&(tcpSYN|tcpACK) != tcpSYN|tcpACK {
		t.Fatalf("raw SYN from an enrolled pod without the setting: reply flags %#x (seen %v), want the server's SYN-ACK (the gap the setting closes)", flags, ok)
	}
	if err := d.Release(t.Context(), a.cookie); err != nil {
		t.Fatal(err)
	}

	s := testSettings()
	s.DenyRawSockets = true
	enroll(t, d, a, s)
	before, err := d.Counters()
	if err != nil {
		t.Fatal(err)
	}
	raw := []struct {
		name          string
		family, proto int
	}{
		{"IPv4 raw (IP_HDRINCL)", unix.AF_INET, unix.IPPROTO_RAW},
		{"IPv4 raw TCP", unix.AF_INET, unix.IPPROTO_TCP},
		{"IPv6 raw TCP", unix.AF_INET6, unix.IPPROTO_TCP},
		{"IPv4 raw ICMP", unix.AF_INET, unix.IPPROTO_ICMP},
	}
	open := func(p *pod, family, typ, proto int) (err error) {
		p.do(t, func() error {
			fd, serr := unix.Socket(family, typ|unix.SOCK_CLOEXEC, proto)
			if serr == nil {
				unix.Close(fd)
			}
			err = serr
			return nil
		})
		return err
	}
	for _, r := range raw {
		if err := open(a, r.family, unix.SOCK_RAW, r.proto); !errors.Is(err, unix.EPERM) {
			t.Errorf("%s socket in the pod with DenyRawSockets: %v, want EPERM", r.name, err)
		}
		if err := open(b, r.family, unix.SOCK_RAW, r.proto); err != nil {
			t.Errorf("%s socket in a pod that is not enrolled: %v", r.name, err)
		}
	}
	for _, typ := range []int{unix.SOCK_STREAM, unix.SOCK_DGRAM} {
		for _, fam := range []int{unix.AF_INET, unix.AF_INET6} {
			if err := open(a, fam, typ, 0); err != nil {
				t.Errorf("socket(%d, %d) in the pod with DenyRawSockets: %v", fam, typ, err)
			}
		}
	}
	after, err := d.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if got := after.RawSocketsRefused - before.RawSocketsRefused; got != uint64(len(raw)) {
		t.Errorf("RawSocketsRefused went up by %d, want %d", got, len(raw))
	}
	list, err := d.List(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range list {
		if e.Cookie == a.cookie && !e.Settings.DenyRawSockets {
			t.Errorf("the pod's settings read back as %+v, want DenyRawSockets", e.Settings)
		}
	}

	if err := d.Release(t.Context(), a.cookie); err != nil {
		t.Fatal(err)
	}
	if err := open(a, unix.AF_INET, unix.SOCK_RAW, unix.IPPROTO_RAW); err != nil {
		t.Errorf("raw socket in the released pod: %v", err)
	}
}

// With the BPF LSM on the node, packet sockets (which the cgroup socket hook never
// sees: a frame from one is anything the pod builds, a TCP handshake as the
// node's address after answering ARP for it included) are refused to a pod
// enrolled with DenyPacketSockets; every other socket, other pods and the pod
// once released are unaffected. A pod asking for it from a data path without the
// hook is refused at enrollment.
func TestDenyPacketSockets(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	without, _ := testDatapath(t)
	a, b := newPodPair(t)
	s := testSettings()
	s.DenyPacketSockets = true
	if _, err := without.Enroll(t.Context(), Target{NetnsPath: a.path, Settings: s}); !errors.Is(err, ErrNoPacketHook) {
		t.Fatalf("enroll with DenyPacketSockets on a data path without the hook: %v, want %v", err, ErrNoPacketHook)
	}
	cfg := Config{PinRoot: filepath.Join(t.TempDir(), "bpf"), Logger: zaptest.NewLogger(t), PacketSockets: true}
	d, err := Open(t.Context(), cfg)
	fixtures.RequireFeature(t, bpfLSMFeature(), err)
	t.Cleanup(func() {
		d.Close()
		if err := Uninstall(context.Background(), cfg); err != nil {
			t.Errorf("uninstall: %v", err)
		}
	})
	enroll(t, d, a, s)
	packet := func(p *pod) (err error) {
		p.do(t, func() error {
			fd, serr := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_ALL)))
			if serr == nil {
				unix.Close(fd)
			}
			err = serr
			return nil
		})
		return err
	}
	if err := packet(a); !errors.Is(err, unix.EPERM) {
		t.Errorf("packet socket in the enrolled pod: %v, want EPERM", err)
	}
	if err := packet(b); err != nil {
		t.Errorf("packet socket in a pod not enrolled: %v", err)
	}
	var tcpErr error
	a.do(t, func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err == nil {
			unix.Close(fd)
		}
		tcpErr = err
		return nil
	})
	if tcpErr != nil {
		t.Errorf("TCP socket in the enrolled pod: %v", tcpErr)
	}
	if c, err := d.Counters(); err != nil || c.PacketSocketsRefused == 0 {
		t.Errorf("counters %+v (%v): the refusal is not counted", c, err)
	}
	if err := d.Release(t.Context(), a.cookie); err != nil {
		t.Fatal(err)
	}
	if err := packet(a); err != nil {
		t.Errorf("packet socket after the release: %v", err)
	}
}
