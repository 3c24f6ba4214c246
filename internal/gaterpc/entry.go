package gaterpc

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

	"github.com/mesh-cni/mesh-cni/pkg/gate/gateclient"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

// Defaults of EntryConfig.
const (
	// DefaultEnrollTimeout bounds how long an entry point's call waits for the
	// agent to enroll the pod, like the CNI plugin's gateTimeout. The caller's
	// deadline bounds it too.
	DefaultEnrollTimeout = 30 * time.Second
	// DefaultReleaseTimeout bounds the gate Del of a teardown.
	DefaultReleaseTimeout = 5 * time.Second
)

// EntryConfig is what every entry point other than the CNI plugin (the KNI
// interposer in the agent, the network-plugin hook in its own process) is
// configured with: the socket it serves, who may call it, the gate it admits
// pods through and the bounds of those calls.
type EntryConfig struct {
	// SocketPath is where the entry point listens; its directory is made 0700
	// and the socket 0600 (see Listen).
	SocketPath string
	// AllowedUIDs may call (SO_PEERCRED); none means root only.
	AllowedUIDs []int
	// Gate is the agent's gate: called in process, or over the gate socket
	// (nethook.Gate).
	Gate gatepb.GateServer
	// Ready reports the agent's readiness and, when not ready, what is
	// missing. The gate's Add does the waiting; an entry point only tells.
	Ready func() (bool, string)
	// Network is the attachment network the pods are recorded under; each
	// entry point has its own default, so CNI GC of a conflist never touches
	// its pods.
	Network string
	// ExcludeNamespaces pass through without enrollment; nil means
	// gateclient.DefaultExcludeNamespace only, an empty non-nil slice excludes none.
	ExcludeNamespaces []string
	// EnrollTimeout and ReleaseTimeout: see the defaults.
	EnrollTimeout, ReleaseTimeout time.Duration
}

// WithDefaults checks c and fills in the defaults; network is the entry
// point's default attachment network, name prefixes its errors.
func (c EntryConfig) WithDefaults(name, network string) (EntryConfig, error) {
	if c.Gate == nil {
		return c, fmt.Errorf("%s: no gate", name)
	}
	if c.Network == "" {
		c.Network = network
	}
	if c.ExcludeNamespaces == nil {
		c.ExcludeNamespaces = []string{gateclient.DefaultExcludeNamespace}
	}
	// A copy: the caller's slice may change after the server started.
	c.ExcludeNamespaces = slices.Clone(c.ExcludeNamespaces)
	if c.EnrollTimeout <= 0 {
		c.EnrollTimeout = DefaultEnrollTimeout
	}
	if c.ReleaseTimeout <= 0 {
		c.ReleaseTimeout = DefaultReleaseTimeout
	}
	return c, nil
}

// Excluded reports whether pods of namespace pass through without the gate.
func (c EntryConfig) Excluded(namespace string) bool {
	return slices.Contains(c.ExcludeNamespaces, namespace)
}

// Enroll admits the pod of add through the gate, waiting at most
// EnrollTimeout (and the caller's deadline) for the agent. call names what
// waits ("attach", "setup") in the log line that says the agent is not ready.
func (c EntryConfig) Enroll(ctx context.Context, log *zap.Logger, call string, add *gatepb.AddRequest) (*gatepb.AddResponse, error) {
	if c.Ready != nil {
		if ready, why := c.Ready(); !ready {
			log.Info("mesh-agent is not ready; the "+call+" waits for it", zap.String("notReady", why), zap.Duration("atMost", c.EnrollTimeout))
		}
	}
	ctx, cancel := context.WithTimeout(ctx, c.EnrollTimeout)
	defer cancel()
	return c.Gate.Add(ctx, add)
}

// Release releases del's sandbox (ReleaseSandbox) within ReleaseTimeout.
func (c EntryConfig) Release(ctx context.Context, log *zap.Logger, del *gatepb.DelRequest) {
	ctx, cancel := context.WithTimeout(ctx, c.ReleaseTimeout)
	defer cancel()
	ReleaseSandbox(ctx, log, c.Gate, del)
}

// FailureCode is the code an entry point fails its caller's call with when the
// gate answered code: the gate's own, except that a failed enrollment must
// never read as a success or an unexplained error.
func FailureCode(code codes.Code) codes.Code {
	if code == codes.OK || code == codes.Unknown {
		return codes.Internal
	}
	return code
}

// Server is a gRPC server on one of the agent's Unix sockets (the gate, the KNI
// interposer, the network-plugin hook) with the listener it serves.
type Server struct {
	name     string
	log      *zap.Logger
	grpc     *grpc.Server
	listener net.Listener
	fields   []zap.Field
}

// NewUnixServer pairs srv with l (from Listen). name says what it serves, in
// its log line and errors; fields go into the line logged when serving starts.
func NewUnixServer(name string, log *zap.Logger, l net.Listener, srv *grpc.Server, fields ...zap.Field) *Server {
	return &Server{name: name, log: log, grpc: srv, listener: l, fields: fields}
}

// Addr is the socket path the server listens on.
func (s *Server) Addr() string { return s.listener.Addr().String() }

// Serve serves until Stop; it returns nil after a stop.
func (s *Server) Serve() error {
	s.log.Info(s.name+" serving", append([]zap.Field{zap.String("socket", s.Addr())}, s.fields...)...)
	if err := s.grpc.Serve(s.listener); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return fmt.Errorf("serve %s: %w", s.name, err)
	}
	return nil
}

// Stop lets in-flight calls finish for up to grace, then cuts the rest (see
// the package function Stop).
func (s *Server) Stop(grace time.Duration) { Stop(s.grpc, grace) }
