package agentcli

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/containernetworking/cni/libcni"
	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/mesh-cni/mesh-cni/internal/cniplugin"
	"github.com/mesh-cni/mesh-cni/internal/gaterpc"
	"github.com/mesh-cni/mesh-cni/internal/redirect"
)

// checkResult is one node check.
type checkResult struct {
	name    string
	problem string // empty when the check passed
}

// checkCommand runs the checks an operator would do by hand and exits 1 with the
// list of what is wrong.
func checkCommand(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	var opts options
	fs := flagSet("mesh-agent check", &opts, stderr)
	if err := fs.Parse(args); err != nil {
		return 2
	}
	opts.markExplicit(fs)
	results := runChecks(ctx, opts)
	failed := 0
	for _, r := range results {
		if r.problem == "" {
			fmt.Fprintf(stdout, "ok    %s\n", r.name)
			continue
		}
		failed++
		fmt.Fprintf(stdout, "FAIL  %s: %s\n", r.name, r.problem)
	}
	if failed > 0 {
		fmt.Fprintf(stdout, "%d of %d checks failed\n", failed, len(results))
		return 1
	}
	fmt.Fprintf(stdout, "all %d checks passed\n", len(results))
	return 0
}

func runChecks(ctx context.Context, opts options) []checkResult {
	var out []checkResult
	add := func(name, problem string) { out = append(out, checkResult{name, problem}) }

	if opts.datapath == "ebpf" {
		cg, err := cgroupRoot(opts.cgroupRoot)
		problem := ""
		if err != nil {
			cg, problem = opts.cgroupRoot, err.Error()
		} else if cg == "" {
			if cg, err = redirect.FindCgroup2(); err != nil {
				problem = err.Error()
			}
		}
		add("cgroup v2 mounted"+suffix(cg), problem)
		add("kernel features (Linux "+redirect.KernelFloor+" or newer)", kernelProblems())

		if ok, err := redirect.IsBPFFS(opts.bpffsRoot); err != nil || !ok {
			add("bpffs at "+opts.bpffsRoot, fmt.Sprintf("not a bpffs (%v)", errOr(err, "wrong filesystem type")))
		} else {
			add("bpffs at "+opts.bpffsRoot, "")
		}

		snap, err := redirect.Inspect(ctx, opts.bpffsRoot)
		if err != nil {
			add("data path programs attached", err.Error())
		} else {
			var bad []string
			for _, h := range snap.Hooks {
				if !h.Attached {
					bad = append(bad, fmt.Sprintf("%s (%s)", h.Name, errOr(nil, h.Problem)))
				}
			}
			add("data path programs attached", strings.Join(bad, ", "))
			var broken, uncaptured []string
			for _, p := range snap.Pods {
				switch {
				case len(p.LegacyLinks) > 0 && !p.Attached:
					broken = append(broken, fmt.Sprintf("netns %d (an earlier version's links: the agent enrolls it again at start)", p.Cookie))
				case !p.Attached:
					broken = append(broken, fmt.Sprintf("netns %d", p.Cookie))
				}
			}
			for _, r := range snap.Refused {
				uncaptured = append(uncaptured, fmt.Sprintf("netns %d port %d (%s): %s, %d times", r.Cookie, r.Port, r.Family, r.Reason, r.Count))
			}
			add("pod inbound capture attached", strings.Join(broken, ", "))
			add("proxy listeners captured", strings.Join(uncaptured, ", "))
		}
	}

	if opts.cniInstall {
		dir, problem := opts.entryConfDir()
		add("CNI directories the container runtime loads from", problem)
		add("chain entry present and last", checkChainEntry(dir, opts.cniConfFile))
	}

	add("gate socket modes", checkSocketModes(opts.socketPath))
	add("agent ready", checkAgentReady(ctx, opts.socketPath))
	return out
}

func suffix(s string) string {
	if s == "" {
		return ""
	}
	return " (" + s + ")"
}

func errOr(err error, fallback string) string {
	if err != nil {
		return err.Error()
	}
	return fallback
}

// checkChainEntry loads the conf dir as kubelet does (the first valid file in
// lexical order, or the configured one) and checks mesh-cni is its last plugin.
func checkChainEntry(dir, explicit string) string {
	return readChainEntry(dir, explicit).Problem
}

// ChainEntry is the mesh-cni entry of the CNI config the runtime uses, as the
// config directory holds it: what status shows when the agent cannot say.
type ChainEntry struct {
	// File is the config the runtime uses (the first valid one, or
	// --cni-conf-file).
	File    string `json:"file,omitempty"`
	InPlace bool   `json:"inPlace"`
	// Problem says why the entry is not in place.
	Problem string `json:"problem,omitempty"`
	// GateTimeout and ExcludeNamespaces are the entry's, as the plugin reads
	// them (its defaults applied).
	GateTimeout       string   `json:"gateTimeout,omitempty"`
	ExcludeNamespaces []string `json:"excludeNamespaces,omitempty"`
}

// readChainEntry finds the config the runtime uses in dir and whether it ends
// with the mesh-cni entry.
func readChainEntry(dir, explicit string) ChainEntry {
	files, err := libcni.ConfFiles(dir, []string{".conf", ".conflist", ".json"})
	if err != nil {
		return ChainEntry{Problem: fmt.Sprintf("read %s: %v", dir, err)}
	}
	slices.Sort(files)
	if explicit != "" {
		files = []string{filepath.Join(dir, explicit)}
	}
	for _, f := range files {
		// Reads .conf and .conflist alike, as runtimes do with libcni 1.3.
		list, err := libcni.NetworkConfFromFile(f)
		if err != nil || list == nil || len(list.Plugins) == 0 {
			continue // kubelet skips invalid files too
		}
		ce := ChainEntry{File: filepath.Base(f)}
		last := list.Plugins[len(list.Plugins)-1]
		if last.Network.Type != "mesh-cni" {
			ce.Problem = fmt.Sprintf("%s (the file the runtime uses) ends with %q, not mesh-cni: new pods start without the mesh", ce.File, last.Network.Type)
			return ce
		}
		for _, p := range list.Plugins[:len(list.Plugins)-1] {
			if p.Network.Type == "mesh-cni" {
				ce.Problem = fmt.Sprintf("%s has mesh-cni more than once", ce.File)
				return ce
			}
		}
		conf, err := cniplugin.ParseEntry(last.Bytes)
		if err != nil {
			// The plugin fails every ADD with this entry.
			ce.Problem = fmt.Sprintf("%s: the mesh-cni entry is invalid: %v", ce.File, err)
			return ce
		}
		ce.InPlace = true
		ce.GateTimeout = time.Duration(conf.GateTimeout).String()
		ce.ExcludeNamespaces = *conf.ExcludeNamespaces
		return ce
	}
	return ChainEntry{Problem: fmt.Sprintf("no valid CNI config in %s", dir)}
}

func checkSocketModes(socket string) string {
	var bad []string
	dir := filepath.Dir(socket)
	if info, err := os.Stat(dir); err != nil {
		bad = append(bad, err.Error())
	} else if info.Mode().Perm() != socketDirMode {
		bad = append(bad, fmt.Sprintf("%s has mode %o, want %o", dir, info.Mode().Perm(), socketDirMode))
	}
	if info, err := os.Lstat(socket); err != nil {
		bad = append(bad, err.Error())
	} else if info.Mode().Type() != os.ModeSocket {
		bad = append(bad, socket+" is not a socket")
	} else if info.Mode().Perm() != socketFileMode {
		bad = append(bad, fmt.Sprintf("%s has mode %o, want %o", socket, info.Mode().Perm(), socketFileMode))
	}
	return strings.Join(bad, "; ")
}

// Modes the gate socket must have (pkg/gate creates them so).
const (
	socketDirMode  = 0o700
	socketFileMode = 0o600
)

func checkAgentReady(ctx context.Context, socket string) string {
	conn, err := gaterpc.Dial(socket)
	if err != nil {
		return err.Error()
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{}, grpc.WaitForReady(false))
	if err != nil {
		return "agent not reachable: " + err.Error()
	}
	if resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		return "agent reports " + resp.GetStatus().String()
	}
	return ""
}

// kernelProblems names every kernel feature the data path needs and this kernel
// lacks, with the release that has it.
func kernelProblems() string {
	var out []string
	for _, err := range redirect.MissingFeatures() {
		out = append(out, err.Error())
	}
	return strings.Join(out, "; ")
}
