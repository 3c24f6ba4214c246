// Package keylock is a mutex per key, made when first locked and dropped when
// no one holds or waits for it: work on one pod (an attachment, a network
// namespace) is serialized while different pods proceed in parallel.
//
// k8s.io/utils/keymutex hashes keys onto a fixed set of mutexes, so two pods
// sharing one would queue behind each other: an ADD that waits seconds for
// the API server or the node proxy would hold up an unrelated pod's. Here two
// keys never share a mutex.
package keylock

import "sync"

// Map is the set of per-key mutexes. The zero value is ready to use.
type Map[K comparable] struct {
	mu    sync.Mutex
	locks map[K]*entry
}

type entry struct {
	mu   sync.Mutex
	refs int
}

// Lock locks key and returns the function that unlocks it.
func (m *Map[K]) Lock(key K) (unlock func()) {
	m.mu.Lock()
	if m.locks == nil {
		m.locks = map[K]*entry{}
	}
	e := m.locks[key]
	if e == nil {
		e = &entry{}
		m.locks[key] = e
	}
	e.refs++
	m.mu.Unlock()
	e.mu.Lock()
	return func() {
		e.mu.Unlock()
		m.mu.Lock()
		if e.refs--; e.refs == 0 {
			delete(m.locks, key)
		}
		m.mu.Unlock()
	}
}

// refs is how many callers hold key or wait for it, for tests.
func (m *Map[K]) refs(key K) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	if e := m.locks[key]; e != nil {
		return e.refs
	}
	return 0
}

// held is how many keys are locked or waited for, for tests.
func (m *Map[K]) held() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.locks)
}
