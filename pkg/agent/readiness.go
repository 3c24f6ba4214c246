package agent

import (
	"context"
	"sort"
	"strings"
	"sync"
)

// Readiness is the agent's explicit readiness: a set of named conditions that must
// all hold before a pod is admitted. A condition can be lost again at run time
// (the chain entry removed, say), and waiting callers then wait again.
type Readiness struct {
	mu       sync.Mutex
	notReady map[string]string // condition -> why it does not hold
	changed  chan struct{}     // closed and replaced on every change
	onChange func(ready bool)
}

// NewReadiness starts with every named condition unmet.
func NewReadiness(conditions ...string) *Readiness {
	r := &Readiness{notReady: make(map[string]string), changed: make(chan struct{})}
	for _, c := range conditions {
		r.notReady[c] = "not yet checked"
	}
	return r
}

// OnChange registers fn to be called (under no lock of the caller's) with the new
// overall state whenever it flips. Register before the first Set.
func (r *Readiness) OnChange(fn func(ready bool)) {
	r.mu.Lock()
	r.onChange = fn
	r.mu.Unlock()
}

// Set records whether a condition holds; reason says why not.
func (r *Readiness) Set(condition string, ok bool, reason string) {
	r.mu.Lock()
	wasReady := len(r.notReady) == 0
	prevReason, wasUnmet := r.notReady[condition]
	if ok {
		delete(r.notReady, condition)
	} else {
		r.notReady[condition] = reason
	}
	isReady := len(r.notReady) == 0
	changed := wasUnmet == ok || prevReason != reason
	if changed {
		close(r.changed)
		r.changed = make(chan struct{})
	}
	fn := r.onChange
	r.mu.Unlock()
	if fn != nil && wasReady != isReady {
		fn(isReady)
	}
}

// Ready reports the overall state and, when not ready, the unmet conditions.
func (r *Readiness) Ready() (bool, string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.notReady) == 0, r.describeLocked()
}

func (r *Readiness) describeLocked() string {
	parts := make([]string, 0, len(r.notReady))
	for c, why := range r.notReady {
		parts = append(parts, c+": "+why)
	}
	sort.Strings(parts)
	return strings.Join(parts, "; ")
}

// Wait blocks until the agent is ready or ctx ends; the error then names the
// unmet conditions.
func (r *Readiness) Wait(ctx context.Context) error {
	for {
		r.mu.Lock()
		if len(r.notReady) == 0 {
			r.mu.Unlock()
			return nil
		}
		changed, why := r.changed, r.describeLocked()
		r.mu.Unlock()
		select {
		case <-changed:
		case <-ctx.Done():
			return &NotReadyError{Conditions: why, Cause: ctx.Err()}
		}
	}
}

// NotReadyError says the agent did not become ready in time.
type NotReadyError struct {
	Conditions string
	Cause      error
}

func (e *NotReadyError) Error() string {
	return "mesh-agent is not ready (" + e.Conditions + "): " + e.Cause.Error()
}

func (e *NotReadyError) Unwrap() error { return e.Cause }
