package keylock

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// One key is held by one caller at a time; another key is not held up by it;
// nothing is left once every lock is released.
func TestMap(t *testing.T) {
	var m Map[string]
	unlockA := m.Lock("a")
	got := make(chan string, 2)
	go func() {
		defer m.Lock("b")()
		got <- "b"
	}()
	if v := <-got; v != "b" {
		t.Fatal(v)
	}
	go func() {
		defer m.Lock("a")()
		got <- "a"
	}()
	select {
	case <-got:
		t.Fatal("a second caller got key a while it was held")
	case <-time.After(50 * time.Millisecond):
	}
	unlockA()
	if v := <-got; v != "a" {
		t.Fatal(v)
	}

	var inside, most atomic.Int32
	var wg sync.WaitGroup
	for range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer m.Lock("c")()
			n := inside.Add(1)
			if n > most.Load() {
				most.Store(n)
			}
			// Hold the key a while, so a second holder, if the lock let
			// one in, would be counted here too.
			time.Sleep(time.Millisecond)
			inside.Add(-1)
		}()
	}
	wg.Wait()
	if most.Load() != 1 {
		t.Errorf("%d callers held key c at once", most.Load())
	}
	if n := m.held(); n != 0 {
		t.Errorf("%d keys left after every unlock", n)
	}
}
