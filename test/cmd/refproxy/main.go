// Command refproxy runs the reference L4 mesh proxy (package test/proxy) in the
// network namespace it is started in, typically a pod's:
//
//	nsenter --net=/run/netns/pod refproxy -record /tmp/pod.jsonl
//
// or, with -zds, as a node proxy like ztunnel: one process on the node that
// receives the pods from the agent's ZDS socket and opens each pod's listeners
// inside that pod's network namespace:
//
//	refproxy -zds /var/run/ztunnel/ztunnel.sock -record /tmp/node.jsonl
//
// It prints one line, "ready", on stdout once every listener is bound (with
// -zds: once the first snapshot from the agent is served), and exits cleanly on
// SIGTERM or SIGINT.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"strconv"

	"github.com/mesh-cni/mesh-cni/test/cmd/internal/cmdmain"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/mesh-cni/mesh-cni/pkg/zds"
	"github.com/mesh-cni/mesh-cni/test/proxy"
)

func main() { cmdmain.Run(run) }

// run serves until ctx is done and returns the exit status: 0 after a clean stop,
// 1 when the proxy fails, 2 for bad flags.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("refproxy", flag.ContinueOnError)
	fs.SetOutput(stderr)
	outbound := fs.Uint("outbound-port", proxy.DefaultOutboundPort, "outbound listener port (127.0.0.1 and [::1])")
	inbound := fs.Uint("inbound-port", proxy.DefaultInboundPort, "inbound listener port (0.0.0.0 and [::])")
	mark := fs.String("mark", fmt.Sprintf("%#x", proxy.DefaultMark), "SO_MARK set on onward connections (decimal or 0x hex)")
	record := fs.String("record", "", "append a JSON line per finished connection to this file")
	echo := fs.Bool("echo", false, "answer connections by echoing instead of dialing the original destination")
	forwardTo := fs.String("forward-to", "", "send every accepted connection to this HOST:PORT instead of its original destination (chaining proxies explicitly, with no capture)")
	zdsPath := fs.String("zds", "", "run as a node proxy: take pods from the agent's ZDS socket at this path (e.g. "+zds.DefaultSocketPath+")")
	requireSA := fs.Bool("require-service-account", false, "with -zds: refuse (and hang up on) a pod handed over without a service account, which ztunnel could not serve")
	level := zapcore.InfoLevel
	fs.Var(&level, "log-level", "log level (debug, info, warn, error)")
	if code, done := cmdmain.Parse(fs, args); done {
		return code
	}
	if fs.NArg() != 0 {
		fmt.Fprintf(stderr, "refproxy: unexpected arguments %q\n", fs.Args())
		return 2
	}
	cfg := proxy.Config{RecordPath: *record, Echo: *echo}
	var err error
	if *forwardTo != "" {
		if cfg.ForwardTo, err = netip.ParseAddrPort(*forwardTo); err != nil {
			fmt.Fprintf(stderr, "refproxy: -forward-to: %v\n", err)
			return 2
		}
	}
	if cfg.OutboundPort, err = port(*outbound); err != nil {
		fmt.Fprintf(stderr, "refproxy: -outbound-port: %v\n", err)
		return 2
	}
	if cfg.InboundPort, err = port(*inbound); err != nil {
		fmt.Fprintf(stderr, "refproxy: -inbound-port: %v\n", err)
		return 2
	}
	m, err := strconv.ParseUint(*mark, 0, 32)
	if err != nil || m == 0 {
		fmt.Fprintf(stderr, "refproxy: -mark %q: want a non-zero 32-bit number\n", *mark)
		return 2
	}
	cfg.Mark = uint32(m)

	log := zap.New(zapcore.NewCore(
		zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig()),
		zapcore.Lock(zapcore.AddSync(stderr)),
		level,
	))
	defer log.Sync() //nolint:errcheck // nothing useful to do if stderr cannot sync
	cfg.Logger = log

	if *zdsPath != "" {
		return runNode(ctx, proxy.NodeConfig{Proxy: cfg, ZDSPath: *zdsPath, RequireServiceAccount: *requireSA}, stdout, log)
	}
	p, err := proxy.Start(ctx, cfg)
	if err != nil {
		log.Error("start proxy", zap.Error(err))
		return 1
	}
	if _, err := fmt.Fprintln(stdout, "ready"); err != nil {
		log.Error("announce ready", zap.Error(err))
		_ = p.Close()
		return 1
	}
	<-ctx.Done()
	log.Info("stopping", zap.Int("connections", len(p.Records())))
	if err := p.Close(); err != nil {
		log.Error("stop proxy", zap.Error(err))
		return 1
	}
	return 0
}

// runNode serves as a node proxy until ctx is done. It announces ready once the
// first snapshot is served, so every pod enrolled by then has its listeners.
func runNode(ctx context.Context, cfg proxy.NodeConfig, stdout io.Writer, log *zap.Logger) int {
	n, err := proxy.StartNode(ctx, cfg)
	if err != nil {
		log.Error("start node proxy", zap.Error(err))
		return 1
	}
	code := 0
	if _, err := n.WaitStatus(ctx, func(st proxy.NodeStatus) bool { return st.Snapshots > 0 }); err == nil {
		if _, err := fmt.Fprintln(stdout, "ready"); err != nil {
			log.Error("announce ready", zap.Error(err))
			code = 1
		}
	} else if ctx.Err() == nil {
		log.Error("node proxy stopped before its first snapshot", zap.Error(err))
		code = 1
	}
	if code == 0 {
		<-ctx.Done()
	}
	st := n.Status()
	log.Info("stopping", zap.Int("pods", len(st.Pods)), zap.Int("connections", len(n.Records())))
	if err := n.Close(); err != nil {
		log.Error("stop node proxy", zap.Error(err))
		return 1
	}
	return code
}

func port(v uint) (uint16, error) {
	if v == 0 || v > 65535 {
		return 0, fmt.Errorf("%d is not a port (1-65535)", v)
	}
	return uint16(v), nil
}
