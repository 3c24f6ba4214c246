package agentcli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	"go.uber.org/zap"

	"github.com/mesh-cni/mesh-cni/internal/gaterpc"
	"github.com/mesh-cni/mesh-cni/internal/nethook"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gateclient"
)

// Defaults of `mesh-agent hook`.
const (
	// DefaultHookSocket is the hook's socket, next to the gate's.
	DefaultHookSocket = "/var/run/mesh-cni/hook/hook.sock"
	// DefaultHookPluginDir is where containerd's network-plugin prototype
	// looks for registrations.
	DefaultHookPluginDir = "/etc/containerd/net.d"
)

// hookOptions are the flags of `mesh-agent hook`.
type hookOptions struct {
	socket            string
	gateSocket        string
	pluginDir         string
	name              string
	priority          int
	enrollTimeout     time.Duration
	excludeNamespaces stringList
	allowedUIDs       intList
	shutdownGrace     time.Duration
	logLevel          string
	logFormat         string
	unregister        bool
	probe             bool
}

// hookFlagSet declares the flags of `mesh-agent hook`; docs/configuration.md
// is checked against it.
func hookFlagSet(o *hookOptions, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("mesh-agent hook", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.socket, "hook-socket", DefaultHookSocket, "serve containerd's PodNetworkLifecycle hook on this socket (the registration's address); a hook still serving there hands it over")
	fs.StringVar(&o.gateSocket, "socket", DefaultSocketPath, "the agent's gate socket, where pod setups are admitted")
	fs.StringVar(&o.pluginDir, "hook-plugin-dir", DefaultHookPluginDir, "containerd's plugin directory, where the registration file is written")
	fs.StringVar(&o.name, "hook-name", "mesh-cni", "name of the registration (file <name>.json)")
	fs.IntVar(&o.priority, "hook-priority", nethook.DefaultPriority, "registration priority: runs after plugins with a lower number (the primary)")
	fs.DurationVar(&o.enrollTimeout, "gate-timeout", gaterpc.DefaultEnrollTimeout, "how long a pod's setup waits for the agent to enroll it (the agent down included) before failing")
	o.excludeNamespaces = stringList{gateclient.DefaultExcludeNamespace}
	fs.Var(&o.excludeNamespaces, "exclude-namespaces", "comma-separated namespaces whose pods pass without the agent")
	o.allowedUIDs = intList{0}
	fs.Var(&o.allowedUIDs, "allowed-uids", "comma-separated user ids allowed to call the hook socket (checked with SO_PEERCRED)")
	fs.DurationVar(&o.shutdownGrace, "shutdown-grace", 5*time.Second, "how long in-flight setups may run after SIGTERM")
	fs.StringVar(&o.logLevel, "log-level", "info", "log level: debug, info, warn or error")
	fs.StringVar(&o.logFormat, "log-format", LogFormatJSON, "log format: json or console (text)")
	fs.BoolVar(&o.unregister, "unregister", false, "remove the registration left by a hook that crashed, if nothing serves its socket, and exit")
	fs.BoolVar(&o.probe, "probe", false, "readiness probe: exit 0 once the socket is served by a hook in this PID namespace (this pod's, not the one it replaces), 1 otherwise")
	return fs
}

// hookCommand runs the containerd network-plugin hook as its own process, so
// it outlives the agent (see internal/nethook).
func hookCommand(ctx context.Context, args []string, stderr io.Writer) int {
	var o hookOptions
	fs := hookFlagSet(&o, stderr)
	if err := parseFlags(fs, args, os.LookupEnv); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		fmt.Fprintf(stderr, "mesh-agent hook: %v\n", err)
		return 2
	}
	log, err := newLogger(o.logLevel, o.logFormat, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "mesh-agent hook: %v\n", err)
		return 2
	}
	defer log.Sync() //nolint:errcheck // nothing useful to do when stderr is gone
	log = log.Named("hook")
	if o.unregister {
		return unregisterHook(log, o)
	}
	if o.probe {
		if err := probeHook(o.socket); err != nil {
			log.Info("not ready", zap.Error(err))
			return 1
		}
		return 0
	}
	cfg := nethook.RunConfig{
		EntryConfig: gaterpc.EntryConfig{
			SocketPath:        o.socket,
			AllowedUIDs:       o.allowedUIDs,
			ExcludeNamespaces: o.excludeNamespaces,
			EnrollTimeout:     o.enrollTimeout,
		},
		GateSocket:    o.gateSocket,
		PluginDir:     o.pluginDir,
		Registration:  nethook.Registration{Name: o.name, Priority: o.priority},
		ShutdownGrace: o.shutdownGrace,
	}
	if err := nethook.Run(ctx, log, cfg); err != nil {
		log.Error("network-plugin hook failed", zap.Error(err))
		return 1
	}
	return 0
}

// probeHook succeeds when the hook serving socket runs in the caller's PID
// namespace. A readiness probe runs in the hook's own container: until this
// pod's hook has taken the socket over, the one it replaces (another pod,
// another PID namespace) answers, and the kernel reports its PID as 0. An
// update that waits for this before stopping the old pod hands over without a
// moment in which the registration is gone.
func probeHook(socket string) error {
	conn, err := net.DialTimeout("unix", socket, 2*time.Second)
	if err != nil {
		return fmt.Errorf("hook socket %s: %w", socket, err)
	}
	defer conn.Close()
	peer, err := gaterpc.PeerOf(conn)
	if err != nil {
		return err
	}
	if peer.PID == 0 {
		return fmt.Errorf("hook socket %s is served from another PID namespace (the hook this one replaces)", socket)
	}
	return nil
}

// unregisterHook removes the registration of a hook that is not serving (a
// crashed one's), and refuses while one serves: removing a live hook's file
// would let pods start unmeshed.
func unregisterHook(log *zap.Logger, o hookOptions) int {
	serving, err := agentListening(o.socket)
	if err != nil {
		log.Error("cannot tell whether a hook serves its socket", zap.Error(err))
		return 1
	}
	if serving {
		log.Error("a hook serves the socket: stop it instead (it removes its registration itself)", zap.String("socket", o.socket))
		return 1
	}
	if err := nethook.RemoveRegistration(o.pluginDir, o.name); err != nil {
		log.Error("removing the registration failed", zap.Error(err))
		return 1
	}
	log.Info("hook registration removed", zap.String("file", nethook.RegistrationPath(o.pluginDir, o.name)))
	return 0
}
