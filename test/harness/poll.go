package harness

import (
	"context"
	"fmt"
	"time"
)

// probeTimeout bounds one call of a PollUntil probe.
const probeTimeout = 5 * time.Second

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
