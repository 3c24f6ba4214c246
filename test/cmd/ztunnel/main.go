// Command ztunnel runs the ztunnel double (package test/ztunnel): a node proxy
// that takes pods from a node agent's ZDS socket, istio-cni's or mesh-agent's,
// and serves each from inside its network namespace with ztunnel's in-pod socket
// behaviour, deciding HBONE or plaintext by istiod's ambient index:
//
//	ztunnel -zds /var/run/ztunnel/ztunnel.sock -istiod http://127.0.0.1:15014 \
//	  -dns svc.test=10.0.0.1 -record /tmp/ztunnel.jsonl
//
// It exits cleanly on SIGTERM or SIGINT.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/mesh-cni/mesh-cni/pkg/zds"
	"github.com/mesh-cni/mesh-cni/test/ztunnel"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	code := run(ctx, os.Args[1:], os.Stderr)
	stop()
	os.Exit(code)
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

func run(ctx context.Context, args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet("ztunnel", flag.ContinueOnError)
	fs.SetOutput(stderr)
	zdsPath := fs.String("zds", zds.DefaultSocketPath, "the node agent's ZDS socket")
	istiod := fs.String("istiod", "", "istiod's debug address (http://host:port), whose ambient index says which destinations are HBONE")
	record := fs.String("record", "", "append a JSON line per connection and DNS query to this file")
	requireSA := fs.Bool("require-service-account", false, "refuse (and hang up on) a pod handed over without a service account, which ztunnel could not serve")
	dns := dnsFlag{}
	fs.Var(dns, "dns", "names the DNS proxy answers: comma-separated name=address")
	level := zapcore.InfoLevel
	fs.Var(&level, "log-level", "log level (debug, info, warn, error)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if *istiod == "" {
		fmt.Fprintln(stderr, "ztunnel: -istiod is required")
		return 2
	}
	enc := zap.NewProductionEncoderConfig()
	enc.EncodeTime = zapcore.ISO8601TimeEncoder
	log := zap.New(zapcore.NewCore(zapcore.NewJSONEncoder(enc), zapcore.AddSync(stderr), level))
	defer log.Sync() //nolint:errcheck // stderr may be gone
	err := ztunnel.Run(ctx, ztunnel.Config{
		ZDSPath:    *zdsPath,
		Workloads:  ztunnel.WatchIstiod(ctx, log.Named("istiod"), *istiod, 200*time.Millisecond),
		DNS:        dns,
		RecordPath: *record,
		Log:        log,
		Options:    ztunnel.Options{RequireServiceAccount: *requireSA},
	})
	if err != nil {
		log.Error("ztunnel double failed", zap.Error(err))
		return 1
	}
	return 0
}
