package agent

import (
	"context"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/mesh-cni/mesh-cni/internal/gaterpc"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

// GateServer serves the gate API and grpc.health.v1 on the gate socket.
type GateServer struct {
	*gaterpc.Server
	health *health.Server
}

// NewGateServer listens on socketPath and registers svc. The health service's
// overall status ("" and the gate service's name) follows readiness.
func NewGateServer(ctx context.Context, log *zap.Logger, socketPath string, allowedUIDs []int, svc *Service, readiness *Readiness, metrics *Metrics) (*GateServer, error) {
	l, err := gaterpc.Listen(ctx, socketPath)
	if err != nil {
		return nil, err
	}
	srv := gaterpc.NewServer(allowedUIDs, grpc.ChainUnaryInterceptor(metrics.UnaryInterceptor))
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
	return &GateServer{Server: gaterpc.NewUnixServer("gate", log, l, srv), health: hs}, nil
}

// Stop lets in-flight calls finish for up to grace, then cuts the rest. Callers
// cut off mid-Add retry against the next agent: their pods were not admitted.
func (g *GateServer) Stop(grace time.Duration) {
	g.health.Shutdown()
	g.Server.Stop(grace)
}
