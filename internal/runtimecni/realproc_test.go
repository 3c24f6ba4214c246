package runtimecni

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/internal/hostproc"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// fakeRuntime writes a containerd config naming binDir and confDir, and a
// script named containerd (a shell running a script keeps its name as the
// process's), and returns the script and the config.
func fakeRuntime(t *testing.T, binDir, confDir string) (exe, config string) {
	t.Helper()
	dir := t.TempDir()
	config = filepath.Join(dir, "config.toml")
	toml := fmt.Sprintf("version = 3\n[plugins.'io.containerd.cri.v1.runtime'.cni]\n  bin_dirs = [%q]\n  conf_dir = %q\n", binDir, confDir)
	if err := os.WriteFile(config, []byte(toml), 0o644); err != nil {
		t.Fatal(err)
	}
	exe = filepath.Join(dir, "containerd")
	if err := os.WriteFile(exe, []byte("#!/bin/sh\nsleep 1000\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	return exe, config
}

// waitExeced waits until pid runs the stand-in containerd with config on its
// command line. Its name alone is not enough: exec sets the name before the
// new command line, and a read in between sees a containerd with no flags.
func waitExeced(t *testing.T, what string, pid int, config string) {
	t.Helper()
	fixtures.WaitFor(t, 10*time.Second, what+" named containerd", func() bool {
		comm, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "comm"))
		if err != nil || strings.TrimSpace(string(comm)) != "containerd" {
			return false
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "cmdline"))
		return err == nil && slices.Contains(strings.Split(string(cmdline), "\x00"), config)
	})
}

// On the real kernel: processes named containerd in a pod's network
// namespace and in a pod's cgroup, their configs naming directories of their
// choice, are refused; the host's containerd decides, and the agent reaches
// its directories through the host's root. A containerd in a mount namespace
// of its own, where its conf dir is another directory than the host's, keeps
// the agent not ready rather than have it write where that runtime never
// reads.
func TestDecideRealProcesses(t *testing.T) {
	fixtures.RequireRoot(t, "makes cgroups, network and mount namespaces")
	base := harness.NewCgroup(t, "runtime-id")
	pod := harness.MkCgroup(t, filepath.Join(harness.MkCgroup(t, filepath.Join(harness.MkCgroup(t, filepath.Join(base, "kubepods.slice")), "kubepods-besteffort.slice")),
		"kubepods-besteffort-pod0f1e2d3c_aaaa_bbbb_cccc_123456789abc.slice"))
	service := harness.MkCgroup(t, filepath.Join(base, "containerd.service"))
	podNetns := fixtures.NewNetns(t, filepath.Join(t.TempDir(), "pod")).Path

	dirs := func() (bin, conf string) {
		d := t.TempDir()
		bin, conf = filepath.Join(d, "bin"), filepath.Join(d, "net.d")
		for _, p := range []string{bin, conf} {
			if err := os.Mkdir(p, 0o755); err != nil {
				t.Fatal(err)
			}
		}
		return bin, conf
	}
	start := func(name, cgroup, netnsPath string, path string, args ...string) int {
		t.Helper()
		p := harness.StartProcess(t, harness.ProcessOptions{Name: name, Path: path, Args: args,
			Cgroup: harness.MkCgroup(t, filepath.Join(cgroup, name+".scope")), NetNSPath: netnsPath})
		waitExeced(t, name, p.Pid(), args[len(args)-1])
		return p.Pid()
	}
	evilBin, evilConf := dirs()
	evil, evilConfig := fakeRuntime(t, evilBin, evilConf)
	attackers := map[int]hostproc.Check{
		start("pod-netns", service, podNetns, evil, "-c", evilConfig): hostproc.CheckNetNS,
		start("pod-cgroup", pod, "", evil, "-c", evilConfig):          hostproc.CheckCgroup,
	}
	bin, conf := dirs()
	exe, config := fakeRuntime(t, bin, conf)
	genuine := start("host", service, "", exe, "-c", config)

	pids := []int{genuine}
	for pid := range attackers {
		pids = append(pids, pid)
	}
	slices.Sort(pids)
	// The test's own process stands in for the host's init (this machine's
	// may be out of the test's reach; harness.ProcView).
	proc := hostproc.Procfs{Root: harness.ProcView(t, os.Getpid(), pids...)}
	p, err := Decide(proc, Want{BinDirs: []string{"/nonexistent/bin"}, ConfDir: "/nonexistent/net.d"})
	if err != nil || p.Runtime == nil || p.Runtime.PID != genuine {
		t.Fatalf("Decide: %s, %v; want the host's containerd, pid %d", p, err, genuine)
	}
	host := filepath.Join(proc.Root, "1", "root")
	if p.ConfDir != filepath.Join(host, conf) || !slices.Equal(p.BinDirs, []string{filepath.Join(host, bin)}) || p.Conf != ViaHostRoot || p.Bin != ViaHostRoot {
		t.Errorf("Decide: %s; want %s and %s through %s", p, bin, conf, host)
	}
	got := map[int]hostproc.Check{}
	for _, r := range p.Refused {
		got[r.PID] = r.Check
	}
	for pid, check := range attackers {
		if got[pid] != check {
			t.Errorf("pid %d: refused by %q, want %q (%v)", pid, got[pid], check, p.Refused)
		}
	}
	// What the agent writes there is in the runtime's directory.
	if err := os.WriteFile(filepath.Join(p.ConfDir, "probe"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(conf, "probe")); err != nil {
		t.Errorf("a file written to %s is not in the runtime's %s: %v", p.ConfDir, conf, err)
	}

	// The same runtime, in a mount namespace where its conf dir is a tmpfs
	// of its own: the host's directory of that name is not the one it reads.
	private := harness.StartProcess(t, harness.ProcessOptions{Name: "private-mounts", Path: "unshare",
		Args:   []string{"--mount", "--propagation", "private", "--", "sh", "-ec", fmt.Sprintf("mount -t tmpfs tmpfs %s\nexec %s -c %s", conf, exe, config)},
		Cgroup: harness.MkCgroup(t, filepath.Join(service, "private.scope"))})
	waitExeced(t, "the private containerd", private.Pid(), config)
	proc = hostproc.Procfs{Root: harness.ProcView(t, os.Getpid(), private.Pid())}
	if p, err := Decide(proc, Want{BinDirs: []string{"/nonexistent/bin"}, ConfDir: "/nonexistent/net.d"}); err == nil || !strings.Contains(err.Error(), "mount namespace of its own") {
		t.Errorf("Decide with the runtime's conf dir another directory than the host's: %s, %v", p, err)
	}
}
