package harness_test

import (
	"context"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

func serveGRPC(t *testing.T, socket string, register func(*grpc.Server)) {
	t.Helper()
	ln, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	register(srv)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(ln)
	}()
	t.Cleanup(func() {
		srv.Stop()
		<-done
	})
}

func TestWaitForHealthy(t *testing.T) {
	t.Parallel()
	ctx := fixtures.Context(t, 2*time.Minute)
	socket := filepath.Join(t.TempDir(), "gate.sock")

	// Start waiting before the socket exists, as a test does right after starting
	// the agent.
	result := make(chan error, 1)
	waitCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() { result <- harness.WaitForHealthy(waitCtx, socket) }()

	hs := health.NewServer()
	hs.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)
	serveGRPC(t, socket, func(s *grpc.Server) { healthpb.RegisterHealthServer(s, hs) })

	// While NOT_SERVING, a bounded wait ends with the status in its error. The
	// bound leaves room for the client's first connection on a loaded machine:
	// with less, a run under make test's load ended before the first answer
	// and saw only the deadline.
	short, cancelShort := context.WithTimeout(ctx, 3*time.Second)
	err := harness.WaitForHealthy(short, socket)
	cancelShort()
	if err == nil || !strings.Contains(err.Error(), "NOT_SERVING") {
		t.Fatalf("WaitForHealthy while NOT_SERVING = %v, want an error naming the status", err)
	}

	hs.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	if err := <-result; err != nil {
		t.Fatalf("WaitForHealthy: %v", err)
	}
	if err := harness.WaitForHealthy(ctx, socket); err != nil {
		t.Fatalf("WaitForHealthy on a serving server: %v", err)
	}
}

func TestWaitForHealthyNoHealthService(t *testing.T) {
	t.Parallel()
	ctx := fixtures.Context(t, 2*time.Minute)
	socket := filepath.Join(t.TempDir(), "bare.sock")
	serveGRPC(t, socket, func(*grpc.Server) {})
	err := harness.WaitForHealthy(ctx, socket)
	if err == nil || !strings.Contains(err.Error(), "no health service") {
		t.Fatalf("WaitForHealthy = %v, want a no-health-service error", err)
	}
}
