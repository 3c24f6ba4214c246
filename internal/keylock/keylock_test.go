package keylock

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// A key held does not hold up another: key b is locked and unlocked while
// key a is held.
func TestKeysIndependent(t *testing.T) {
	var m Map[string]
	unlockA := m.Lock("a")
	defer unlockA()
	gotB := make(chan struct{})
	go func() {
		m.Lock("b")()
		close(gotB)
	}()
	select {
	case <-gotB:
	case <-time.After(10 * time.Second):
		t.Fatal("locking key b waited for key a")
	}
}

// One key is held by one caller at a time, while each key's callers run
// alongside the other keys'; nothing is left once every lock is released.
// Every holder counts itself in its key's counter on entry and stays until
// every other caller of its key waits for the key (has called Lock), so a
// lock that let a second caller in would have it counted while the first
// is still there.
func TestOneHolderPerKey(t *testing.T) {
	const keys, callers = 4, 8
	var (
		m      Map[int]
		inside [keys]atomic.Int32 // callers holding the key now
		done   [keys]atomic.Int32 // callers finished with the key
		wg     sync.WaitGroup
	)
	for k := range keys {
		for range callers {
			wg.Go(func() {
				defer m.Lock(k)()
				defer done[k].Add(1)
				if n := inside[k].Add(1); n != 1 {
					t.Errorf("%d callers hold key %d at once", n, k)
				}
				defer inside[k].Add(-1)
				// The callers still to come are waiting for the key once
				// they and this one are all it counts.
				if !fixtures.Eventually(context.Background(), 10*time.Second, time.Millisecond, func() bool {
					return m.refs(k) == callers-int(done[k].Load()) || inside[k].Load() != 1
				}) {
					t.Errorf("key %d: %d callers hold or wait for it, want the %d not done", k, m.refs(k), callers-int(done[k].Load()))
				}
				if n := inside[k].Load(); n != 1 {
					t.Errorf("%d callers hold key %d at once", n, k)
				}
			})
		}
	}
	wg.Wait()
	if n := m.held(); n != 0 {
		t.Errorf("%d keys left after every unlock", n)
	}
}
