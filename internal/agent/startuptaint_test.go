package agent

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// fakeTaint is a node's startup taint; it records whether the agent was ready
// at each removal.
type fakeTaint struct {
	mu        sync.Mutex
	readiness *Readiness
	present   int
	reads     int
	failNext  int // removals that fail after the read
	removes   int
	fresh     int // removals asking past the cache
	unready   int // removals made while the agent was not ready
}

func (f *fakeTaint) Present(context.Context) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.reads++
	return f.present, nil
}

func (f *fakeTaint) Remove(_ context.Context, fresh bool) (int, error) {
	ready, _ := f.readiness.Ready()
	f.mu.Lock()
	defer f.mu.Unlock()
	f.removes++
	if fresh {
		f.fresh++
	}
	if !ready {
		f.unready++
	}
	found := f.present
	if f.failNext > 0 && found > 0 {
		f.failNext--
		return found, errors.New("the taints changed since they were read")
	}
	f.present = 0
	return found, nil
}

func (f *fakeTaint) state() (present, removes, fresh, unready int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.present, f.removes, f.fresh, f.unready
}

func (f *fakeTaint) set(present, failNext int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.present, f.failNext = present, failNext
}

// The startup taint is removed only while the agent is ready: never before,
// at once when it becomes ready, again when a check finds it re-added, after
// a few failed attempts (each past the cache), and not while the agent is
// not ready again.
func TestStartupTaintRemovedOnlyWhenReady(t *testing.T) {
	readiness := NewReadiness(CondDatapath, CondCNIConfig)
	taint := &fakeTaint{readiness: readiness, present: 1}
	m := NewMetrics(func() int { return 0 }, func() bool { return false }, func() CounterReader { return nil })
	m.trackStartupTaint()
	r := newStartupTaintRemover(zaptest.NewLogger(t), StartupTaintConfig{Key: "k", Node: "n", Taint: taint}, readiness, m, 20*time.Millisecond)
	r.retry = wait.Backoff{Duration: time.Millisecond, Factor: 2, Jitter: 0.5, Steps: 3}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		r.run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})

	// Not ready: the data path is in place, the chain entry is not.
	readiness.Set(CondDatapath, true, "")
	// The remover has read the node, and waits for readiness. (A removal
	// made while not ready, now or later, is counted in unready.)
	fixtures.WaitFor(t, 10*time.Second, "the remover's first read of the node", func() bool {
		taint.mu.Lock()
		defer taint.mu.Unlock()
		return taint.reads > 0
	})
	if present, removes, _, _ := taint.state(); present != 1 || removes != 0 {
		t.Fatalf("not ready: taint present %d after %d removals, want it kept and none tried", present, removes)
	}
	if g := gaugeValue(t, m.startupTaint); g != 1 {
		t.Errorf("meshcni_startup_taint %v while the taint is on the node, want 1", g)
	}

	readiness.Set(CondCNIConfig, true, "")
	fixtures.WaitFor(t, 10*time.Second, "the taint removed once ready", func() bool { p, _, _, _ := taint.state(); return p == 0 })
	fixtures.WaitFor(t, 10*time.Second, "the gauge at 0", func() bool { return gaugeValue(t, m.startupTaint) == 0 })

	// Re-added while ready, and the first two attempts fail.
	taint.set(1, 2)
	_, before, freshBefore, _ := taint.state()
	fixtures.WaitFor(t, 10*time.Second, "the re-added taint removed", func() bool { p, _, _, _ := taint.state(); return p == 0 })
	if _, removes, fresh, _ := taint.state(); removes-before < 3 || fresh-freshBefore < 2 {
		t.Errorf("%d attempts (%d past the cache) for a removal that failed twice, want 3 (the retries past the cache)", removes-before, fresh-freshBefore)
	}

	// Failing every time: each round gives up after its bounded attempts, and
	// the gauge says the taint is there.
	taint.set(1, 1000)
	fixtures.WaitFor(t, 10*time.Second, "the gauge at 1 while removal fails", func() bool { return gaugeValue(t, m.startupTaint) == 1 })
	taint.set(0, 0)

	// Not ready again: a re-added taint stays.
	readiness.Set(CondCNIConfig, false, "the chain entry was removed")
	// Not a wait for a state: a removal already past its readiness check
	// when the agent became not ready still lands (one call, which does not
	// fail here), and is not what this part checks. Nothing shows it is over
	// but time; 50 ms is far more than one call takes.
	time.Sleep(50 * time.Millisecond)
	taint.set(1, 0)
	_, before, _, _ = taint.state()
	// A bounded look for what must not happen: nothing shows the remover
	// has come round but time, so ten of its 20 ms intervals; a removal
	// made while not ready, now or later, is also counted in unready.
	time.Sleep(200 * time.Millisecond)
	if present, removes, _, unready := taint.state(); present != 1 || removes != before || unready != 0 {
		t.Errorf("not ready again: taint present %d, %d removals since, %d removals ever made while not ready; want it kept", present, removes-before, unready)
	}
	readiness.Set(CondCNIConfig, true, "")
	fixtures.WaitFor(t, 10*time.Second, "the taint removed once ready again", func() bool { p, _, _, _ := taint.state(); return p == 0 })
	if _, _, _, unready := taint.state(); unready != 0 {
		t.Errorf("%d removals were made while the agent was not ready", unready)
	}
}

// A node without the taint at start reads 0, and nothing is written.
func TestStartupTaintAbsent(t *testing.T) {
	readiness := NewReadiness(CondDatapath)
	taint := &fakeTaint{readiness: readiness}
	m := NewMetrics(func() int { return 0 }, func() bool { return false }, func() CounterReader { return nil })
	m.trackStartupTaint()
	r := newStartupTaintRemover(zaptest.NewLogger(t), StartupTaintConfig{Key: "k", Node: "n", Taint: taint}, readiness, m, time.Hour)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		r.run(ctx)
	}()
	fixtures.WaitFor(t, 10*time.Second, "the gauge at 0", func() bool { return gaugeValue(t, m.startupTaint) == 0 })
	cancel()
	<-done
	if _, removes, _, _ := taint.state(); removes != 0 {
		t.Errorf("%d removals while never ready", removes)
	}
}
