// Command ztunnel runs the ztunnel double (package test/ztunnel): a node proxy
// that takes pods from a node agent's ZDS socket, istio-cni's or mesh-agent's,
// and serves each from inside its network namespace with ztunnel's in-pod socket
// behaviour, under the identity of the workload istiod has for it on its node
// and deciding HBONE or plaintext by istiod's workloads (WDS):
//
//	ztunnel -zds /var/run/ztunnel/ztunnel.sock -xds 127.0.0.1:15010 -node node-1 \
//	  -dns svc.test=10.0.0.1 -record /tmp/ztunnel.jsonl
//
// It exits cleanly on SIGTERM or SIGINT.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"strings"

	"github.com/mesh-cni/mesh-cni/test/cmd/internal/cmdmain"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/mesh-cni/mesh-cni/pkg/zds"
	"github.com/mesh-cni/mesh-cni/test/ztunnel"
)

func main() {
	cmdmain.Run(func(ctx context.Context, args []string, _, stderr io.Writer) int { return run(ctx, args, stderr) })
}

// dnsFlag is -dns: comma-separated name=address entries.
type dnsFlag map[string][]netip.Addr

func (f dnsFlag) String() string { return fmt.Sprint(map[string][]netip.Addr(f)) }

func (f dnsFlag) Set(s string) error {
	for _, entry := range strings.Split(s, ",") {
		name, addr, ok := strings.Cut(strings.TrimSpace(entry), "=")
		if !ok {
			return fmt.Errorf("%q: want name=address", entry)
		}
		a, err := netip.ParseAddr(addr)
		if err != nil {
			return err
		}
		name = strings.TrimSuffix(strings.ToLower(name), ".")
		f[name] = append(f[name], a)
	}
	return nil
}

// pairsFlag is comma-separated key=value entries.
type pairsFlag map[string]string

func (f pairsFlag) String() string { return fmt.Sprint(map[string]string(f)) }

func (f pairsFlag) Set(s string) error {
	for _, entry := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(entry), "=")
		if !ok {
			return fmt.Errorf("%q: want key=value", entry)
		}
		f[k] = v
	}
	return nil
}

func run(ctx context.Context, args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet("ztunnel", flag.ContinueOnError)
	fs.SetOutput(stderr)
	zdsPath := fs.String("zds", zds.DefaultSocketPath, "the node agent's ZDS socket")
	xds := fs.String("xds", "", "istiod's plaintext xDS address (host:port), whose workloads (WDS) name each pod's identity and say which destinations are HBONE")
	node := fs.String("node", "", "the node whose pods the double serves (ztunnel's NODE_NAME): a pod is served only as a workload istiod has on it")
	misreport := pairsFlag{}
	fs.Var(misreport, "misreport-service-account", "test fault: namespace/name=sa takes sa as the service account the agent sent for that pod (comma-separated entries)")
	record := fs.String("record", "", "append a JSON line per connection and DNS query to this file")
	requireSA := fs.Bool("require-service-account", false, "refuse (and hang up on) a pod handed over without a service account, which ztunnel could not serve")
	dns := dnsFlag{}
	fs.Var(dns, "dns", "names the DNS proxy answers: comma-separated name=address")
	var forward netip.AddrPort
	fs.Func("dns-forward", "the resolver (address:port) queries for other names are forwarded to, as ztunnel forwards to its resolv.conf's; without it they get SERVFAIL", func(s string) error {
		var err error
		forward, err = netip.ParseAddrPort(s)
		return err
	})
	level := zapcore.InfoLevel
	fs.Var(&level, "log-level", "log level (debug, info, warn, error)")
	if code, done := cmdmain.Parse(fs, args); done {
		return code
	}
	if *xds == "" || *node == "" {
		fmt.Fprintln(stderr, "ztunnel: -xds and -node are required")
		return 2
	}
	enc := zap.NewProductionEncoderConfig()
	enc.EncodeTime = zapcore.ISO8601TimeEncoder
	log := zap.New(zapcore.NewCore(zapcore.NewJSONEncoder(enc), zapcore.AddSync(stderr), level))
	defer log.Sync() //nolint:errcheck // stderr may be gone
	wds, err := ztunnel.WatchWDS(ctx, log.Named("xds"), *xds, *node)
	if err != nil {
		log.Error("ztunnel double failed", zap.Error(err))
		return 1
	}
	err = ztunnel.Run(ctx, ztunnel.Config{
		ZDSPath:    *zdsPath,
		Workloads:  wds,
		Node:       *node,
		DNS:        dns,
		DNSForward: forward,
		RecordPath: *record,
		Log:        log,
		Options:    ztunnel.Options{RequireServiceAccount: *requireSA, Misreport: misreport},
	})
	if err != nil {
		log.Error("ztunnel double failed", zap.Error(err))
		return 1
	}
	return 0
}
