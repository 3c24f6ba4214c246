package agentcli

import (
	"context"
	"errors"
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
		in, err := cniinstall.New(opts.installerConfig(log.Named("cni-install"), nil))
		if err == nil {
			err = in.Remove(ctx)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("removing the chain entry: %w", err))
		}
		if err := cniinstall.RemoveBinary(opts.cniBinDirs, "mesh-cni"); err != nil {
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
