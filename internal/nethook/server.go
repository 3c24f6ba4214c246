// Package nethook is mesh-cni's network-plugin hook for containerd: it serves
// the PodNetworkLifecycle service (proto package
// "containerd.services.networking.v1") on its own Unix socket and registers it
// with a JSON file in the runtime's plugin directory, as a non-primary plugin
// that runs after the primary one. It runs as its own process (`mesh-agent
// hook`, Run) and reaches the agent over the gate socket, like the CNI plugin.
//
// Why its own process: containerd's loader (the fork that carries
// PodNetworkLifecycle, core/networking and internal/cri/server/
// grpc_plugin_syncer.go) dials every registered plugin with a blocking dial
// each time it (re)loads its plugin directory, and a single failed dial fails
// the whole load: at containerd's start the chain is then empty, every pod's
// setup fails and NetworkReady is false, the primary's pods included. A hook
// served by the agent dies with it, so a registration left in place while the
// agent is down takes the node's networking down at the next containerd
// restart, and a registration removed with it lets pods start unmeshed. This
// process has no data path, no cgroups and no Kubernetes client, so it
// outlives agent crashes, restarts and upgrades: the loader's dial and
// CheckHealth always succeed, and pod setups wait at the gate for the agent.
//
//   - SetupPodNetwork enrolls the pod through gate Add (which waits until the
//     agent answers and is ready, bounded by the caller's deadline and
//     Config.EnrollTimeout) and answers with an empty SetupPodNetworkResponse,
//     also for an excluded namespace: the mesh adds no interfaces, routes or
//     DNS. The runtime appends each plugin's interfaces and routes to what came
//     before and takes every address as a pod IP, so echoing prev_result
//     would list each pod IP twice. If the pod cannot be enrolled (the agent
//     down past the timeout included) the setup fails with a message saying
//     so, and the runtime tears down the plugins that already ran: fail
//     closed. Excluded namespaces never wait.
//   - TeardownPodNetwork releases the pod through gate Del; errors are logged
//     and never fail the teardown.
//   - CheckHealth answers ready whenever the hook is serving, the agent up or
//     not (the message then says what it waits for). The runtime reports the
//     hooks' health as its NetworkReady condition, and a node whose runtime is
//     not network-ready is marked NotReady by kubelet: no pod is scheduled
//     there and, after the taint's toleration, its pods are evicted. Holding
//     each pod's setup at the gate until the agent is ready is the product;
//     turning an agent restart into a node outage is not.
//
// The registration is removed on every stop that is not a crash, unless a
// successor already took the socket over (ListenTakingOver): an update that
// starts the new hook before stopping the old one hands over without a
// moment in which the runtime's chain lacks the hook.
package nethook

import (
	"context"
	"errors"
	"fmt"
	"net"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mesh-cni/mesh-cni/internal/gaterpc"
	"github.com/mesh-cni/mesh-cni/internal/nethook/nethookpb"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

// DefaultNetwork is the attachment network hook pods are recorded under in the
// agent; CNI GC of a conflist never touches them.
const DefaultNetwork = "nethook"

// Config configures the hook server: gate's entry-point configuration, whose
// SocketPath goes into the registration's address and whose Ready is required
// (CheckHealth answers with it).
type Config struct {
	gaterpc.EntryConfig
}

func (c Config) withDefaults() (Config, error) {
	entry, err := c.EntryConfig.WithDefaults("network-plugin hook", DefaultNetwork)
	if err != nil {
		return c, err
	}
	if entry.Ready == nil {
		return c, errors.New("network-plugin hook: no readiness function")
	}
	return Config{EntryConfig: entry}, nil
}

// Server is the hook listening on its socket. Its Addr is the registration's
// address; a setup cut off by Stop before its enrollment returned has failed
// for the runtime.
type Server struct {
	*gaterpc.Server
	listener net.Listener
}

// New listens on cfg.SocketPath, taking the socket over from a hook still
// serving there (see the package doc).
func New(ctx context.Context, log *zap.Logger, cfg Config) (*Server, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	l, err := gaterpc.ListenTakingOver(ctx, cfg.SocketPath)
	if err != nil {
		return nil, fmt.Errorf("network-plugin hook: %w", err)
	}
	log = log.With(zap.String("entry", "nethook"))
	srv := gaterpc.NewServer(cfg.AllowedUIDs)
	nethookpb.RegisterPodNetworkLifecycleServer(srv, &hook{log: log, cfg: cfg})
	return &Server{Server: gaterpc.NewUnixServer("network-plugin hook", log, l, srv), listener: l}, nil
}

// Superseded reports whether a newer hook took the socket over.
func (s *Server) Superseded() (bool, error) { return gaterpc.Superseded(s.listener) }

type hook struct {
	nethookpb.UnimplementedPodNetworkLifecycleServer
	log *zap.Logger
	cfg Config
}

func (h *hook) SetupPodNetwork(ctx context.Context, req *nethookpb.SetupPodNetworkRequest) (*nethookpb.SetupPodNetworkResponse, error) {
	log := h.log.With(zap.String("sandbox", req.GetSandboxId()), zap.String("pod", req.GetPodNamespace()+"/"+req.GetPodName()))
	// The mesh sets up no network: nothing to add to the runtime's result,
	// which already holds the primary's interfaces (see the package doc).
	result := &nethookpb.SetupPodNetworkResponse{}
	if h.cfg.Excluded(req.GetPodNamespace()) {
		log.Info("namespace is excluded from the mesh; setup passed through")
		return result, nil
	}
	gaterpc.LogFittedMetadata(log, req.GetLabels(), req.GetAnnotations())
	add, err := SetupToGate(req, h.cfg.Network)
	if err != nil {
		log.Warn("refused setup: the pod could not be enrolled", zap.Error(err))
		return nil, status.Errorf(codes.InvalidArgument, "mesh-cni: cannot enroll pod %s/%s in the mesh: %v", req.GetPodNamespace(), req.GetPodName(), err)
	}
	decision, err := h.cfg.Enroll(ctx, log, "setup", add)
	if err != nil {
		st := status.Convert(err)
		log.Error("enrollment failed", zap.Error(err))
		// Nothing should be held after a failed Add; release anyway, so the
		// runtime's retry starts clean.
		h.cfg.Release(context.WithoutCancel(ctx), log, &gatepb.DelRequest{Attachment: add.GetAttachment(), NetnsPath: add.GetNetnsPath(), Source: gatepb.Source_SOURCE_HOOK})
		return nil, status.Errorf(gaterpc.FailureCode(st.Code()), "mesh-cni: pod %s/%s was not enrolled in the mesh: %s", req.GetPodNamespace(), req.GetPodName(), st.Message())
	}
	log.Info("setup done", zap.Stringer("decision", decision.GetDecision()), zap.String("reason", decision.GetReason()),
		zap.String("netns", add.GetNetnsPath()), zap.String("ifname", add.GetAttachment().GetIfname()))
	return result, nil
}

// TeardownPodNetwork releases the pod. It never fails because of the mesh: a
// failed teardown would keep the runtime from removing the sandbox, and the
// agent's reconciliation releases pods whose network namespace is gone.
func (h *hook) TeardownPodNetwork(ctx context.Context, req *nethookpb.TeardownPodNetworkRequest) (*nethookpb.TeardownPodNetworkResponse, error) {
	log := h.log.With(zap.String("sandbox", req.GetSandboxId()), zap.String("pod", req.GetPodNamespace()+"/"+req.GetPodName()))
	del, err := TeardownToGate(req, h.cfg.Network)
	if err != nil {
		log.Warn("cannot release the pod from the mesh", zap.Error(err))
		return &nethookpb.TeardownPodNetworkResponse{}, nil
	}
	h.cfg.Release(ctx, log, del)
	return &nethookpb.TeardownPodNetworkResponse{}, nil
}

// CheckHealth is ready while the hook serves, the agent ready, starting or
// down: pods wait at the gate for the agent, and a not-ready answer would make
// kubelet mark the whole node NotReady (see the package doc).
func (h *hook) CheckHealth(context.Context, *nethookpb.CheckHealthRequest) (*nethookpb.CheckHealthResponse, error) {
	if ready, why := h.cfg.Ready(); !ready {
		return &nethookpb.CheckHealthResponse{Ready: true, Message: "mesh-agent is starting or down (" + why + "); setups of meshed pods wait for it"}, nil
	}
	return &nethookpb.CheckHealthResponse{Ready: true, Message: "mesh-agent is ready"}, nil
}
