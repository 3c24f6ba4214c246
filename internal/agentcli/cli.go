// Package agentcli is the mesh-agent command line: flags, logging and the
// subcommands. cmd/mesh-agent only calls Main.
package agentcli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/mesh-cni/mesh-cni/internal/agent"
	"github.com/mesh-cni/mesh-cni/internal/cniplugin"
	"github.com/mesh-cni/mesh-cni/internal/enroll"
	"github.com/mesh-cni/mesh-cni/internal/redirect"
	"github.com/mesh-cni/mesh-cni/internal/removal"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gateclient"
	"github.com/mesh-cni/mesh-cni/pkg/zds"
)

// Defaults shared with the plugin's config and the Kubernetes manifests. The
// gate socket is the plugin's default, so a chain entry without socketPath
// reaches an agent started without --socket.
const (
	DefaultSocketPath  = cniplugin.DefaultSocketPath
	DefaultStateDir    = "/var/run/mesh-cni/pods"
	DefaultBPFFSRoot   = redirect.DefaultPinRoot
	DefaultCNIBinDir   = "/opt/cni/bin"
	DefaultCNIConfDir  = "/etc/cni/net.d"
	DefaultInstallDir  = "/var/run/mesh-cni/install"
	DefaultMetricsAddr = "127.0.0.1:15099"
	// DefaultNetnsDir is where containerd and CRI-O bind mount pods' network
	// namespaces (the path they give CNI).
	DefaultNetnsDir = "/var/run/netns"
)

// options are the flags of `mesh-agent run` (most are shared by uninstall).
type options struct {
	socketPath        string
	stateDir          string
	allowedUIDs       intList
	datapath          string
	bpffsRoot         string
	cgroupRoot        string
	logLevel          string
	logFormat         string
	shutdownGrace     time.Duration
	reconcileInterval time.Duration
	adoptRunning      bool
	runtimeCNICheck   bool
	netnsDir          string
	podCgroupDriver   string
	podCgroupRoot     string
	metricsAddr       string
	zdsSocket         string
	zdsWait           string
	zdsAllowedUIDs    intList
	zdsNoServiceAcct  bool

	// Redirection settings for every enrolled pod.
	outboundPort          uint
	inboundPort           uint
	proxyMark             uint
	proxyUID              int
	proxyCgroups          stringList
	inboundExcludedPorts  intList
	outboundExcludedPorts intList
	excludedCIDRs         prefixList
	probeSources          probeSourceList
	probeCgroups          probeCgroupList
	kubeletExes           stringList
	dnsCapture            bool
	dnsPort               uint
	dnsFailClosed         bool
	denyRawSockets        bool
	denyPacketSockets     bool
	failOpen              bool

	// The CNI chain entry.
	cniInstall        bool
	cniBinDirs        stringList
	cniConfDir        string
	cniConfFile       string
	ownedConfig       bool
	pluginBinary      string
	installStateDir   string
	gateTimeout       time.Duration
	excludeNamespaces stringList
	pluginLogLevel    string
	pluginLogFile     string
	uninstallOnDelete bool

	entry  entryOptions
	enroll enrollOptions

	// explicit are the flags the command line set: a profile's defaults
	// apply only to the others, and the CNI directories are the runtime's
	// unless named.
	explicit map[string]bool
	// procRoot is the host's procfs ("": /proc); tests set another.
	procRoot string
	// placed is where the running agent installed (run only).
	placed *cniPlaced
}

// applyProfileDefaults sets what the istio selector profile changes in the
// defaults, for flags the command line left alone: DNS capture on (the istio-cni
// chart's default) and failing closed, as istio-cni's REDIRECT to 15053 does
// (a pod's DNS never reaches a resolver past ztunnel, not even while ztunnel
// restarts), and a pod's ADD waiting for the node proxy's ack (istio-cni
// fails an ambient pod's ADD while no ztunnel is connected; here it waits at the
// gate), so ambient.istio.io/redirection is only ever written for a pod ztunnel
// serves.
func (o *options) applyProfileDefaults() error {
	if o.enroll.profile != enroll.ProfileIstio {
		return nil
	}
	if !o.explicit["dns-capture"] {
		o.dnsCapture = true
	}
	if !o.explicit["dns-fail-closed"] {
		o.dnsFailClosed = o.dnsCapture
	}
	if !o.explicit["zds-wait"] {
		o.zdsWait = string(agent.WaitAlways)
	}
	if o.zdsSocket == "" {
		return errors.New("--selector-profile=istio enrolls ambient pods, which ztunnel serves over ZDS: --zds-socket cannot be off")
	}
	return nil
}

// flagSet declares every flag of `mesh-agent run`; the configuration reference in
// the README is checked against it.
func flagSet(name string, opts *options, stderr io.Writer) *flag.FlagSet {
	defaults := redirect.DefaultSettings()
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&opts.socketPath, "socket", DefaultSocketPath, "path of the gate socket the mesh-cni plugin dials")
	fs.StringVar(&opts.stateDir, "state-dir", DefaultStateDir, "directory of the per-pod enrollment records")
	opts.allowedUIDs = intList{0}
	fs.Var(&opts.allowedUIDs, "allowed-uids", "comma-separated user ids allowed to call the gate socket (checked with SO_PEERCRED)")
	fs.StringVar(&opts.datapath, "datapath", "ebpf", "redirection data path: ebpf, or none to run the gate without redirection")
	fs.StringVar(&opts.bpffsRoot, "bpffs-root", DefaultBPFFSRoot, "bpffs directory where maps and links are pinned (a bpffs is mounted there if needed)")
	fs.StringVar(&opts.cgroupRoot, "cgroup-root", "", "cgroup v2 directory where the socket programs attach, or a hybrid-cgroup node's /sys/fs/cgroup (its unified/ is used) (default: the cgroup2 mount found in /proc/self/mountinfo)")
	fs.StringVar(&opts.logLevel, "log-level", "info", "log level: debug, info, warn or error")
	fs.StringVar(&opts.logFormat, "log-format", LogFormatJSON, "log format: json (one object a line, for log collectors) or console (text, for reading kubectl logs)")
	fs.DurationVar(&opts.shutdownGrace, "shutdown-grace", 5*time.Second, "how long in-flight gate calls may run after SIGTERM")
	fs.StringVar(&opts.metricsAddr, "metrics-addr", DefaultMetricsAddr, "address for /metrics, /healthz and /readyz (empty: off); loopback unless you need scraping from off the node")
	fs.StringVar(&opts.zdsSocket, "zds-socket", zds.DefaultSocketPath, "serve the ZDS proxy handoff (what ztunnel connects to) on this SOCK_SEQPACKET socket; empty: off")
	opts.zdsAllowedUIDs = intList{0}
	fs.Var(&opts.zdsAllowedUIDs, "zds-allowed-uids", "comma-separated user ids a node proxy may connect to the ZDS socket as (checked with SO_PEERCRED)")
	fs.BoolVar(&opts.zdsNoServiceAcct, "zds-without-service-accounts", false, "serve ZDS although --enrollment cannot know pods' service accounts (file, all): every pod is handed over with an empty service_account, which ztunnel cannot serve (it finds the workload and its SPIFFE identity by it); only for a node proxy that does not use it")
	fs.StringVar(&opts.zdsWait, "zds-wait", string(agent.WaitAuto), "when a pod's ADD waits for the node proxy's ack: auto (once a proxy has ever connected), always or never (default always with --selector-profile=istio)")
	fs.DurationVar(&opts.reconcileInterval, "reconcile-interval", 30*time.Second, "period of the reconcile pass that releases pods whose namespace is gone, repairs broken redirection and rewrites redirection annotations that disagree with it")
	fs.BoolVar(&opts.adoptRunning, "adopt-running", true, "with --enrollment=kubernetes, enroll in place the running pods the agent has no record of (pods started before it was installed), once ready and every --reconcile-interval; their namespaces are found from the host's processes (the agent needs the host's PID namespace) in --netns-dir")
	fs.StringVar(&opts.netnsDir, "netns-dir", DefaultNetnsDir, "where the container runtime bind mounts pods' network namespaces: the only namespaces --adopt-running takes for a pod's")
	fs.StringVar(&opts.podCgroupDriver, "pod-cgroup-driver", podCgroupsFromKubelet, "where --adopt-running expects pods' container cgroups, and where a pod's Istio sidecar container's cgroup is found: kubelet (the kubelet's cgroupDriver and cgroupRoot, read from its command line and config files), or the kubelet's driver, systemd or cgroupfs, with --pod-cgroup-root, for a kubelet whose settings are not on its command line (k3s, MicroK8s)")
	fs.StringVar(&opts.podCgroupRoot, "pod-cgroup-root", "/", "with --pod-cgroup-driver=systemd or cgroupfs, the kubelet's cgroupRoot (its --cgroup-root)")

	fs.UintVar(&opts.outboundPort, "outbound-port", uint(defaults.OutboundPort), "proxy's outbound listener port inside each pod (127.0.0.1 and ::1)")
	fs.UintVar(&opts.inboundPort, "inbound-port", uint(defaults.InboundPort), "proxy's inbound listener port inside each pod")
	fs.UintVar(&opts.proxyMark, "proxy-mark", uint(defaults.ProxyMark), "opt-in: sockets carrying this SO_MARK (e.g. 0x539, ztunnel's) are the proxy's, never redirected; any pod can set a mark with CAP_NET_RAW, a default capability, so prefer --proxy-cgroups (0: off)")
	fs.IntVar(&opts.proxyUID, "proxy-uid", -1, "opt-in: connects by processes of this uid are the proxy's, never redirected; only safe when no pod can run as it (-1: off)")
	fs.Var(&opts.proxyCgroups, "proxy-cgroups", "comma-separated cgroup v2 paths (below the cgroup v2 root, e.g. /mesh-proxies) whose processes and their descendants' are the proxy: never redirected; a node proxy connected over ZDS is added by its own cgroup")
	opts.inboundExcludedPorts = toIntList(defaults.InboundExcludedPorts)
	fs.Var(&opts.inboundExcludedPorts, "inbound-excluded-ports", "comma-separated destination ports of inbound connections never captured (default: the proxy's own ports)")
	fs.Var(&opts.outboundExcludedPorts, "outbound-excluded-ports", "comma-separated destination ports of outbound connects never redirected, to any host (default: none)")
	fs.Var(&opts.excludedCIDRs, "excluded-cidrs", "comma-separated outbound destination CIDRs never redirected")
	fs.Var(&opts.probeSources, "probe-sources", "opt-in: inbound sources never captured, comma-separated CIDRs (anything able to send from them passes too: a masquerading node, a spoofing pod), or \"none\"; the kubelet's probes pass by --probe-cgroups")
	opts.probeCgroups = probeCgroupList{kubelet: true}
	fs.Var(&opts.probeCgroups, "probe-cgroups", "cgroups whose connects from the node's network namespace reach pods past their inbound capture, so kubelet probes pass a proxy that enforces mTLS or policy: \"kubelet\" (the kubelet's cgroup and namespace, found by its process and kept current), comma-separated cgroup v2 paths (connects from the agent's network namespace), or \"none\"")
	fs.Var(&opts.kubeletExes, "kubelet-exe", "with --probe-cgroups=kubelet, the kubelet's executables as comma-separated absolute paths on the host (e.g. /usr/bin/kubelet): a process is taken for the kubelet only when it runs one of these files (default: any executable named kubelet, k3s, k3s-server, k3s-agent or kubelite); its root directory, network namespace and a cgroup outside the pods' are checked either way")
	fs.BoolVar(&opts.dnsCapture, "dns-capture", false, "send enrolled pods' DNS (UDP and TCP to port 53) to the proxy's DNS listener on loopback (--dns-port); while nothing listens there, queries go to the resolver as sent (default true with --selector-profile=istio)")
	fs.UintVar(&opts.dnsPort, "dns-port", uint(defaults.DNSPort), "the proxy's DNS listener port inside each pod (127.0.0.1 and ::1, UDP and TCP)")
	fs.BoolVar(&opts.dnsFailClosed, "dns-fail-closed", false, "with --dns-capture, send DNS to the proxy's listener even when nothing listens there (queries then fail) (default true with --selector-profile=istio and DNS capture on)")
	fs.BoolVar(&opts.denyRawSockets, "deny-raw-sockets", false, "refuse enrolled pods raw IP sockets (socket() fails with EPERM): with CAP_NET_RAW, a default capability, a raw socket sends TCP past the outbound capture; packet sockets are not covered")
	fs.BoolVar(&opts.denyPacketSockets, "deny-packet-sockets", false, "refuse enrolled pods packet (AF_PACKET) sockets, which send any frame (a TCP handshake as another address after answering ARP for it) with CAP_NET_RAW; needs the BPF LSM on the node (its lsm= list names bpf): the agent refuses to start without it")
	fs.BoolVar(&opts.failOpen, "fail-open", false, "pass traffic through when no proxy listens (default: refuse outbound connects and drop inbound SYNs)")

	fs.BoolVar(&opts.cniInstall, "cni-install", true, "install the plugin binary and the chain entry, and keep the entry in place")
	fs.BoolVar(&opts.runtimeCNICheck, "runtime-cni-check", false, "install only into --cni-conf-dir and --cni-bin-dir, never where the container runtime loads CNI from through the host's root, and stay not ready while the runtime (containerd, CRI-O, found in the host's processes) loads CNI from other directories; the chart's cni.runtimeCheck turns it on")
	opts.cniBinDirs = stringList{DefaultCNIBinDir}
	fs.Var(&opts.cniBinDirs, "cni-bin-dir", "comma-separated CNI bin directories to install the mesh-cni binary into (default: where the container runtime loads plugins from, found through its process; through this directory when it is that one, through the host's root otherwise; this directory when the runtime is not found); set, it is used as given")
	fs.StringVar(&opts.cniConfDir, "cni-conf-dir", DefaultCNIConfDir, "CNI configuration directory to keep the chain entry in (default: where the container runtime loads configs from, as for --cni-bin-dir); set, it is used as given")
	fs.StringVar(&opts.cniConfFile, "cni-conf-file", "", "the primary CNI config file name to chain onto (default: the first valid file, as kubelet picks)")
	fs.BoolVar(&opts.ownedConfig, "owned-config", true, "write a merged conflist that sorts before the primary's (false: append the entry to the primary's own file, which leaves a short unmeshed window each time the primary rewrites it)")
	fs.StringVar(&opts.pluginBinary, "plugin-binary", "", "the mesh-cni binary to install (default: mesh-cni next to the mesh-agent binary)")
	fs.StringVar(&opts.installStateDir, "install-state-dir", DefaultInstallDir, "where the installer keeps the primary config's original bytes for uninstall")
	fs.DurationVar(&opts.gateTimeout, "gate-timeout", 30*time.Second, "the chain entry's gateTimeout: how long a pod's ADD waits for the agent")
	opts.excludeNamespaces = stringList{gateclient.DefaultExcludeNamespace}
	fs.Var(&opts.excludeNamespaces, "exclude-namespaces", "the chain entry's excludeNamespaces: pods there never wait for the agent")
	fs.StringVar(&opts.pluginLogLevel, "plugin-log-level", "info", "the chain entry's logLevel")
	fs.StringVar(&opts.pluginLogFile, "plugin-log-file", "", "the chain entry's logFile (default: the plugin logs to the runtime's stderr)")
	fs.BoolVar(&opts.uninstallOnDelete, "uninstall-on-delete", true, "on SIGTERM, ask the API server about the DaemonSet that runs the agent's pod ($POD_NAME, $POD_NAMESPACE) and, only when it answers that the DaemonSet is gone or being deleted (or, with no answer, its watch saw that), uninstall from the node as `mesh-agent uninstall` does (chain entry, plugin binary, data path: running pods are released); any other answer or none (a rolling update, a drain, an unreachable API server) keeps everything")
	opts.entry.register(fs)
	opts.enroll.register(fs)
	return fs
}

// redirectSettings turns the flags into the data path's settings.
func (o options) redirectSettings() (redirect.Settings, error) {
	s := redirect.DefaultSettings()
	if o.outboundPort > 65535 || o.inboundPort > 65535 {
		return s, fmt.Errorf("ports must be at most 65535")
	}
	if o.proxyMark > 0xffffffff {
		return s, fmt.Errorf("--proxy-mark %#x does not fit 32 bits", o.proxyMark)
	}
	s.OutboundPort, s.InboundPort = uint16(o.outboundPort), uint16(o.inboundPort)
	// A mark inside ztunnel's mask is compared under it (Istio's convention);
	// one with bits outside it, exactly.
	s.ProxyMark, s.ProxyMarkMask = uint32(o.proxyMark), 0
	if s.ProxyMark != 0 && s.ProxyMark&^redirect.ZtunnelMarkMask == 0 {
		s.ProxyMarkMask = redirect.ZtunnelMarkMask
	}
	if o.proxyUID >= 0 {
		uid := uint32(o.proxyUID)
		s.ProxyUID = &uid
	}
	var err error
	if s.InboundExcludedPorts, err = portList("inbound-excluded-ports", o.inboundExcludedPorts); err != nil {
		return s, err
	}
	if s.OutboundExcludedPorts, err = portList("outbound-excluded-ports", o.outboundExcludedPorts); err != nil {
		return s, err
	}
	s.ExcludedCIDRs = o.excludedCIDRs
	s.ProbeSources = o.probeSources.cidrs
	if o.dnsPort == 0 || o.dnsPort > 65535 {
		return s, fmt.Errorf("--dns-port %d is not a port", o.dnsPort)
	}
	s.DNSCapture, s.DNSPort, s.DNSFailClosed = o.dnsCapture, uint16(o.dnsPort), o.dnsFailClosed
	s.DenyRawSockets = o.denyRawSockets
	s.DenyPacketSockets = o.denyPacketSockets
	s.FailOpen = o.failOpen
	if err := s.Validate(); err != nil {
		return s, fmt.Errorf("redirection settings: %w", err)
	}
	return s, nil
}

func portList(flag string, in intList) ([]uint16, error) {
	var out []uint16
	for _, p := range in {
		if p <= 0 || p > 65535 {
			return nil, fmt.Errorf("--%s: %d is not a port", flag, p)
		}
		out = append(out, uint16(p))
	}
	return out, nil
}

// Main runs the mesh-agent command line and returns the process exit code.
func Main(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	cmd := "run"
	if len(args) > 0 && (!strings.HasPrefix(args[0], "-") || slices.Contains([]string{"-h", "-help", "--help", "-version", "--version"}, args[0])) {
		cmd, args = args[0], args[1:]
	}
	switch cmd {
	case "run":
		return runCommand(ctx, args, stderr)
	case "uninstall":
		return uninstallCommand(ctx, args, stderr)
	case "hook":
		return hookCommand(ctx, args, stderr)
	case "status":
		return statusCommand(ctx, args, stdout, stderr)
	case "check":
		return checkCommand(ctx, args, stdout, stderr)
	case "mount-bpffs":
		return mountBPFFSCommand(args, stderr)
	case "help", "-h", "-help", "--help":
		fmt.Fprintln(stdout, usage)
		return 0
	case "version", "-version", "--version":
		fmt.Fprintln(stdout, versionLine())
		return 0
	default:
		fmt.Fprintf(stderr, "mesh-agent: unknown command %q\n%s\n", cmd, usage)
		return 2
	}
}

const usage = `usage: mesh-agent [run] [flags]    run the node agent (default)
       mesh-agent status [-o json] [flags]  the node summary and the enrolled pods (works with the agent down)
       mesh-agent check [flags]      run the node checks; exits 1 listing what is wrong
       mesh-agent uninstall [flags]  remove the chain entry, the plugin binary, the pinned data path and its cgroup attachments
       mesh-agent hook [flags]       serve containerd's network-plugin hook (PodNetworkLifecycle) as its own process
       mesh-agent mount-bpffs        mount a bpffs at /sys/fs/bpf unless one is there (the DaemonSet's init container)
       mesh-agent version            the build: module version, Go release, data path object
Run "mesh-agent run -h" for the flags; each is also read from $MESH_AGENT_<FLAG> (upper case, - as _).`

// parseWithLogger parses args as the flags of command (run's flags) and builds
// the logger they ask for. ok is false when the command must exit 2: the flag
// package or this function has said why on stderr.
func parseWithLogger(command string, args []string, stderr io.Writer) (opts options, log *zap.Logger, exit int) {
	fs := flagSet(command, &opts, stderr)
	if err := parseFlags(fs, args, os.LookupEnv); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return opts, nil, 0
		}
		fmt.Fprintf(stderr, "mesh-agent: %v\n", err)
		return opts, nil, 2
	}
	opts.markExplicit(fs)
	log, err := newLogger(opts.logLevel, opts.logFormat, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "mesh-agent: %v\n", err)
		return opts, nil, 2
	}
	return opts, log, -1
}

// markExplicit records the flags the command line (or the environment) set.
func (o *options) markExplicit(fs *flag.FlagSet) {
	o.explicit = map[string]bool{}
	fs.Visit(func(f *flag.Flag) { o.explicit[f.Name] = true })
}

// EnvPrefix starts the environment variable of every flag of `mesh-agent run`
// (uninstall, hook): each is also read from MESH_AGENT_<FLAG> (upper case, "-"
// as "_"), the way charts usually pass settings; the command line wins over the
// environment.
const EnvPrefix = "MESH_AGENT_"

// EnvName is the environment variable of a flag.
func EnvName(flagName string) string {
	return EnvPrefix + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

// parseFlags sets each flag from its environment variable, then parses args.
func parseFlags(fs *flag.FlagSet, args []string, lookupEnv func(string) (string, bool)) error {
	var errs []error
	fs.VisitAll(func(f *flag.Flag) {
		if v, ok := lookupEnv(EnvName(f.Name)); ok {
			if err := fs.Set(f.Name, v); err != nil {
				errs = append(errs, fmt.Errorf("$%s=%q: %w", EnvName(f.Name), v, err))
			}
		}
	})
	if err := errors.Join(errs...); err != nil {
		return err
	}
	return fs.Parse(args)
}

func runCommand(ctx context.Context, args []string, stderr io.Writer) int {
	opts, log, exit := parseWithLogger("mesh-agent run", args, stderr)
	if exit >= 0 {
		return exit
	}
	defer log.Sync() //nolint:errcheck // nothing useful to do when stderr is gone

	if err := opts.applyProfileDefaults(); err != nil {
		log.Error("invalid configuration", zap.Error(err))
		return 2
	}
	opts.placed = &cniPlaced{}
	cfg, err := agentConfig(opts, log)
	if err != nil {
		log.Error("invalid configuration", zap.Error(err))
		return 2
	}
	if err := checkZDSServiceAccounts(opts); err != nil {
		log.Error("invalid configuration", zap.Error(err))
		return 2
	}
	if err := checkKNIChain(opts); err != nil {
		log.Error("invalid configuration", zap.Error(err))
		return 2
	}
	if cfg.StartupTaint, err = opts.enroll.startupTaintConfig(log); err != nil {
		log.Error("invalid configuration", zap.Error(err))
		return 2
	}
	if cfg.Policy, err = opts.enroll.policy(ctx, log); err != nil {
		log.Error("invalid configuration", zap.Error(err))
		return 2
	}
	stopped := make(chan struct{})
	var verdict <-chan removal.Verdict
	if w := opts.removalWatcher(log); w != nil {
		// The watch outlives the signal: the check it serves runs after it.
		wctx, stopWatch := context.WithCancel(context.WithoutCancel(ctx))
		defer stopWatch()
		go w.Run(wctx)
		verdict = checkOnStop(ctx, w.Check, stopped)
	}
	err = agent.Run(ctx, log, cfg)
	close(stopped)
	if err != nil {
		log.Error("agent failed", zap.Error(err))
		return 1
	}
	if verdict != nil && ctx.Err() != nil {
		if err := removeIfDaemonSetGone(ctx, opts, log, verdict); err != nil {
			log.Error("the DaemonSet is being removed but this node was not uninstalled: run the uninstall Job here", zap.Error(err))
			return 1
		}
	}
	return 0
}

// checkKNIChain refuses the KNI interposer next to the CNI chain entry. A KNI
// network runtime such as libkni, the reference one, runs the node's CNI
// configuration itself, chain entry included: every pod would then pass the
// gate twice, once as a CNI attachment and once as a KNI one, two records of
// one network namespace that each entry point releases on its own. On a KNI
// node the interposer is the gate, so the entry must not be installed.
func checkKNIChain(opts options) error {
	if opts.entry.kniSocket == "" || !opts.cniInstall {
		return nil
	}
	return fmt.Errorf("--kni-socket=%s admits pods through the KNI interposer, and a KNI network runtime such as libkni runs the node's CNI chain too, where --cni-install would put mesh-cni: each pod would pass the gate twice; pass --cni-install=false (and remove an entry an earlier install left with `mesh-agent uninstall --datapath=none` while the agent is stopped)",
		opts.entry.kniSocket)
}

// checkZDSServiceAccounts refuses a ZDS server whose pods would reach the node
// proxy without a service account. ztunnel acks such a pod and then cannot
// serve it: it looks the workload up by name, namespace and service account
// and fetches the certificate of spiffe://<trust domain>/ns/<ns>/sa/<sa>.
// Only the Kubernetes source reads spec.serviceAccountName; a CNI request
// never carries it and a policy file cannot know it.
func checkZDSServiceAccounts(opts options) error {
	if opts.zdsSocket == "" || opts.enroll.mode == EnrollmentKubernetes || opts.zdsNoServiceAcct {
		return nil
	}
	return fmt.Errorf("--zds-socket=%s serves a node proxy such as ztunnel, which needs each pod's service account, and --enrollment=%s cannot know it (only --enrollment=kubernetes reads spec.serviceAccountName): use --enrollment=kubernetes, turn ZDS off with --zds-socket=, or pass --zds-without-service-accounts for a node proxy that does not use service accounts",
		opts.zdsSocket, opts.enroll.mode)
}

func agentConfig(opts options, log *zap.Logger) (agent.Config, error) {
	if opts.reconcileInterval <= 0 {
		// It paces the reconcile pass and the adoption of running pods,
		// which would otherwise run back to back against the API server.
		return agent.Config{}, fmt.Errorf("--reconcile-interval=%s: want a positive duration (default 30s)", opts.reconcileInterval)
	}
	cfg := agent.Config{
		SocketPath:        opts.socketPath,
		StateDir:          opts.stateDir,
		AllowedUIDs:       opts.allowedUIDs,
		ShutdownGrace:     opts.shutdownGrace,
		ReconcileInterval: opts.reconcileInterval,
		MetricsAddr:       opts.metricsAddr,
		ZDSSocket:         opts.zdsSocket,
		ZDSWait:           agent.WaitMode(opts.zdsWait),
		ZDSAllowedUIDs:    opts.zdsAllowedUIDs,
		DatapathName:      opts.datapath,
	}
	// The plugin refuses a longer gateTimeout, so an entry with one would fail
	// every ADD on the node.
	if opts.gateTimeout <= 0 || opts.gateTimeout > cniplugin.MaxGateTimeout {
		return cfg, fmt.Errorf("--gate-timeout %s: want more than 0 and at most %s", opts.gateTimeout, cniplugin.MaxGateTimeout)
	}
	switch opts.datapath {
	case "none":
		cfg.OpenDatapath = func(context.Context) (agent.Datapath, func() error, error) {
			log.Warn("running without a data path: pods are recorded but their traffic is NOT redirected")
			return agent.RecordOnly{}, func() error { return nil }, nil
		}
	case "ebpf":
		settings, err := opts.redirectSettings()
		if err != nil {
			return cfg, err
		}
		for _, p := range opts.kubeletExes {
			if !filepath.IsAbs(p) {
				return cfg, fmt.Errorf("--kubelet-exe %q: want an absolute path on the host", p)
			}
		}
		if len(opts.kubeletExes) > 0 && !opts.probeCgroups.kubelet {
			return cfg, errors.New("--kubelet-exe needs --probe-cgroups=kubelet: it names the executable the kubelet is found by")
		}
		cg, err := cgroupRoot(opts.cgroupRoot)
		if err != nil {
			return cfg, err
		}
		if cg != opts.cgroupRoot {
			log.Info("hybrid cgroups: attaching to the cgroup v2 hierarchy inside --cgroup-root", zap.String("cgroupRoot", cg))
		}
		rcfg := redirect.Config{PinRoot: opts.bpffsRoot, CgroupRoot: cg, PacketSockets: opts.denyPacketSockets,
			Logger: log.Named("datapath")}
		// Where sidecar containers' cgroups are: Istio's sidecar is known by
		// its container's.
		podCgroups, err := opts.podCgroupLayout()
		if err != nil {
			return cfg, err
		}
		cfg.OpenDatapath = func(ctx context.Context) (agent.Datapath, func() error, error) {
			dp, err := redirect.Open(ctx, rcfg)
			if err != nil {
				return nil, nil, err
			}
			rd := agent.RedirectDatapath{DP: dp, Settings: settings, ProxyCgroups: opts.proxyCgroups, PodCgroups: podCgroups}
			// With ZDS, the node proxy's cgroup pinned by the agent before
			// this one stays until the proxy connects here (which replaces
			// the list): its own connections in the pods must not loop back
			// to it meanwhile.
			set := rd.SetProxyProcesses
			if opts.zdsSocket != "" {
				set = func([]int32) error { return dp.KeepProxyCgroups(opts.proxyCgroups) }
			}
			if err := set(nil); err != nil {
				dp.Close()
				return nil, nil, fmt.Errorf("--proxy-cgroups: %w", err)
			}
			if !opts.probeCgroups.kubelet {
				if err := dp.SetProbeCgroups(0, opts.probeCgroups.paths); err != nil {
					dp.Close()
					return nil, nil, fmt.Errorf("--probe-cgroups: %w", err)
				}
				return rd, dp.Close, nil
			}
			// The kubelet's probes: its cgroup, kept current (a kubelet
			// restarted into another cgroup, or into its own made again, is
			// followed).
			stopWatch := agent.ProbeWatch{
				Log: log.Named("probes"), Datapath: dp, ProcRoot: "/proc",
				Names: agent.KubeletProcessNames(), Exes: opts.kubeletExes, ExeNames: agent.KubeletExeNames(),
				Interval: opts.reconcileInterval,
			}.Start(ctx)
			return rd, func() error {
				stopWatch()
				return dp.Close()
			}, nil
		}
	default:
		return cfg, fmt.Errorf("--datapath=%q: want ebpf or none", opts.datapath)
	}
	eps, err := opts.entryPoints(log)
	if err != nil {
		return cfg, err
	}
	cfg.EntryPoints = eps
	if opts.adoptRunning {
		find, err := opts.sandboxFinder(log.Named("adopt"))
		if err != nil {
			return cfg, err
		}
		cfg.Adopt = &agent.AdoptConfig{Find: find, ExcludeNamespaces: opts.excludeNamespaces}
		if opts.enroll.profile == enroll.ProfileIstio {
			cfg.Adopt.Takeover = istioCNITakeover()
		}
	}
	if opts.cniInstall {
		inst, err := newCNIInstaller(opts, log)
		if err != nil {
			return cfg, err
		}
		cfg.InstallCNIConfig = inst
	}
	return cfg, nil
}

// pluginBinaryPath is the mesh-cni binary the agent installs.
func (o options) pluginBinaryPath() (string, error) {
	if o.pluginBinary != "" {
		return o.pluginBinary, nil
	}
	self, err := os.Executable()
	if err != nil {
		return "", fmt.Errorf("locate mesh-agent binary to find mesh-cni next to it: %w", err)
	}
	return filepath.Join(filepath.Dir(self), "mesh-cni"), nil
}

// Log formats of --log-format.
const (
	LogFormatJSON    = "json"
	LogFormatConsole = "console"
)

// newLogger builds the agent's logger: level and format as --log-level and
// --log-format name them.
func newLogger(level, format string, w io.Writer) (*zap.Logger, error) {
	lvl, err := zapcore.ParseLevel(level)
	if err != nil {
		return nil, fmt.Errorf("--log-level: %w", err)
	}
	enc := zap.NewProductionEncoderConfig()
	enc.EncodeTime = zapcore.ISO8601TimeEncoder
	var encoder zapcore.Encoder
	switch format {
	case LogFormatJSON:
		encoder = zapcore.NewJSONEncoder(enc)
	case LogFormatConsole:
		enc.EncodeLevel = zapcore.CapitalLevelEncoder
		encoder = zapcore.NewConsoleEncoder(enc)
	default:
		return nil, fmt.Errorf("--log-format %q: want %s or %s", format, LogFormatJSON, LogFormatConsole)
	}
	return zap.New(zapcore.NewCore(encoder, zapcore.AddSync(w), lvl)), nil
}

// mountBPFFSCommand is `mesh-agent mount-bpffs`: the one step that needs a
// privileged container, done before the agent starts without privileges.
func mountBPFFSCommand(args []string, stderr io.Writer) int {
	if len(args) > 0 {
		fmt.Fprintf(stderr, "mesh-agent mount-bpffs: unexpected arguments %q\n", args)
		return 2
	}
	log, err := newLogger("info", LogFormatJSON, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "mesh-agent: %v\n", err)
		return 1
	}
	if err := redirect.MountSharedBPFFS(log); err != nil {
		log.Error("mount bpffs", zap.Error(err))
		return 1
	}
	return 0
}
