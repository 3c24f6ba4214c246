package agent

import (
	"context"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/internal/podstore"
)

// Datapath is the seam between the gate and whatever puts redirection in place.
// internal/redirect's eBPF data path implements it; RecordOnly stands in where a node
// runs the gate without redirection.
type Datapath interface {
	// Enroll puts redirection in place for the pod whose network namespace is at
	// netnsPath (every interface inside it), with the pod's own deviations from
	// the node's settings, and returns the namespace's cookie. It returns only
	// once redirection is active. Idempotent.
	Enroll(ctx context.Context, ns *netns.Handle, capture podstore.Capture) (uint64, error)
	// Release removes redirection for the namespace with this cookie. Idempotent,
	// and it works after the namespace is gone. netnsPath, when not empty, is
	// where the namespace was enrolled from: while it still names that
	// namespace, what enrollment put inside it is taken out too.
	Release(ctx context.Context, cookie uint64, netnsPath string) error
	// Check returns an error describing what is missing when the namespace's
	// redirection is not intact.
	Check(ctx context.Context, cookie uint64) error
	// Enrolled lists the cookies of every namespace with redirection in place,
	// including those enrolled by an earlier agent.
	Enrolled(ctx context.Context) ([]uint64, error)
}

// RecordOnly is a Datapath that redirects nothing: it only resolves the netns
// cookie, so the agent records pods. It is for nodes and tests that exercise the
// gate alone (mesh-agent --datapath=none).
type RecordOnly struct{}

// Enroll implements Datapath.
func (RecordOnly) Enroll(_ context.Context, ns *netns.Handle, _ podstore.Capture) (uint64, error) {
	return ns.Cookie, nil
}

// Release implements Datapath.
func (RecordOnly) Release(context.Context, uint64, string) error { return nil }

// Check implements Datapath.
func (RecordOnly) Check(context.Context, uint64) error { return nil }

// Enrolled implements Datapath: a record-only data path holds nothing.
func (RecordOnly) Enrolled(context.Context) ([]uint64, error) { return nil, nil }
