package redirect

import (
	"math/rand/v2"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// floodSYNs is how many SYNs the flooding pod sends at least: more than the
// data path's largest node-wide map holds. floodConnects is how many outbound
// connects it makes at least: more than the node-wide hand-over map
// (orig_dsts) their connections pass through holds, so that entries they left
// behind would fill it. TestSecurityFigures checks both against the maps.
const (
	floodSYNs     = 70000
	floodConnects = 70000
)

// One pod floods: SYNs from a raw socket at its neighbour's proxy (each one a new
// connection the kernel looks a listener up for) and outbound connects as fast as
// it can. Meanwhile another pair of pods keeps connecting through both of its
// proxies: every one of its connections must still get its exact original
// destination. Nothing one pod does fills state another pod's connections need.
func TestFloodDoesNotDisturbOtherPods(t *testing.T) {
	t.Parallel()
	requireRoot(t)
	d, _ := testDatapath(t)
	a, b := newPodPair(t) // the flooding pod and its target
	c, e := newPodPair(t) // the pods that must not notice
	for _, p := range []*pod{a, b, c, e} {
		startOutboundProxy(t, p, 15001)
		startInboundProxy(t, p, 15006)
		enroll(t, d, p, testSettings())
	}

	var (
		stop    atomic.Bool
		wg      sync.WaitGroup
		flooded atomic.Int64
		dialed  atomic.Int64
	)
	wg.Go(func() {
		var raw int
		a.do(t, func() error {
			var err error
			raw, err = unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW)
			return err
		})
		defer unix.Close(raw)
		to := &unix.SockaddrInet4{Addr: b.addr4.As4()}
		for !stop.Load() {
			for range 1000 {
				pkt := plainSYN(a.addr4, b.addr4, uint16(1024+rand.IntN(60000)), uint16(1+rand.IntN(60000)))[0]
				if unix.Sendto(raw, pkt, 0, to) == nil {
					flooded.Add(1)
				}
			}
		}
	})
	for range 4 {
		wg.Go(func() {
			for !stop.Load() {
				dst := netip.AddrFrom4([4]byte{10, 99, byte(rand.IntN(256)), byte(rand.IntN(256))})
				if conn, err := a.dial(hostPort(dst, 80), dialOpts{timeout: time.Second}); err == nil {
					conn.Close()
					dialed.Add(1)
				}
			}
		})
	}

	// Until the flood has created more new connections than the node's shared
	// maps hold, and for a while at least.
	var wrong []string
	minEnd, maxEnd := time.Now().Add(2*time.Second), time.Now().Add(240*time.Second)
	n := 0
	for ; (time.Now().Before(minEnd) || n < 100 || flooded.Load() < floodSYNs || dialed.Load() < floodConnects) && time.Now().Before(maxEnd); n++ {
		dst := e.addr4
		if n%2 == 1 {
			dst = e.addr6
		}
		target := hostPort(dst, uint16(1000+n%5000))
		lines, _, err := c.fetch(target, dialOpts{})
		if err != nil || len(lines) != 2 || lines[0] != "OUT "+target || lines[1] != "IN "+target {
			wrong = append(wrong, target+": "+joinLines(lines))
		}
	}
	stop.Store(true)
	wg.Wait()
	t.Logf("%d SYNs flooded, %d connects, %d connections of the other pods checked", flooded.Load(), dialed.Load(), n)
	if flooded.Load() < floodSYNs {
		t.Errorf("only %d SYNs flooded, fewer than %d", flooded.Load(), floodSYNs)
	}
	if dialed.Load() < floodConnects {
		t.Errorf("only %d connects flooded, fewer than %d", dialed.Load(), floodConnects)
	}
	if len(wrong) > 0 {
		t.Errorf("%d of %d connections of the other pods went wrong during the flood, e.g. %q", len(wrong), n, wrong[0])
	}
}
