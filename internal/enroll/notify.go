package enroll

import "sync"

// notifier hands out a channel that is closed, and replaced by a fresh one, on
// every notify: a waiter that takes the channel, re-reads the state and waits on
// the channel it took never misses a change, and changes that arrive while it is
// busy collapse into one wake-up.
type notifier struct {
	mu sync.Mutex
	ch chan struct{}
}

func newNotifier() *notifier { return &notifier{ch: make(chan struct{})} }

// wait returns the channel the next notify closes.
func (n *notifier) wait() <-chan struct{} {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.ch
}

func (n *notifier) notify() {
	n.mu.Lock()
	defer n.mu.Unlock()
	close(n.ch)
	n.ch = make(chan struct{})
}
