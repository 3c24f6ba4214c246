package agent

import (
	"context"
	"sort"
	"strings"
	"sync"
)

// Readiness conditions. Each must hold before the gate admits a pod.
const (
	CondDatapath  = "datapath"
	CondReconcile = "reconcile"
	CondCNIConfig = "cni-config"
	// CondEnrollmentSource: the enrollment policy can answer (caches synced).
	CondEnrollmentSource = "enrollment-source"
)

// Readiness is the agent's explicit readiness: a set of named conditions that must
// all hold before a pod is admitted. A condition can be lost again at run time
// (the chain entry removed, say), and waiting callers then wait again.
type Readiness struct {
	mu       sync.Mutex
	names    []string          // every condition, in declaration order
	notReady map[string]string // condition -> why it does not hold
	changed  chan struct{}     // closed and replaced on every change
	onChange []func(ready bool)
}

// Condition is one readiness condition's state.
type Condition struct {
	Name   string `json:"name"`
	OK     bool   `json:"ok"`
	Reason string `json:"reason,omitempty"`
}

// NewReadiness starts with every named condition unmet.
func NewReadiness(conditions ...string) *Readiness {
	r := &Readiness{names: conditions, notReady: make(map[string]string), changed: make(chan struct{})}
	for _, c := range conditions {
		r.notReady[c] = "not yet checked"
	}
	return r
}

// OnChange registers fn to be called (with no lock held) with the new overall
// state whenever it flips.
func (r *Readiness) OnChange(fn func(ready bool)) {
	r.mu.Lock()
	r.onChange = append(r.onChange, fn)
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
	if wasUnmet == ok || prevReason != reason {
		close(r.changed)
		r.changed = make(chan struct{})
	}
	fns := r.onChange
	r.mu.Unlock()
	if wasReady != isReady {
		for _, fn := range fns {
			fn(isReady)
		}
	}
}

// Ready reports the overall state and, when not ready, the unmet conditions.
func (r *Readiness) Ready() (bool, string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.notReady) == 0, r.describeLocked()
}

// Conditions lists every condition and its state.
func (r *Readiness) Conditions() []Condition {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]Condition, 0, len(r.names))
	for _, n := range r.names {
		why, unmet := r.notReady[n]
		out = append(out, Condition{Name: n, OK: !unmet, Reason: why})
	}
	return out
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
