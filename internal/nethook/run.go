package nethook

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/mesh-cni/mesh-cni/internal/gaterpc"
)

// RunConfig configures the hook process (`mesh-agent hook`).
type RunConfig struct {
	// EntryConfig: SocketPath is the hook's socket (the registration's
	// address); Gate and Ready are filled in from GateSocket.
	gaterpc.EntryConfig
	// GateSocket is the agent's gate socket.
	GateSocket string
	// PluginDir is the runtime's plugin directory (/etc/containerd/net.d).
	PluginDir string
	// Registration's Name, Priority and DialTimeout; Address is the socket.
	Registration Registration
	// ShutdownGrace is how long in-flight calls may run after ctx ends.
	ShutdownGrace time.Duration
}

// Run serves the hook until ctx ends: it takes the socket over (from a hook
// still serving there), writes the registration once it serves, and on a stop
// removes the registration unless a newer hook took the socket over meanwhile
// (it then owns the same registration). A crash leaves the registration, and
// the next hook serves the same socket again.
func Run(ctx context.Context, log *zap.Logger, cfg RunConfig) error {
	if cfg.GateSocket == "" {
		return errors.New("network-plugin hook: no gate socket")
	}
	conn, err := gaterpc.Dial(cfg.GateSocket)
	if err != nil {
		return fmt.Errorf("network-plugin hook: %w", err)
	}
	defer conn.Close()
	srv, err := New(ctx, log, Config{EntryConfig: remoteEntry(cfg.EntryConfig, NewGate(cfg.GateSocket, conn))})
	if err != nil {
		return err
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve() }()
	stop := func() error {
		srv.Stop(cfg.ShutdownGrace)
		return <-served
	}

	reg := cfg.Registration
	reg.Address = srv.Addr()
	path, err := WriteRegistration(cfg.PluginDir, reg)
	if err != nil {
		return errors.Join(err, stop())
	}
	log.Info("network-plugin hook registered", zap.String("file", path), zap.String("gate", cfg.GateSocket))

	var serveErr error
	select {
	case <-ctx.Done():
	case serveErr = <-served:
		// Serving failed: nobody answers on the socket any more, so the
		// registration must go (below) like on a stop.
		served <- serveErr
	}
	superseded, err := srv.Superseded()
	switch {
	case err != nil:
		log.Warn("cannot tell whether a newer hook took the socket over; removing the registration", zap.Error(err))
		fallthrough
	case !superseded:
		if rerr := RemoveRegistration(cfg.PluginDir, reg.Name); rerr != nil {
			log.Error("removing the registration failed", zap.Error(rerr))
			serveErr = errors.Join(serveErr, rerr)
		} else {
			log.Info("network-plugin hook unregistered", zap.String("file", path))
		}
	default:
		log.Info("a newer hook serves the socket; its registration stays", zap.String("file", path))
	}
	return errors.Join(serveErr, stop())
}
