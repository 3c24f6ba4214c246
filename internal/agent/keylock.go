package agent

import "sync"

// keyLock serialises work per key (one pod attachment) while letting different
// keys proceed in parallel, so an ADD, DEL and GC for the same pod never interleave.
type keyLock struct {
	mu    sync.Mutex
	locks map[string]*keyLockEntry
}

type keyLockEntry struct {
	mu   sync.Mutex
	refs int
}

func newKeyLock() *keyLock { return &keyLock{locks: make(map[string]*keyLockEntry)} }

// Lock locks key and returns the function that unlocks it.
func (k *keyLock) Lock(key string) func() {
	k.mu.Lock()
	e, ok := k.locks[key]
	if !ok {
		e = &keyLockEntry{}
		k.locks[key] = e
	}
	e.refs++
	k.mu.Unlock()

	e.mu.Lock()
	return func() {
		e.mu.Unlock()
		k.mu.Lock()
		e.refs--
		if e.refs == 0 {
			delete(k.locks, key)
		}
		k.mu.Unlock()
	}
}
