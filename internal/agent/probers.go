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
// binaries that run it in-process (k3s, MicroK8s' kubelite), that make a
// process a candidate when the probe cgroups are the kubelet's.
func KubeletProcessNames() []string {
	return []string{"kubelet", "k3s-server", "k3s-agent", "kubelite"}
}

// KubeletExeNames are the file names of those binaries' executables: k3s runs
// as k3s-server or k3s-agent through links to its one binary, k3s.
func KubeletExeNames() []string {
	return []string{"kubelet", "k3s", "k3s-server", "k3s-agent", "kubelite"}
}

// ProbeCgroupSetter is a data path that lets the connections of the processes in
// some cgroups, made in one network namespace, into pods past their inbound
// capture: the kubelet's probes.
type ProbeCgroupSetter interface {
	SetProbeCgroups(netns uint64, cgroups []string) error
	ProcessCgroup(pid int) (string, error)
	// CgroupID is the id the data path holds for a cgroup path: a cgroup
	// removed and made again at the same path has a new one.
	CgroupID(path string) (uint64, error)
}

// ProbeWatch keeps the data path's probe cgroups on the kubelet's: its cgroup and
// network namespace, read from its process (the agent runs with the host's PID
// namespace), and looked up again every interval in case the kubelet restarted,
// elsewhere or into a cgroup made again at the same path. The kubelet is the
// process that hostproc.KubeletFinder takes for it: named like it, with the
// host's root directory and network namespace, a cgroup outside the pods' and
// the kubelet's executable, so no pod can pass for it by naming a process
// kubelet. Until it is found, probes are captured like any other connection
// (and fail closed while the proxy is down), so the watch says so.
type ProbeWatch struct {
	Log      *zap.Logger
	Datapath ProbeCgroupSetter
	// ProcRoot is the host's procfs (/proc).
	ProcRoot string
	Names    []string
	// Exes are the kubelet's executables as host paths; empty: any file
	// named one of ExeNames.
	Exes     []string
	ExeNames []string
	Interval time.Duration
}

// Start sets the probe cgroups once and then keeps them current until ctx ends or
// stop is called.
func (w ProbeWatch) Start(ctx context.Context) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	finder := hostproc.KubeletFinder{Proc: hostproc.Procfs{Root: w.ProcRoot}, Names: w.Names, Exes: w.Exes, ExeNames: w.ExeNames}
	var last string
	// Each refused process is logged once (pid and start time: pids are
	// reused), while it runs.
	warned := map[[2]uint64]bool{}
	logRefused := func(refused []hostproc.Refusal) {
		seen := map[[2]uint64]bool{}
		for _, r := range refused {
			k := [2]uint64{uint64(r.PID), r.StartTime}
			seen[k] = true
			if !warned[k] {
				w.Log.Warn("a process named like the kubelet is not taken for it: its connections get no probe exemption", zap.Int("pid", r.PID), zap.String("name", r.Comm), zap.String("check", string(r.Check)), zap.Error(r.Err))
			}
		}
		warned = seen
	}
	apply := func() {
		k, refused, err := finder.Find()
		logRefused(refused)
		if err != nil {
			if last != "missing" {
				w.Log.Warn("kubelet not found: its probes are captured like any connection until it is", zap.Strings("names", w.Names), zap.Error(err))
				last = "missing"
			}
			return
		}
		pid := k.PID
		cg, err := w.Datapath.ProcessCgroup(pid)
		if err != nil {
			w.Log.Warn("kubelet's cgroup", zap.Int("pid", pid), zap.Error(err))
			return
		}
		// The finder read the cgroup in the agent's cgroup namespace; this is
		// the path the data path would hold, read in the host's.
		// (A process of another container of the agent's own pod reads as
		// outside the pods there: the pod's level is above the namespace.)
		if hostproc.InPodCgroup(cg) {
			if last != "pod "+cg {
				w.Log.Warn("the kubelet's cgroup is a pod's: no probe exemption", zap.Int("pid", pid), zap.String("cgroup", cg))
				last = "pod " + cg
			}
			return
		}
		id, err := w.Datapath.CgroupID(cg)
		if err != nil {
			w.Log.Warn("kubelet's cgroup", zap.Int("pid", pid), zap.String("cgroup", cg), zap.Error(err))
			return
		}
		cookie, err := netns.Cookie(filepath.Join(w.ProcRoot, strconv.Itoa(pid), "ns", "net"))
		if err != nil {
			w.Log.Warn("kubelet's network namespace", zap.Int("pid", pid), zap.Error(err))
			return
		}
		// The kubelet may have exited since the finder checked it, and its
		// pid gone to another process: what was read is the kubelet's only
		// if the process still has the start time the finder saw.
		if st, err := finder.Proc.Stat(pid); err != nil || st.StartTime != k.StartTime {
			return
		}
		// By the cgroup's id too, as the data path holds it: a kubelet
		// restarted into its cgroup made again at the same path needs the
		// new id set.
		key := fmt.Sprintf("%s %d %d", cg, id, cookie)
		if key == last {
			return
		}
		if err := w.Datapath.SetProbeCgroups(cookie, []string{cg}); err != nil {
			w.Log.Error("kubelet's probes cannot be told apart: they are captured like any connection", zap.Int("pid", pid), zap.String("cgroup", cg), zap.Error(err))
			last = key
			return
		}
		w.Log.Info("kubelet probes pass inbound capture by their socket", zap.Int("pid", pid), zap.String("exe", k.Exe), zap.String("cgroup", cg), zap.Uint64("cgroupID", id), zap.Uint64("netnsCookie", cookie))
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
