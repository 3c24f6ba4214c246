package agentcli

import (
	"context"
	"flag"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/mesh-cni/mesh-cni/internal/agent"
	"github.com/mesh-cni/mesh-cni/internal/gaterpc"
	"github.com/mesh-cni/mesh-cni/internal/kni"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

// entryOptions are the flags of the entry points beyond CNI.
type entryOptions struct {
	kniSocket        string
	kniUpstream      string
	kniEnrollTimeout time.Duration
}

func (e *entryOptions) register(fs *flag.FlagSet) {
	fs.StringVar(&e.kniSocket, "kni-socket", "", "serve the KNI interposer on this socket (kubelet's KNI endpoint); empty: off")
	fs.StringVar(&e.kniUpstream, "kni-upstream", "", "socket of the real KNI network runtime the interposer forwards to")
	fs.DurationVar(&e.kniEnrollTimeout, "kni-enroll-timeout", gaterpc.DefaultEnrollTimeout, "how long a KNI attach waits for the agent to enroll the pod")
}

// entryPoints builds the KNI interposer from the flags. The containerd hook
// is not served here: it runs as its own process (`mesh-agent hook`, see
// hook.go) so that it outlives the agent.
func (o options) entryPoints(log *zap.Logger) ([]agent.EntryPoint, error) {
	var eps []agent.EntryPoint
	// entry is the configuration both share; each sets its own socket.
	entry := func(g gatepb.GateServer, ready func() (bool, string)) gaterpc.EntryConfig {
		return gaterpc.EntryConfig{AllowedUIDs: o.allowedUIDs, Gate: g, Ready: ready, ExcludeNamespaces: o.excludeNamespaces}
	}
	if o.entry.kniSocket != "" {
		if o.entry.kniUpstream == "" {
			return nil, fmt.Errorf("--kni-socket needs --kni-upstream, the real network runtime's socket")
		}
		eps = append(eps, func(ctx context.Context, g gatepb.GateServer, ready func() (bool, string)) (func(), error) {
			cfg := kni.Config{EntryConfig: entry(g, ready), UpstreamSocket: o.entry.kniUpstream}
			cfg.SocketPath, cfg.EnrollTimeout = o.entry.kniSocket, o.entry.kniEnrollTimeout
			srv, err := kni.New(ctx, log.Named("kni"), cfg)
			if err != nil {
				return nil, err
			}
			return o.serveInBackground(log, "kni interposer", srv), nil
		})
	}
	return eps, nil
}

// entryServer is an entry point's server.
type entryServer interface {
	Serve() error
	Stop(grace time.Duration)
}

// serveInBackground serves srv until the returned function stops it, within
// the agent's shutdown grace; a failure to serve is logged as name's.
func (o options) serveInBackground(log *zap.Logger, name string, srv entryServer) func() {
	go func() {
		if err := srv.Serve(); err != nil {
			log.Error(name+" stopped", zap.Error(err))
		}
	}()
	return func() { srv.Stop(o.shutdownGrace) }
}
