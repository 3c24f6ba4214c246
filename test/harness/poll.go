package harness

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"
)

const (
	// probeTimeout bounds one call of a PollUntil probe.
	probeTimeout = 5 * time.Second
	// WaitInterval is how often WaitFor checks its condition: short, since a
	// condition is a cheap look at in-process state.
	WaitInterval = 10 * time.Millisecond
)

// errNotYet is a condition's probe result until the condition holds.
var errNotYet = errors.New("condition does not hold yet")

// Eventually reports whether cond holds within limit, checking it every
// interval; ctx ending first is a no. It is the one deadline poll of the
// tests: wait by a signal where there is one, and by this where there is none.
func Eventually(ctx context.Context, limit, interval time.Duration, cond func() bool) bool {
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	return PollUntil(ctx, nil, interval, func(context.Context) error {
		if cond() {
			return nil
		}
		return errNotYet
	}) == nil
}

// WaitFor fails tb unless cond holds within limit (checked every
// WaitInterval); what names the awaited state in the failure.
func WaitFor(tb testing.TB, limit time.Duration, what string, cond func() bool) {
	tb.Helper()
	if !Eventually(tb.Context(), limit, WaitInterval, cond) {
		tb.Fatalf("timed out after %v waiting for %s", limit, what)
	}
}

// PollUntil calls probe every interval until it returns nil, proc exits (a nil
// proc is never waited on) or ctx ends. Each call gets a context of at most
// five seconds. The error names the last probe's error and ends with the tail
// of proc's output.
func PollUntil(ctx context.Context, proc *Process, interval time.Duration, probe func(context.Context) error) error {
	var done <-chan struct{}
	if proc != nil {
		done = proc.Done()
	}
	var last error
	for {
		pctx, cancel := context.WithTimeout(ctx, probeTimeout)
		last = probe(pctx)
		cancel()
		if last == nil {
			return nil
		}
		select {
		case <-done:
			return fmt.Errorf("%s exited (last probe: %v); output:\n%s", proc.name, last, outputTail(proc, 4000))
		case <-ctx.Done():
			return fmt.Errorf("%w (last probe: %v)%s", ctx.Err(), last, outputNote(proc))
		case <-time.After(interval):
		}
	}
}

func outputNote(proc *Process) string {
	if proc == nil {
		return ""
	}
	return fmt.Sprintf("; output of %s:\n%s", proc.name, outputTail(proc, 4000))
}

func outputTail(proc *Process, n int) string {
	s := proc.Output()
	if len(s) <= n {
		return s
	}
	return "..." + s[len(s)-n:]
}
