package agentcli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/mesh-cni/mesh-cni/internal/agent"
	"github.com/mesh-cni/mesh-cni/internal/cniinstall"
	"github.com/mesh-cni/mesh-cni/internal/hostproc"
	"github.com/mesh-cni/mesh-cni/internal/redirect"
	"github.com/mesh-cni/mesh-cni/internal/runtimecni"
)

// chainEntry is the mesh-cni entry the agent puts in the node's CNI config.
func (o options) chainEntry() map[string]any {
	entry := map[string]any{
		"type":              "mesh-cni",
		"socketPath":        o.socketPath,
		"gateTimeout":       o.gateTimeout.String(),
		"excludeNamespaces": []string(o.excludeNamespaces),
		"logLevel":          o.pluginLogLevel,
	}
	if o.pluginLogFile != "" {
		entry["logFile"] = o.pluginLogFile
	}
	return entry
}

func (o options) installerConfig(log *zap.Logger, onChange func(cniinstall.Status)) cniinstall.Config {
	mode := cniinstall.ModeChain
	if o.ownedConfig {
		mode = cniinstall.ModeOwned
	}
	return cniinstall.Config{
		ConfDir:     o.cniConfDir,
		Entry:       o.chainEntry(),
		Mode:        mode,
		PrimaryFile: o.cniConfFile,
		StateDir:    o.installStateDir,
		Logger:      log,
		OnChange:    onChange,
	}
}

// newCNIInstaller returns the function that decides the CNI directories
// (waiting while they are out of reach), installs the plugin binary there and
// keeps the chain entry in place for the agent's life.
func newCNIInstaller(opts options, log *zap.Logger) (agent.CNIConfigInstaller, error) {
	bin, err := opts.pluginBinaryPath()
	if err != nil {
		return nil, err
	}
	log = log.Named("cni-install")
	return func(ctx context.Context, report func(agent.CNIStatus)) error {
		place, err := waitCNIPlace(ctx, log, opts, report)
		if err != nil {
			return nil // stopping
		}
		opts.placed.set(place)
		opts.cniBinDirs, opts.cniConfDir = place.BinDirs, place.ConfDir
		dirs := place.String()
		changed, err := cniinstall.InstallBinary(ctx, bin, opts.cniBinDirs)
		if err != nil {
			report(agent.CNIStatus{Reason: "plugin binary not installed: " + err.Error(), Dirs: dirs})
			return fmt.Errorf("install plugin binary %s: %w", bin, err)
		}
		log.Info("plugin binary in place", zap.Strings("dirs", opts.cniBinDirs), zap.Bool("replaced", changed))
		report(agent.CNIStatus{Reason: "chain entry not installed yet", Dirs: dirs})
		in, err := cniinstall.New(opts.installerConfig(log, func(st cniinstall.Status) {
			reason := st.Reason
			if reason == "" && !st.Ready {
				reason = "chain entry missing"
			}
			report(agent.CNIStatus{InPlace: st.Ready, Reason: reason, Mode: st.Mode.String(), Primary: st.Primary, File: st.File, Network: st.Network, Repairs: st.Repairs, Dirs: dirs})
		}))
		if err != nil {
			return err
		}
		return in.Run(ctx)
	}, nil
}

// uninstallCommand removes everything the agent put on the node: the chain
// entry (the primary config returns to its original bytes), the owned config,
// the plugin binary, the pinned data path and its cgroup attachments.
func uninstallCommand(ctx context.Context, args []string, stderr io.Writer) int {
	opts, log, exit := parseWithLogger("mesh-agent uninstall", args, stderr)
	if exit >= 0 {
		return exit
	}
	if err := uninstallNode(ctx, opts, log); err != nil {
		log.Error("uninstall failed", zap.Error(err))
		return 1
	}
	log.Info("mesh-cni uninstalled from this node")
	return 0
}

// uninstallNode is the uninstall of `mesh-agent uninstall` and of an agent
// whose DaemonSet is being removed: the chain entry first, so no new pod
// waits for an agent that is going, then the plugin binary, then the data
// path, which releases the running pods (their traffic flows directly again).
// It refuses while an agent serves the gate socket.
func uninstallNode(ctx context.Context, opts options, log *zap.Logger) error {
	// A running agent keeps its chain entry in place and would write it back
	// at once, leaving new pods waiting for an agent that is about to go.
	if running, err := agentListening(opts.socketPath); err != nil {
		return fmt.Errorf("cannot tell whether mesh-agent still runs on this node: %w", err)
	} else if running {
		return fmt.Errorf("mesh-agent is still running on this node (it listens on %s) and would put the chain entry back: stop it first (delete its DaemonSet), then uninstall", opts.socketPath)
	}
	var errs []error
	if opts.cniInstall {
		binDirs, confDirs := opts.uninstallDirs(log.Named("cni-install"))
		log.Info("removing the chain entry and the plugin", zap.Strings("confDirs", confDirs), zap.Strings("binDirs", binDirs))
		for _, dir := range confDirs {
			o := opts
			o.cniConfDir = dir
			in, err := cniinstall.New(o.installerConfig(log.Named("cni-install"), nil))
			if err == nil {
				err = in.Remove(ctx)
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("removing the chain entry from %s: %w", dir, err))
			}
		}
		if err := cniinstall.RemoveBinary(binDirs, "mesh-cni"); err != nil {
			errs = append(errs, fmt.Errorf("removing the plugin binary: %w", err))
		}
	}
	if opts.datapath == "ebpf" {
		cg, err := cgroupRoot(opts.cgroupRoot)
		if err == nil {
			err = redirect.Uninstall(ctx, redirect.Config{PinRoot: opts.bpffsRoot, CgroupRoot: cg, Logger: log.Named("datapath")})
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("removing the data path: %w", err))
		}
	}
	return errors.Join(errs...)
}

// cniWant is what the flags say about the CNI directories.
func (o options) cniWant() runtimecni.Want {
	return runtimecni.Want{BinDirs: o.cniBinDirs, ConfDir: o.cniConfDir,
		ExplicitBin: o.explicit["cni-bin-dir"], ExplicitConf: o.explicit["cni-conf-dir"], Check: o.runtimeCNICheck}
}

// procfs is the host's procfs: the agent runs in the host's PID namespace.
func (o options) procfs() hostproc.Procfs {
	if o.procRoot != "" {
		return hostproc.Procfs{Root: o.procRoot}
	}
	return hostproc.Procfs{Root: "/proc"}
}

// cniPlaced holds where the running agent installed, for the uninstall when
// its DaemonSet is removed: the same directories, whatever the node's
// runtime says by then.
type cniPlaced struct {
	mu    sync.Mutex
	place *runtimecni.Place
}

func (c *cniPlaced) set(p runtimecni.Place) {
	if c == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.place = &p
}

func (c *cniPlaced) get() *runtimecni.Place {
	if c == nil {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.place
}

// waitCNIPlace decides where the agent installs (runtimecni.Decide), and
// holds the installation, so the agent's readiness, while that is out of its
// reach, deciding again every reconcile interval: installed where the runtime
// never looks, the chain entry would leave every new pod unmeshed while the
// agent reported ready. It returns ctx's error when stopped while waiting.
func waitCNIPlace(ctx context.Context, log *zap.Logger, opts options, report func(agent.CNIStatus)) (runtimecni.Place, error) {
	last := ""
	refusals := refusalLog{}
	for {
		p, err := runtimecni.Decide(opts.procfs(), opts.cniWant())
		refusals.log(log, p.Refused)
		if err == nil {
			for _, n := range p.Notes {
				log.Warn(n)
			}
			log.Info("CNI directories decided", zap.Stringer("dirs", p))
			return p, nil
		}
		if why := err.Error(); why != last {
			log.Error("chain entry not installed: the container runtime loads CNI from directories out of the agent's reach", zap.String("reason", why))
			last = why
		}
		report(agent.CNIStatus{Reason: err.Error()})
		select {
		case <-ctx.Done():
			return p, ctx.Err()
		case <-time.After(opts.reconcileInterval):
		}
	}
}

// refusalLog logs each process refused as the container runtime once while
// it runs (by pid and start time: pids are reused).
type refusalLog map[[2]uint64]bool

func (l refusalLog) log(log *zap.Logger, refused []hostproc.Refusal) {
	seen := map[[2]uint64]bool{}
	for _, r := range refused {
		k := [2]uint64{uint64(r.PID), r.StartTime}
		seen[k] = true
		if !l[k] {
			log.Info("a process named like the container runtime is not taken for it: where it loads CNI from is not read", zap.Int("pid", r.PID), zap.String("name", r.Comm), zap.String("check", string(r.Check)), zap.Error(r.Err))
		}
	}
	clear(l)
	maps.Copy(l, seen)
}

// uninstallDirs are the CNI directories an uninstall removes the plugin and
// the entry from: where this agent installed, or where an agent with these
// flags would (Decide), and the flags' own directories too, where an earlier
// agent that did not look for the runtime may have installed.
func (o options) uninstallDirs(log *zap.Logger) (binDirs, confDirs []string) {
	binDirs, confDirs = slices.Clone(o.cniBinDirs), []string{o.cniConfDir}
	p := o.placed.get()
	if p == nil {
		d, err := runtimecni.Decide(o.procfs(), o.cniWant())
		if err != nil {
			log.Warn("removing from the flags' CNI directories only: the runtime's are out of reach", zap.Error(err))
			return binDirs, confDirs
		}
		p = &d
	}
	// The decided directories first: the install record is theirs.
	binDirs = append(slices.Clone(p.BinDirs), binDirs...)
	confDirs = append([]string{p.ConfDir}, confDirs...)
	return uniqueDirs(binDirs), uniqueDirs(confDirs)
}

// entryConfDir is where the agent keeps its chain entry, as an agent with
// these flags decides it (a command beside the agent reads it there), and,
// when that is out of reach, the flag's directory and why.
func (o options) entryConfDir() (dir, problem string) {
	p, err := runtimecni.Decide(o.procfs(), o.cniWant())
	if err != nil {
		return o.cniConfDir, err.Error()
	}
	return p.ConfDir, ""
}

// uniqueDirs drops the directories that are an earlier one (the same
// directory, whatever the path) and those that do not exist.
func uniqueDirs(dirs []string) []string {
	var out []string
	var seen []os.FileInfo
	for _, d := range dirs {
		fi, err := os.Stat(d)
		if err != nil || slices.ContainsFunc(seen, func(s os.FileInfo) bool { return os.SameFile(s, fi) }) {
			continue
		}
		seen = append(seen, fi)
		out = append(out, d)
	}
	return out
}
