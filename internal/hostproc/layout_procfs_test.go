package hostproc

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// On a procfs tree, for both drivers and cgroupRoots: a victim pod's own
// process is taken for it; a process in a cgroup named like the victim's
// inside an attacker pod's container, or at the victim's names under another
// prefix, is refused, whether the victim has processes of its own (it is not
// refused for two namespaces) or none (it does not get the attacker's).
func TestSandboxesAtLayout(t *testing.T) {
	for _, l := range []PodCgroupLayout{
		{DriverCgroupfs, "/"}, {DriverSystemd, "/"},
		{DriverCgroupfs, "/mesh-node-1a2b3c"}, {DriverSystemd, "/mesh-node-1a2b3c"},
	} {
		t.Run(l.Driver+l.Root, func(t *testing.T) {
			h := newFakeHost(t)
			netnsDir := filepath.Join(t.TempDir(), "netns")
			ns := func(name string) string { return h.file(filepath.Join(netnsDir, name)) }
			victimNS, attackerNS, evilNS, elsewhereNS := ns("cni-victim"), ns("cni-attacker"), ns("cni-evil"), ns("cni-elsewhere")
			container := func(id string) string {
				if l.Driver == DriverSystemd {
					return "cri-containerd-" + id + ".scope"
				}
				return id
			}
			podDir := func(uid, qos string) string {
				names := []string{kubepodsName}
				if qos != "" {
					names = append(names, qos)
				}
				return l.path(append(names, podPrefix+uid)...)
			}
			victim, lonely, attacker := uid(1), uid(2), uid(3)
			victimCg := podDir(victim, "burstable") + "/" + container(hexID(1))
			attackerCg := podDir(attacker, "besteffort") + "/" + container(hexID(3))
			lonelyCg := podDir(lonely, "") + "/" + container(hexID(2))
			exe := filepath.Join(h.host, "usr/bin/sleep")
			h.file(exe)
			proc := func(pid int, cg, netns string) {
				h.process(pid, "sleep", h.host, netns, "0::"+cg+"\n", exe, uint64(pid))
			}
			proc(10, victimCg, victimNS)
			proc(20, attackerCg, attackerNS)
			// Inside the attacker's container: cgroups named like the
			// victim's and the lonely pod's containers.
			proc(21, attackerCg+"/"+filepath.Base(podDir(victim, "burstable"))+"/"+container(hexID(9)), evilNS)
			proc(22, attackerCg+"/"+filepath.Base(podDir(lonely, ""))+"/"+container(hexID(9)), evilNS)
			// The victim's names under another prefix.
			proc(30, "/elsewhere"+victimCg, elsewhereNS)
			proc(31, "/elsewhere"+lonelyCg, elsewhereNS)
			// A process of the node: nothing to say.
			proc(40, "/system.slice/containerd.service", h.hostNet)

			scan, err := Procfs{Root: h.proc}.Sandboxes(l, netnsDir, []string{victim, lonely, attacker})
			if err != nil {
				t.Fatal(err)
			}
			if sb := scan.Found[victim]; sb.NetnsPath != victimNS || !slices.Equal(sb.PIDs, []int{10}) {
				t.Errorf("victim: %+v (%v); want %s, its own process alone", sb, scan.Problems[victim], victimNS)
			}
			if sb := scan.Found[attacker]; sb.NetnsPath != attackerNS || !slices.Equal(sb.PIDs, []int{20}) {
				t.Errorf("attacker: %+v (%v); want %s, its container's process alone", sb, scan.Problems[attacker], attackerNS)
			}
			if err := scan.Problems[lonely]; !errors.Is(err, ErrNoSandbox) {
				t.Errorf("a pod with no process of its own: %v, found %+v; want ErrNoSandbox", err, scan.Found[lonely])
			}
			var refused []int
			for _, r := range scan.Refused {
				refused = append(refused, r.PID)
			}
			if !slices.Equal(refused, []int{21, 22, 30, 31}) {
				t.Errorf("refused %v (%v); want 21, 22 (below a container's cgroup), 30, 31 (another prefix)", refused, scan.Refused)
			}
		})
	}
}

// Hybrid hierarchies: a process is a pod's only when every cgroup of it that
// looks like a pod's is that container's.
func TestSandboxesHybridCgroups(t *testing.T) {
	l := PodCgroupLayout{DriverCgroupfs, "/"}
	h := newFakeHost(t)
	netnsDir := filepath.Join(t.TempDir(), "netns")
	podNS := h.file(filepath.Join(netnsDir, "cni-pod"))
	exe := h.file(filepath.Join(h.host, "usr/bin/sleep"))
	cg := "/kubepods/besteffort/pod" + uid(1) + "/" + hexID(1)
	h.process(10, "sleep", h.host, podNS, "4:memory:"+cg+"\n2:cpuset:/\n0::"+cg+"\n", exe, 1)
	h.process(11, "sleep", h.host, podNS, "4:memory:"+cg+"\n0::"+cg+"/pod"+uid(2)+"/"+hexID(2)+"\n", exe, 1)
	h.process(12, "sleep", h.host, podNS, "4:memory:"+cg+"\n0::/kubepods/besteffort/pod"+uid(2)+"/"+hexID(2)+"\n", exe, 1)
	scan, err := Procfs{Root: h.proc}.Sandboxes(l, netnsDir, []string{uid(1), uid(2)})
	if err != nil {
		t.Fatal(err)
	}
	if sb := scan.Found[uid(1)]; !slices.Equal(sb.PIDs, []int{10}) {
		t.Errorf("pod 1: %+v (%v); want process 10 alone", sb, scan.Problems[uid(1)])
	}
	if _, ok := scan.Found[uid(2)]; ok || len(scan.Refused) != 2 {
		t.Errorf("pod 2 found %+v, refused %v; want processes 11 and 12 refused", scan.Found[uid(2)], scan.Refused)
	}
}

// The layout as the kubelet resolves it: its defaults, its --config (through
// its root and working directory), the drop-ins of its --config-dir in order,
// then its flags; where it cannot be read, or pods have no cgroups of their
// own, there is none.
func TestKubeletPodCgroupLayout(t *testing.T) {
	type file struct{ path, data string }
	for _, c := range []struct {
		name  string
		exe   string
		args  []string
		cwd   string
		files []file
		want  PodCgroupLayout // zero: an error
	}{
		{name: "defaults", args: []string{"--kubeconfig", "/etc/kubernetes/kubelet.conf"}, want: PodCgroupLayout{DriverCgroupfs, "/"}},
		// As test/node's kubelet runs.
		{name: "config file", args: []string{"--config", "/var/lib/kubelet/config.yaml", "--v=1"},
			files: []file{{"/var/lib/kubelet/config.yaml", "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\ncgroupDriver: cgroupfs\ncgroupRoot: /mesh-node-1a2b3c\n"}},
			want:  PodCgroupLayout{DriverCgroupfs, "/mesh-node-1a2b3c"}},
		{name: "kubeadm systemd", args: []string{"--config=/var/lib/kubelet/config.yaml"},
			files: []file{{"/var/lib/kubelet/config.yaml", "kind: KubeletConfiguration\ncgroupDriver: systemd\n"}},
			want:  PodCgroupLayout{DriverSystemd, "/"}},
		{name: "json, relative to its working directory", args: []string{"--config", "conf/kubelet.json"}, cwd: "/etc/kubernetes",
			files: []file{{"/etc/kubernetes/conf/kubelet.json", `{"kind":"KubeletConfiguration","cgroupDriver":"systemd","cgroupRoot":"/node"}`}},
			want:  PodCgroupLayout{DriverSystemd, "/node"}},
		{name: "keys match exactly", args: []string{"--config", "/k.yaml"},
			files: []file{{"/k.yaml", "CgroupDriver: systemd\ncgroupdriver: systemd\n"}},
			want:  PodCgroupLayout{DriverCgroupfs, "/"}},
		{name: "drop-ins override, flags override all", args: []string{"--config", "/k.yaml", "--config-dir", "/k.d", "--cgroup_root=/flag"},
			files: []file{{"/k.yaml", "cgroupDriver: cgroupfs\ncgroupRoot: /file\n"}, {"/k.d/20-b.conf", "cgroupDriver: systemd\n"}, {"/k.d/10-a.conf", "cgroupDriver: cgroupfs\ncgroupRoot: /dropin\n"}, {"/k.d/30-c.yaml", "cgroupDriver: cgroupfs\n"}},
			want:  PodCgroupLayout{DriverSystemd, "/flag"}},
		{name: "flags alone", args: []string{"--cgroup-driver", "systemd", "--cgroup-root", "/a"}, want: PodCgroupLayout{DriverSystemd, "/a"}},
		{name: "after --", args: []string{"--cgroup-driver=systemd", "--", "--cgroup-driver=cgroupfs"}, want: PodCgroupLayout{DriverSystemd, "/"}},
		{name: "no pod cgroups", args: []string{"--cgroups-per-qos=false"}},
		{name: "no pod cgroups in config", args: []string{"--config", "/k.yaml"}, files: []file{{"/k.yaml", "cgroupsPerQOS: false\n"}}},
		{name: "config missing", args: []string{"--config", "/missing.yaml"}},
		{name: "config unreadable", args: []string{"--config", "/k.yaml"}, files: []file{{"/k.yaml", "cgroupDriver: [systemd\n"}}},
		{name: "unknown driver", args: []string{"--cgroup-driver=sytemd"}},
		{name: "flag without value", args: []string{"--config"}},
		{name: "in-process kubelet", exe: "/usr/local/bin/k3s", args: []string{"server"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := newFakeHost(t)
			exe := c.exe
			if exe == "" {
				exe = "/usr/bin/kubelet"
			}
			h.file(filepath.Join(h.host, exe))
			h.process(500, "kubelet", h.host, h.hostNet, "0::/system.slice/kubelet.service\n", filepath.Join(h.host, exe), 900)
			for _, f := range c.files {
				if err := os.MkdirAll(filepath.Join(h.host, filepath.Dir(f.path)), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(filepath.Join(h.host, f.path), []byte(f.data), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			cmdline := strings.Join(append([]string{exe}, c.args...), "\x00") + "\x00"
			dir := filepath.Join(h.proc, strconv.Itoa(500))
			if err := os.WriteFile(filepath.Join(dir, "cmdline"), []byte(cmdline), 0o644); err != nil {
				t.Fatal(err)
			}
			cwd := c.cwd
			if cwd == "" {
				cwd = "/"
			}
			// The kernel's cwd link reads as the path in the process's root.
			if err := os.Symlink(cwd, filepath.Join(dir, "cwd")); err != nil {
				t.Fatal(err)
			}
			k, _, err := h.finder().Find()
			if err != nil {
				t.Fatal(err)
			}
			got, err := Procfs{Root: h.proc}.PodCgroupLayout(k)
			if c.want == (PodCgroupLayout{}) {
				if err == nil {
					t.Fatalf("layout %s; want an error", got)
				}
				return
			}
			if err != nil || got != c.want {
				t.Fatalf("layout %+v, %v; want %+v", got, err, c.want)
			}
		})
	}
}

// Where the layout is unknown nothing is adopted.
func TestSandboxesNeedALayout(t *testing.T) {
	h := newFakeHost(t)
	_, err := Procfs{Root: h.proc}.Sandboxes(PodCgroupLayout{}, t.TempDir(), []string{uid(1)})
	if !errors.Is(err, ErrNoPodCgroupLayout) {
		t.Fatalf("%v; want ErrNoPodCgroupLayout", err)
	}
}
