package agentcli

import (
	"context"
	"fmt"
	"io"
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

// newCNIInstaller installs the plugin binary and returns the function that keeps
// the chain entry in place for the agent's life.
func newCNIInstaller(opts options, log *zap.Logger) (agent.CNIConfigInstaller, error) {
	bin, err := opts.pluginBinaryPath()
	if err != nil {
		return nil, err
	}
	log = log.Named("cni-install")
	return func(ctx context.Context, report func(agent.CNIStatus)) error {
		if opts.runtimeCNICheck {
			if err := waitRuntimeServes(ctx, log, opts, report); err != nil {
				return nil // stopping
			}
		}
		changed, err := cniinstall.InstallBinary(ctx, bin, opts.cniBinDirs)
		if err != nil {
			report(agent.CNIStatus{Reason: "plugin binary not installed: " + err.Error()})
			return fmt.Errorf("install plugin binary %s: %w", bin, err)
		}
		log.Info("plugin binary in place", zap.Strings("dirs", opts.cniBinDirs), zap.Bool("replaced", changed))
		report(agent.CNIStatus{Reason: "chain entry not installed yet"})
		in, err := cniinstall.New(opts.installerConfig(log, func(st cniinstall.Status) {
			reason := st.Reason
			if reason == "" && !st.Ready {
				reason = "chain entry missing"
			}
			report(agent.CNIStatus{InPlace: st.Ready, Reason: reason, Mode: st.Mode.String(), Primary: st.Primary, File: st.File, Network: st.Network, Repairs: st.Repairs})
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
	// A running agent keeps its chain entry in place and would write it back
	// at once, leaving new pods waiting for an agent that is about to go.
	if running, err := agentListening(opts.socketPath); err != nil {
		log.Error("cannot tell whether mesh-agent still runs on this node", zap.Error(err))
		return 1
	} else if running {
		log.Error("mesh-agent is still running on this node and would put the chain entry back: stop it first (delete its DaemonSet), then uninstall",
			zap.String("socket", opts.socketPath))
		return 1
	}
	failed := false
	if opts.cniInstall {
		in, err := cniinstall.New(opts.installerConfig(log.Named("cni-install"), nil))
		if err == nil {
			err = in.Remove(ctx)
		}
		if err != nil {
			log.Error("removing the chain entry failed", zap.Error(err))
			failed = true
		}
		if err := cniinstall.RemoveBinary(opts.cniBinDirs, "mesh-cni"); err != nil {
			log.Error("removing the plugin binary failed", zap.Error(err))
			failed = true
		}
	}
	if opts.datapath == "ebpf" {
		cg, err := cgroupRoot(opts.cgroupRoot)
		if err == nil {
			err = redirect.Uninstall(ctx, redirect.Config{PinRoot: opts.bpffsRoot, CgroupRoot: cg, Logger: log.Named("datapath")})
		}
		if err != nil {
			log.Error("removing the data path failed", zap.Error(err))
			failed = true
		}
	}
	if failed {
		return 1
	}
	log.Info("mesh-cni uninstalled from this node")
	return 0
}

// waitRuntimeServes holds the installation (and so the agent's readiness)
// until the node's container runtime loads CNI from the agent's directories,
// checking again every reconcile interval: installed where the runtime never
// looks, the chain entry would leave every new pod unmeshed while the agent
// reported ready. A runtime it cannot find or read is logged and not waited
// for. It returns ctx's error when stopped while waiting.
func waitRuntimeServes(ctx context.Context, log *zap.Logger, opts options, report func(agent.CNIStatus)) error {
	last := ""
	for {
		runtimes, err := runtimecni.FindAll(hostproc.Procfs{Root: "/proc"})
		if len(runtimes) == 0 {
			log.Warn("the container runtime's CNI directories are unknown; installing where told", zap.Error(err))
			return nil
		}
		if err != nil {
			log.Warn("a container runtime's CNI directories could not be read", zap.Error(err))
		}
		why := runtimecni.Serves(runtimes, opts.cniBinDirs, opts.cniConfDir)
		if why == "" {
			log.Info("the container runtime loads CNI from the agent's directories", zap.String("runtime", runtimes[0].String()))
			return nil
		}
		if why != last {
			log.Error("chain entry not installed: the container runtime loads CNI elsewhere", zap.String("reason", why))
			last = why
		}
		report(agent.CNIStatus{Reason: why})
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(opts.reconcileInterval):
		}
	}
}
