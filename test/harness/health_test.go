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

	// While NOT_SERVING, a wait that ends names the status in its error. It is
	// cut once its server has been asked twice, so the client has had an
	// answer, however slow the machine (a timed bound ended before the first
	// answer under load): a server of its own counts its checks alone.
	counted := &countingHealth{Server: health.NewServer(), checks: make(chan struct{}, 16)}
	counted.SetServingStatus("", healthpb.HealthCheckResponse_NOT_SERVING)
	notServing := filepath.Join(t.TempDir(), "not-serving.sock")
	serveGRPC(t, notServing, func(s *grpc.Server) { healthpb.RegisterHealthServer(s, counted) })
	short, cancelShort := context.WithCancel(ctx)
	go func() {
		defer cancelShort()
		for range 2 {
			select {
			case <-counted.checks:
			case <-short.Done():
				return
			}
		}
	}()
	err := harness.WaitForHealthy(short, notServing)
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

// countingHealth is a health server that signals each check it answers.
type countingHealth struct {
	*health.Server
	checks chan struct{}
}

func (h *countingHealth) Check(ctx context.Context, req *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	resp, err := h.Server.Check(ctx, req)
	select {
	case h.checks <- struct{}{}:
	default:
	}
	return resp, err
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
