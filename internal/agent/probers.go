package agent

import (
	"context"
	"fmt"
	"path/filepath"
	"strconv"
	"time"

	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/mesh-cni/mesh-cni/internal/hostproc"
	"github.com/mesh-cni/mesh-cni/internal/netns"
)

// KubeletProcessNames are the process names (comm) of the kubelet, or of the
// binaries that run it in-process (k3s, MicroK8s' kubelite), that the agent looks
// for when the probe cgroups are the kubelet's.
func KubeletProcessNames() []string {
	return []string{"kubelet", "k3s-server", "k3s-agent", "kubelite"}
}

// ProbeCgroupSetter is a data path that lets the connections of the processes in
// some cgroups, made in one network namespace, into pods past their inbound
// capture: the kubelet's probes.
type ProbeCgroupSetter interface {
	SetProbeCgroups(netns uint64, cgroups []string) error
	ProcessCgroup(pid int) (string, error)
}

// ProbeWatch keeps the data path's probe cgroups on the kubelet's: its cgroup and
// network namespace, read from its process, found by name in /proc (the agent runs
// with the host's PID namespace), and looked up again every interval in case the
// kubelet restarted elsewhere. Until it is found, probes are captured like any
// other connection (and fail closed while the proxy is down), so the watch says so.
type ProbeWatch struct {
	Log      *zap.Logger
	Datapath ProbeCgroupSetter
	// ProcRoot is the host's procfs (/proc).
	ProcRoot string
	Names    []string
	Interval time.Duration
}

// Start sets the probe cgroups once and then keeps them current until ctx ends or
// stop is called.
func (w ProbeWatch) Start(ctx context.Context) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	var last string
	apply := func() {
		pid, err := hostproc.Procfs{Root: w.ProcRoot}.FindByName(w.Names)
		if err != nil {
			if last != "missing" {
				w.Log.Warn("kubelet not found: its probes are captured like any connection until it is", zap.Strings("names", w.Names), zap.Error(err))
				last = "missing"
			}
			return
		}
		cg, err := w.Datapath.ProcessCgroup(pid)
		if err != nil {
			w.Log.Warn("kubelet's cgroup", zap.Int("pid", pid), zap.Error(err))
			return
		}
		cookie, err := netns.Cookie(filepath.Join(w.ProcRoot, strconv.Itoa(pid), "ns", "net"))
		if err != nil {
			w.Log.Warn("kubelet's network namespace", zap.Int("pid", pid), zap.Error(err))
			return
		}
		key := fmt.Sprintf("%s %d", cg, cookie)
		if key == last {
			return
		}
		if err := w.Datapath.SetProbeCgroups(cookie, []string{cg}); err != nil {
			w.Log.Error("kubelet's probes cannot be told apart: they are captured like any connection", zap.Int("pid", pid), zap.String("cgroup", cg), zap.Error(err))
			last = key
			return
		}
		w.Log.Info("kubelet probes pass inbound capture by their socket", zap.Int("pid", pid), zap.String("cgroup", cg), zap.Uint64("netnsCookie", cookie))
		last = key
	}
	apply()
	go func() {
		defer close(done)
		// The first call finds nothing changed: apply returns early on the same key.
		wait.UntilWithContext(ctx, func(context.Context) { apply() }, w.Interval)
	}()
	return func() {
		cancel()
		<-done
	}
}
