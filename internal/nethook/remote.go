package nethook

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mesh-cni/mesh-cni/internal/gaterpc"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

// readyTimeout bounds the agent's status call behind a CheckHealth: the
// runtime calls CheckHealth for its own status, which must not hang on a
// stopped agent. The call waits for a connection that long (a fail-fast call
// would fail on the last failed connection attempt even once the agent is
// back), well above the connection's reconnect back-off (gaterpc.Dial: 50 ms).
const readyTimeout = 500 * time.Millisecond

// Gate is the agent's gate reached over its Unix socket, the way the CNI
// plugin reaches it, so the hook keeps serving while the agent is down,
// restarts or upgrades. Add waits for the agent (grpc WaitForReady) until its
// deadline; every other call fails fast.
type Gate struct {
	gatepb.UnimplementedGateServer
	socket string
	client gatepb.GateClient
}

// NewGate returns the gate at socket over conn (from gaterpc.Dial(socket)).
func NewGate(socket string, conn grpc.ClientConnInterface) *Gate {
	return &Gate{socket: socket, client: gatepb.NewGateClient(conn)}
}

// Add implements gatepb.GateServer: it waits for the agent to answer. A
// deadline that ran out before the agent answered becomes Unavailable naming
// the socket, which is what the runtime's caller needs to read.
func (g *Gate) Add(ctx context.Context, req *gatepb.AddRequest) (*gatepb.AddResponse, error) {
	resp, err := g.client.Add(ctx, req, grpc.WaitForReady(true))
	return resp, g.explain(err)
}

// Del implements gatepb.GateServer.
func (g *Gate) Del(ctx context.Context, req *gatepb.DelRequest) (*gatepb.DelResponse, error) {
	resp, err := g.client.Del(ctx, req)
	return resp, g.explain(err)
}

// List implements gatepb.GateServer (the teardown's ReleaseSandbox lists).
func (g *Gate) List(ctx context.Context, req *gatepb.ListRequest) (*gatepb.ListResponse, error) {
	resp, err := g.client.List(ctx, req)
	return resp, g.explain(err)
}

// Status implements gatepb.GateServer.
func (g *Gate) Status(ctx context.Context, req *gatepb.StatusRequest) (*gatepb.StatusResponse, error) {
	resp, err := g.client.Status(ctx, req)
	return resp, g.explain(err)
}

// explain keeps the agent's own status, and says why a call that timed out
// or never reached the agent failed (nil stays nil: the call succeeded, and
// the forwarding methods return its answer as is). The codes alone cannot tell the cases
// apart (a starting agent answers Unavailable itself, and a deadline that runs
// out while it starts is the caller's own), so a failed call asks the agent
// for its readiness once: no answer names the socket, not ready names what
// the agent waits for.
func (g *Gate) explain(err error) error {
	st := status.Convert(err)
	switch st.Code() {
	case codes.DeadlineExceeded, codes.Canceled, codes.Unavailable:
	default:
		return err
	}
	ready, why, answered := g.readiness()
	switch {
	case !answered:
		return status.Errorf(codes.Unavailable, "mesh-agent did not answer on %s (stopped or restarting?): %s", g.socket, st.Message())
	case !ready && !strings.Contains(st.Message(), why):
		return status.Errorf(st.Code(), "%s: mesh-agent is not ready (%s)", st.Message(), why)
	}
	return err
}

// Ready asks the agent for its readiness, within readyTimeout. Not ready
// names the unmet conditions, or says that the agent does not answer.
func (g *Gate) Ready() (bool, string) {
	ready, why, _ := g.readiness()
	return ready, why
}

func (g *Gate) readiness() (ready bool, why string, answered bool) {
	ctx, cancel := context.WithTimeout(context.Background(), readyTimeout)
	defer cancel()
	st, err := g.client.Status(ctx, &gatepb.StatusRequest{}, grpc.WaitForReady(true))
	if err != nil {
		return false, fmt.Sprintf("mesh-agent does not answer on %s: %s", g.socket, status.Convert(err).Message()), false
	}
	if st.GetReady() {
		return true, "", true
	}
	var unmet []string
	for _, c := range st.GetConditions() {
		if !c.GetOk() {
			unmet = append(unmet, c.GetName()+": "+c.GetReason())
		}
	}
	sort.Strings(unmet)
	return false, strings.Join(unmet, "; "), true
}

var _ gatepb.GateServer = (*Gate)(nil)

// remoteEntry is cfg's gate configuration over the gate socket.
func remoteEntry(cfg gaterpc.EntryConfig, g *Gate) gaterpc.EntryConfig {
	cfg.Gate, cfg.Ready = g, g.Ready
	return cfg
}
