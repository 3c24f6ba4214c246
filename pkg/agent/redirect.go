package agent

import (
	"context"
	"fmt"

	"github.com/mesh-cni/mesh-cni/pkg/redirect"
)

// RedirectDatapath adapts the eBPF data path to the gate, applying the node's
// redirection settings to every pod it enrolls.
type RedirectDatapath struct {
	DP       *redirect.Datapath
	Settings redirect.Settings
}

// Enroll implements Datapath.
func (r RedirectDatapath) Enroll(ctx context.Context, netnsPath string, _ []string) (uint64, error) {
	e, err := r.DP.Enroll(ctx, redirect.Target{NetnsPath: netnsPath, Settings: r.Settings})
	if err != nil {
		return 0, err
	}
	return e.Cookie, nil
}

// Release implements Datapath.
func (r RedirectDatapath) Release(ctx context.Context, cookie uint64) error {
	return r.DP.Release(ctx, cookie)
}

// Check implements Datapath.
func (r RedirectDatapath) Check(ctx context.Context, cookie uint64, interfaces []string) error {
	return r.DP.Check(ctx, cookie, interfaces)
}

// Enrolled implements Datapath.
func (r RedirectDatapath) Enrolled(ctx context.Context) ([]uint64, error) {
	es, err := r.DP.List(ctx)
	if err != nil {
		return nil, fmt.Errorf("list data path enrollments: %w", err)
	}
	out := make([]uint64, len(es))
	for i, e := range es {
		out[i] = e.Cookie
	}
	return out, nil
}

// Counters implements CounterReader.
func (r RedirectDatapath) Counters() (redirect.Counters, error) { return r.DP.Counters() }

// Refusals implements RefusalReader.
func (r RedirectDatapath) Refusals() ([]redirect.Refusal, error) { return r.DP.Refusals() }
