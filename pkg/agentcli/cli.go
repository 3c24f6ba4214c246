// Package agentcli is the mesh-agent command line: flags, logging and the
// subcommands. cmd/mesh-agent only calls Main.
package agentcli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/mesh-cni/mesh-cni/pkg/agent"
)

// Defaults shared with the plugin's config and the Kubernetes manifests.
const (
	DefaultSocketPath = "/var/run/mesh-cni/gate.sock"
	DefaultStateDir   = "/var/run/mesh-cni/pods"
	DefaultBPFFSRoot  = "/sys/fs/bpf/mesh-cni"
)

// options are the flags of `mesh-agent run`.
type options struct {
	socketPath    string
	stateDir      string
	allowedUIDs   uidList
	datapath      string
	bpffsRoot     string
	cgroupRoot    string
	logLevel      string
	shutdownGrace time.Duration
}

// flagSet declares every flag of `mesh-agent run`; the configuration reference in
// the README is checked against it.
func flagSet(opts *options, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("mesh-agent run", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&opts.socketPath, "socket", DefaultSocketPath, "path of the gate socket the mesh-cni plugin dials")
	fs.StringVar(&opts.stateDir, "state-dir", DefaultStateDir, "directory of the per-pod enrollment records")
	opts.allowedUIDs = uidList{0}
	fs.Var(&opts.allowedUIDs, "allowed-uids", "comma-separated user ids allowed to call the gate socket (checked with SO_PEERCRED)")
	fs.StringVar(&opts.datapath, "datapath", "ebpf", "redirection data path: ebpf, or none to run the gate without redirection")
	fs.StringVar(&opts.bpffsRoot, "bpffs-root", DefaultBPFFSRoot, "bpffs directory where maps and links are pinned (a bpffs is mounted there if needed)")
	fs.StringVar(&opts.cgroupRoot, "cgroup-root", "", "cgroup v2 root where the connect programs attach (default: found in /proc/self/mountinfo)")
	fs.StringVar(&opts.logLevel, "log-level", "info", "log level: debug, info, warn or error")
	fs.DurationVar(&opts.shutdownGrace, "shutdown-grace", 5*time.Second, "how long in-flight gate calls may run after SIGTERM")
	return fs
}

type uidList []int

func (u *uidList) String() string {
	parts := make([]string, len(*u))
	for i, v := range *u {
		parts[i] = strconv.Itoa(v)
	}
	return strings.Join(parts, ",")
}

func (u *uidList) Set(s string) error {
	var out []int
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		v, err := strconv.Atoi(part)
		if err != nil || v < 0 {
			return fmt.Errorf("uid %q is not a non-negative integer", part)
		}
		out = append(out, v)
	}
	if len(out) == 0 {
		return errors.New("at least one uid is needed")
	}
	*u = out
	return nil
}

// Main runs the mesh-agent command line and returns the process exit code.
func Main(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cmd := "run"
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		cmd, args = args[0], args[1:]
	}
	switch cmd {
	case "run":
		return runCommand(ctx, args, stderr)
	case "uninstall":
		return uninstallCommand(ctx, args, stderr)
	case "help":
		fmt.Fprintln(stdout, usage)
		return 0
	default:
		fmt.Fprintf(stderr, "mesh-agent: unknown command %q\n%s\n", cmd, usage)
		return 2
	}
}

const usage = `usage: mesh-agent [run] [flags]   run the node agent (default)
       mesh-agent uninstall [flags]  remove the pinned data path and its cgroup attachments`

func runCommand(ctx context.Context, args []string, stderr io.Writer) int {
	var opts options
	fs := flagSet(&opts, stderr)
	if err := fs.Parse(args); err != nil {
		return 2
	}
	log, err := newLogger(opts.logLevel, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "mesh-agent: %v\n", err)
		return 2
	}
	defer log.Sync() //nolint:errcheck // nothing useful to do when stderr is gone

	open, err := datapathOpener(opts, log)
	if err != nil {
		log.Error("invalid configuration", zap.Error(err))
		return 2
	}
	cfg := agent.Config{
		SocketPath:    opts.socketPath,
		StateDir:      opts.stateDir,
		AllowedUIDs:   opts.allowedUIDs,
		OpenDatapath:  open,
		ShutdownGrace: opts.shutdownGrace,
	}
	if err := agent.Run(ctx, log, cfg); err != nil {
		log.Error("agent failed", zap.Error(err))
		return 1
	}
	return 0
}

func datapathOpener(opts options, log *zap.Logger) (func(context.Context) (agent.Datapath, func() error, error), error) {
	switch opts.datapath {
	case "none":
		return func(context.Context) (agent.Datapath, func() error, error) {
			log.Warn("running without a data path: pods are recorded but their traffic is NOT redirected")
			return agent.RecordOnly{}, func() error { return nil }, nil
		}, nil
	case "ebpf":
		return ebpfOpener(opts, log), nil
	default:
		return nil, fmt.Errorf("--datapath=%q: want ebpf or none", opts.datapath)
	}
}

func newLogger(level string, w io.Writer) (*zap.Logger, error) {
	lvl, err := zapcore.ParseLevel(level)
	if err != nil {
		return nil, fmt.Errorf("--log-level: %w", err)
	}
	enc := zap.NewProductionEncoderConfig()
	enc.EncodeTime = zapcore.ISO8601TimeEncoder
	core := zapcore.NewCore(zapcore.NewJSONEncoder(enc), zapcore.AddSync(w), lvl)
	return zap.New(core), nil
}
