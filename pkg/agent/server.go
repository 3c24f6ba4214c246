package agent

import (
	"context"
	"fmt"
	"net"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/mesh-cni/mesh-cni/pkg/gate"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

// GateServer serves the gate API and grpc.health.v1 on the gate socket.
type GateServer struct {
	log      *zap.Logger
	grpc     *grpc.Server
	health   *health.Server
	listener net.Listener
}

// NewGateServer listens on socketPath and registers svc. The health service's
// overall status ("" and the gate service's name) follows readiness.
func NewGateServer(ctx context.Context, log *zap.Logger, socketPath string, allowedUIDs []int, svc *Service, readiness *Readiness, metrics *Metrics) (*GateServer, error) {
	l, err := gate.Listen(ctx, socketPath)
	if err != nil {
		return nil, err
	}
	srv := gate.NewServer(allowedUIDs, grpc.ChainUnaryInterceptor(metrics.UnaryInterceptor))
	gatepb.RegisterGateServer(srv, svc)
	hs := health.NewServer()
	healthpb.RegisterHealthServer(srv, hs)
	setHealth := func(ready bool) {
		st := healthpb.HealthCheckResponse_NOT_SERVING
		if ready {
			st = healthpb.HealthCheckResponse_SERVING
		}
		hs.SetServingStatus("", st)
		hs.SetServingStatus(gatepb.Gate_ServiceDesc.ServiceName, st)
	}
	readiness.OnChange(setHealth)
	ready, _ := readiness.Ready()
	setHealth(ready)
	return &GateServer{log: log, grpc: srv, health: hs, listener: l}, nil
}

// Serve serves until Stop; it returns nil after a stop.
func (g *GateServer) Serve() error {
	g.log.Info("gate serving", zap.String("socket", g.listener.Addr().String()))
	if err := g.grpc.Serve(g.listener); err != nil && err != grpc.ErrServerStopped {
		return fmt.Errorf("serve gate: %w", err)
	}
	return nil
}

// Stop lets in-flight calls finish for up to grace, then cuts the rest. Callers
// cut off mid-Add retry against the next agent: their pods were not admitted.
func (g *GateServer) Stop(grace time.Duration) {
	g.health.Shutdown()
	gate.Stop(g.grpc, grace)
}
