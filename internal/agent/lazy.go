package agent

import (
	"context"
	"errors"
	"sync/atomic"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/internal/podstore"
	"github.com/mesh-cni/mesh-cni/internal/redirect"
)

// lazyDatapath lets the gate start serving before the data path is loaded. Until
// then readiness is false, so Add never reaches it; Del and GC of pods recorded
// by an earlier agent do, and get a retryable error.
type lazyDatapath struct {
	dp atomic.Pointer[Datapath]
}

var errDatapathLoading = errors.New("data path is still loading")

func (l *lazyDatapath) set(dp Datapath) { l.dp.Store(&dp) }

func (l *lazyDatapath) get() (Datapath, error) {
	p := l.dp.Load()
	if p == nil {
		return nil, errDatapathLoading
	}
	return *p, nil
}

func (l *lazyDatapath) Enroll(ctx context.Context, ns *netns.Handle, capture podstore.Capture) (uint64, error) {
	dp, err := l.get()
	if err != nil {
		return 0, err
	}
	return dp.Enroll(ctx, ns, capture)
}

func (l *lazyDatapath) Release(ctx context.Context, cookie uint64, netnsPath string) error {
	dp, err := l.get()
	if err != nil {
		return err
	}
	return dp.Release(ctx, cookie, netnsPath)
}

func (l *lazyDatapath) Check(ctx context.Context, cookie uint64) error {
	dp, err := l.get()
	if err != nil {
		return err
	}
	return dp.Check(ctx, cookie)
}

func (l *lazyDatapath) Enrolled(ctx context.Context) ([]uint64, error) {
	dp, err := l.get()
	if err != nil {
		return nil, err
	}
	return dp.Enrolled(ctx)
}

// Refusals implements RefusalReader when the loaded data path does.
func (l *lazyDatapath) Refusals() ([]redirect.Refusal, error) {
	dp, err := l.get()
	if err != nil {
		return nil, err
	}
	if r, ok := dp.(RefusalReader); ok {
		return r.Refusals()
	}
	return nil, nil
}

// Recollect implements ListenerRecollector when the loaded data path does.
func (l *lazyDatapath) Recollect(ctx context.Context, netnsPath string) error {
	dp, err := l.get()
	if err != nil {
		return err
	}
	if r, ok := dp.(ListenerRecollector); ok {
		return r.Recollect(ctx, netnsPath)
	}
	return nil
}
