package nethook_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mesh-cni/mesh-cni/internal/agent"
	"github.com/mesh-cni/mesh-cni/internal/agent/agenttest"
	"github.com/mesh-cni/mesh-cni/internal/gaterpc"
	"github.com/mesh-cni/mesh-cni/internal/nethook"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

// TestGateOverSocket: the hook's gate over the socket says the agent did not
// answer only when nothing answers; an Add that times out at a starting agent
// says what the agent waits for, and so does Ready.
func TestGateOverSocket(t *testing.T) {
	t.Parallel()
	dir, err := os.MkdirTemp("", "nethook-remote-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	socket := filepath.Join(dir, "run", "gate.sock")
	conn, err := gaterpc.Dial(socket)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	g := nethook.NewGate(socket, conn)
	add := &gatepb.AddRequest{
		Pod:        &gatepb.PodIdentity{Namespace: "shop", Name: "web", Uid: "u1"},
		Attachment: &gatepb.Attachment{ContainerId: "c1", Ifname: "eth0", Network: nethook.DefaultNetwork},
		NetnsPath:  "/proc/self/ns/net",
		Source:     gatepb.Source_SOURCE_HOOK,
	}
	call := func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, err := g.Add(ctx, add)
		return err
	}

	// Nobody on the socket.
	err = call()
	if st := status.Convert(err); st.Code() != codes.Unavailable || !strings.Contains(st.Message(), "did not answer on "+socket) {
		t.Fatalf("Add with no agent = %v, want Unavailable naming the socket", err)
	}
	if ready, why := g.Ready(); ready || !strings.Contains(why, "does not answer") {
		t.Fatalf("Ready with no agent = %v %q", ready, why)
	}

	// An agent that serves but is not ready.
	log := zaptest.NewLogger(t)
	ag := agenttest.NewGate(t, log, true)
	metrics := agent.NewMetrics(func() int { return 0 }, func() bool { r, _ := ag.Readiness.Ready(); return r }, nil)
	srv, err := agent.NewGateServer(context.Background(), log, socket, nil, ag.Service, ag.Readiness, metrics)
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve() }()
	t.Cleanup(func() {
		srv.Stop(time.Second)
		<-served
	})
	if ready, why := g.Ready(); ready || !strings.Contains(why, agenttest.CondTest) {
		t.Fatalf("Ready of a starting agent = %v %q, want its unmet condition", ready, why)
	}
	err = call()
	if err == nil || strings.Contains(err.Error(), "did not answer") || !strings.Contains(err.Error(), agenttest.CondTest) {
		t.Fatalf("Add to a starting agent = %v, want its answer naming what it waits for", err)
	}
}
