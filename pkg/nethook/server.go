// Package nethook is the mesh-agent's network-plugin hook entry point: it
// serves the containerd-style PodNetworkLifecycle service (proto package
// "containerd.services.networking.v1") on its own Unix socket and registers it
// with a JSON file in the runtime's plugin directory, as a non-primary plugin
// that runs after the primary one.
//
//   - SetupPodNetwork enrolls the pod through gate Add (which waits until the
//     agent is ready, bounded by the caller's deadline and
//     Config.EnrollTimeout) and answers with an empty SetupPodNetworkResponse,
//     also for an excluded namespace: the mesh adds no interfaces, routes or
//     DNS. The runtime appends each plugin's interfaces and routes to what came
//     before and takes every address as a pod IP, so echoing prev_result
//     would list each pod IP twice. If the pod cannot be enrolled the setup
//     fails, and the runtime tears down the plugins that already ran.
//   - TeardownPodNetwork releases the pod through gate Del; errors are logged
//     and never fail the teardown.
//   - CheckHealth answers ready whenever the hook is serving, also while the
//     agent is still starting (the message then says what it waits for). The
//     runtime reports the hooks' health as its NetworkReady condition, and a
//     node whose runtime is not network-ready is marked NotReady by kubelet:
//     no pod is scheduled there and, after the taint's toleration, its pods
//     are evicted. Holding each pod's setup at the gate until the agent is
//     ready is the product; turning an agent restart into a node outage is
//     not. A hook that does not answer at all (agent stopped) still fails the
//     runtime's check: that is the runtime's rule, not the hook's answer.
package nethook

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mesh-cni/mesh-cni/pkg/gate"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
	"github.com/mesh-cni/mesh-cni/pkg/nethook/nethookpb"
)

// Defaults for Config.
const (
	// DefaultNetwork is the attachment network hook pods are recorded under in
	// the agent; CNI GC of a conflist never touches them.
	DefaultNetwork = "nethook"
	// DefaultEnrollTimeout bounds how long a setup waits for the agent, like the
	// CNI plugin's gateTimeout. The caller's deadline bounds it too.
	DefaultEnrollTimeout = 30 * time.Second
	// DefaultReleaseTimeout bounds the gate Del of a teardown.
	DefaultReleaseTimeout = 5 * time.Second
)

// DefaultExcludeNamespace is passed through without contacting the gate, as in
// the CNI plugin's default excludeNamespaces: the cluster's own system pods
// never wait on the agent.
const DefaultExcludeNamespace = "kube-system"

// Config configures the hook server.
type Config struct {
	// SocketPath is where the hook listens; its directory is made 0700 and the
	// socket 0600. It goes into the registration's address.
	SocketPath string
	// AllowedUIDs may call (SO_PEERCRED); none means root only.
	AllowedUIDs []int
	// Gate is the agent's gate, called in process.
	Gate gatepb.GateServer
	// Ready reports the agent's readiness and, when not ready, what is missing;
	// CheckHealth answers with it.
	Ready func() (bool, string)
	// Network is the attachment network pods are recorded under; default
	// DefaultNetwork.
	Network string
	// ExcludeNamespaces pass through without enrollment; nil means
	// DefaultExcludeNamespace only, an empty non-nil slice excludes none.
	ExcludeNamespaces []string
	// EnrollTimeout and ReleaseTimeout: see the defaults.
	EnrollTimeout, ReleaseTimeout time.Duration
}

func (c Config) withDefaults() (Config, error) {
	if c.Gate == nil {
		return c, errors.New("network-plugin hook: no gate")
	}
	if c.Ready == nil {
		return c, errors.New("network-plugin hook: no readiness function")
	}
	if c.Network == "" {
		c.Network = DefaultNetwork
	}
	if c.ExcludeNamespaces == nil {
		c.ExcludeNamespaces = []string{DefaultExcludeNamespace}
	}
	c.ExcludeNamespaces = slices.Clone(c.ExcludeNamespaces)
	if c.EnrollTimeout <= 0 {
		c.EnrollTimeout = DefaultEnrollTimeout
	}
	if c.ReleaseTimeout <= 0 {
		c.ReleaseTimeout = DefaultReleaseTimeout
	}
	return c, nil
}

// Server is the hook listening on its socket.
type Server struct {
	log      *zap.Logger
	grpc     *grpc.Server
	listener net.Listener
}

// New listens on cfg.SocketPath.
func New(ctx context.Context, log *zap.Logger, cfg Config) (*Server, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	l, err := gate.Listen(ctx, cfg.SocketPath)
	if err != nil {
		return nil, fmt.Errorf("network-plugin hook: %w", err)
	}
	log = log.With(zap.String("entry", "nethook"))
	srv := gate.NewServer(cfg.AllowedUIDs)
	nethookpb.RegisterPodNetworkLifecycleServer(srv, &hook{log: log, cfg: cfg})
	return &Server{log: log, grpc: srv, listener: l}, nil
}

// Addr is the socket path the hook listens on: the registration's address.
func (s *Server) Addr() string { return s.listener.Addr().String() }

// Serve serves until Stop; it returns nil after a stop.
func (s *Server) Serve() error {
	s.log.Info("network-plugin hook serving", zap.String("socket", s.Addr()))
	if err := s.grpc.Serve(s.listener); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return fmt.Errorf("serve network-plugin hook: %w", err)
	}
	return nil
}

// Stop lets in-flight calls finish for up to grace, then cuts the rest. A setup
// cut off before its enrollment returned has failed for the runtime.
func (s *Server) Stop(grace time.Duration) {
	gate.Stop(s.grpc, grace)
}

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
	if slices.Contains(h.cfg.ExcludeNamespaces, req.GetPodNamespace()) {
		log.Info("namespace is excluded from the mesh; setup passed through")
		return result, nil
	}
	gate.LogFittedMetadata(log, req.GetLabels(), req.GetAnnotations())
	add, err := SetupToGate(req, h.cfg.Network)
	if err != nil {
		log.Warn("refused setup: the pod could not be enrolled", zap.Error(err))
		return nil, status.Errorf(codes.InvalidArgument, "mesh-cni: cannot enroll pod %s/%s in the mesh: %v", req.GetPodNamespace(), req.GetPodName(), err)
	}
	if ready, why := h.cfg.Ready(); !ready {
		log.Info("mesh-agent is not ready; the setup waits for it", zap.String("notReady", why), zap.Duration("atMost", h.cfg.EnrollTimeout))
	}
	addCtx, cancel := context.WithTimeout(ctx, h.cfg.EnrollTimeout)
	defer cancel()
	decision, err := h.cfg.Gate.Add(addCtx, add)
	if err != nil {
		st := status.Convert(err)
		log.Error("enrollment failed", zap.Error(err))
		// Nothing should be held after a failed Add; release anyway, so the
		// runtime's retry starts clean.
		relCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), h.cfg.ReleaseTimeout)
		gate.ReleaseSandbox(relCtx, log, h.cfg.Gate, &gatepb.DelRequest{Attachment: add.GetAttachment(), NetnsPath: add.GetNetnsPath(), Source: gatepb.Source_SOURCE_HOOK})
		cancel()
		code := st.Code()
		if code == codes.OK || code == codes.Unknown {
			code = codes.Internal
		}
		return nil, status.Errorf(code, "mesh-cni: pod %s/%s was not enrolled in the mesh: %s", req.GetPodNamespace(), req.GetPodName(), st.Message())
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
	relCtx, cancel := context.WithTimeout(ctx, h.cfg.ReleaseTimeout)
	defer cancel()
	gate.ReleaseSandbox(relCtx, log, h.cfg.Gate, del)
	return &nethookpb.TeardownPodNetworkResponse{}, nil
}

// CheckHealth is ready while the hook serves, the agent ready or not: pods
// wait at the gate for a starting agent, and a not-ready answer would make
// kubelet mark the whole node NotReady (see the package doc).
func (h *hook) CheckHealth(context.Context, *nethookpb.CheckHealthRequest) (*nethookpb.CheckHealthResponse, error) {
	if ready, why := h.cfg.Ready(); !ready {
		return &nethookpb.CheckHealthResponse{Ready: true, Message: "mesh-agent is starting (" + why + "); pod setups wait for it"}, nil
	}
	return &nethookpb.CheckHealthResponse{Ready: true, Message: "mesh-agent is ready"}, nil
}
