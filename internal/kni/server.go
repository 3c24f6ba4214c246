// Package kni is the mesh-agent's KNI entry point: an interposer that serves the
// KNI network runtime service (proto package "kni") to kubelet on a Unix socket
// and forwards every call to the node's real network runtime.
//
// Around the two calls that matter to the mesh it talks to the agent's gate in
// process:
//
//   - AttachInterface / AttachNetwork: forwarded first; once the runtime has set
//     the pod's network up, the pod is enrolled through gate Add (which waits
//     until the agent is ready, bounded by the caller's deadline and
//     Config.EnrollTimeout) and the runtime's response is held until Add
//     returns. If the pod cannot be enrolled the attach fails and is undone
//     with a detach to the runtime, so kubelet sees a failed attach (exactly as
//     a failed CNI ADD) and nothing is left half set up.
//   - DetachInterface / DetachNetwork: the pod is released through gate Del
//     first (errors are logged, a detach is never blocked by the mesh), then
//     the detach is forwarded.
//
// The two names of each pair are the same call (wire-identical messages): the
// kubelet fork calls AttachNetwork/DetachNetwork, the reference runtime libkni
// serves only AttachInterface/DetachInterface. A call the runtime answers
// Unimplemented is sent once more under the other name, so the interposer sits
// between any of them unchanged.
//
// Everything else, including methods this build does not know, is forwarded as
// it is: metadata and deadlines go up, headers, trailers and the runtime's
// errors (same code and message) come back.
package kni

import (
	"context"
	"fmt"
	"path/filepath"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"

	"github.com/mesh-cni/mesh-cni/internal/gaterpc"
	"github.com/mesh-cni/mesh-cni/internal/kni/knipb"
)

// Defaults for Config.
const (
	// DefaultNetwork is the attachment network KNI pods are recorded under in the
	// agent; CNI GC of a conflist never touches them.
	DefaultNetwork = "kni"
	// DefaultRollbackTimeout bounds the detach that undoes a failed attach. It
	// does not derive from the caller's deadline, which has often run out by
	// then.
	DefaultRollbackTimeout = 30 * time.Second
)

// Config configures the interposer. Its entry-point fields are gate's
// (EntryConfig): SocketPath is the KNI endpoint kubelet is configured with,
// Ready only feeds the logs (nil means "don't say"), and ReleaseTimeout bounds
// the gate Del before a detach is forwarded.
type Config struct {
	gaterpc.EntryConfig
	// UpstreamSocket is the real network runtime's socket.
	UpstreamSocket string
	// RollbackTimeout: see DefaultRollbackTimeout.
	RollbackTimeout time.Duration
}

func (c Config) withDefaults() (Config, error) {
	entry, err := c.EntryConfig.WithDefaults("kni interposer", DefaultNetwork)
	if err != nil {
		return c, err
	}
	c.EntryConfig = entry
	for _, p := range []struct{ name, path string }{{"socket", c.SocketPath}, {"upstream socket", c.UpstreamSocket}} {
		if !filepath.IsAbs(p.path) {
			return c, fmt.Errorf("kni interposer: %s path %q must be absolute", p.name, p.path)
		}
	}
	if filepath.Clean(c.SocketPath) == filepath.Clean(c.UpstreamSocket) {
		return c, fmt.Errorf("kni interposer: socket and upstream socket are both %q", c.SocketPath)
	}
	if c.RollbackTimeout <= 0 {
		c.RollbackTimeout = DefaultRollbackTimeout
	}
	return c, nil
}

// Server is the interposer listening on its socket.
type Server struct {
	*gaterpc.Server
	log      *zap.Logger
	upstream *grpc.ClientConn
}

// New prepares the upstream connection (it connects on first use, so the
// runtime may start later) and listens on cfg.SocketPath.
func New(ctx context.Context, log *zap.Logger, cfg Config) (*Server, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	conn, err := dialUpstream(cfg.UpstreamSocket)
	if err != nil {
		return nil, err
	}
	l, err := gaterpc.Listen(ctx, cfg.SocketPath)
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("kni interposer: %w", err)
	}
	log = log.With(zap.String("entry", "kni"))
	codec := newRawCodec()
	srv := gaterpc.NewServer(cfg.AllowedUIDs,
		grpc.ForceServerCodecV2(codec),
		grpc.UnknownServiceHandler(forwardUnknown(conn, codec)),
	)
	knipb.RegisterKNIServer(srv, &interposer{
		log:      log,
		cfg:      cfg,
		upstream: knipb.NewKNIClient(conn),
	})
	return &Server{
		Server:   gaterpc.NewUnixServer("KNI interposer", log, l, srv, zap.String("upstream", conn.Target())),
		log:      log,
		upstream: conn,
	}, nil
}

// dialUpstream prepares the client connection to the network runtime. The
// reconnect back-off is short so that a restarted runtime is used again within
// a fraction of a second; calls are not held waiting for it (no wait-for-ready),
// so kubelet sees the runtime's unavailability exactly as if it dialled it.
func dialUpstream(socketPath string) (*grpc.ClientConn, error) {
	conn, err := gaterpc.DialUnix(socketPath, 20*time.Millisecond, time.Second)
	if err != nil {
		return nil, fmt.Errorf("kni interposer: network runtime: %w", err)
	}
	return conn, nil
}

// Stop lets in-flight calls finish for up to grace, cuts the rest, and closes
// the upstream connection. An attach cut off before its enrollment returned has
// failed for kubelet, which retries it.
func (s *Server) Stop(grace time.Duration) {
	s.Server.Stop(grace)
	if err := s.upstream.Close(); err != nil {
		s.log.Warn("closing the network runtime connection", zap.Error(err))
	}
}
