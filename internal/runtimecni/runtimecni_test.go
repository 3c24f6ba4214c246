package runtimecni

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/mesh-cni/mesh-cni/internal/hostproc"
	"github.com/mesh-cni/mesh-cni/internal/hostproc/hostproctest"
)

// fakeProc is a node with one runtime process, pid 4242, of the host's own,
// and files in the host's root.
func fakeProc(t *testing.T, comm string, args []string, files map[string]string) hostproc.Procfs {
	t.Helper()
	n := hostproctest.New(t)
	n.Files(n.Root, files)
	n.Process(4242, comm, args, n.Root, n.Netns, n.HostCgroup)
	return n.Procfs()
}

func TestFind(t *testing.T) {
	for _, c := range []struct {
		name    string
		comm    string
		args    []string
		files   map[string]string
		bins    []string
		conf    string
		configs []string
	}{
		{
			name: "containerd 2, kubeadm layout",
			comm: "containerd", args: []string{"/usr/bin/containerd"},
			files: map[string]string{"/etc/containerd/config.toml": "version = 3\n[plugins.'io.containerd.cri.v1.runtime'.cni]\n  bin_dirs = ['/opt/cni/bin']\n  conf_dir = '/etc/cni/net.d'\n"},
			bins:  []string{"/opt/cni/bin"}, conf: "/etc/cni/net.d", configs: []string{"/etc/containerd/config.toml"},
		},
		{
			name: "containerd 1.x, GKE layout",
			comm: "containerd", args: []string{"/usr/bin/containerd"},
			files: map[string]string{"/etc/containerd/config.toml": "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".cni]\n  bin_dir = \"/home/kubernetes/bin\"\n  conf_dir = \"/etc/cni/net.d\"\n"},
			bins:  []string{"/home/kubernetes/bin"}, conf: "/etc/cni/net.d", configs: []string{"/etc/containerd/config.toml"},
		},
		{
			name: "k3s' embedded containerd",
			comm: "containerd", args: []string{"containerd", "-c", "/var/lib/rancher/k3s/agent/etc/containerd/config.toml", "-a", "/run/k3s/containerd/containerd.sock"},
			files: map[string]string{"/var/lib/rancher/k3s/agent/etc/containerd/config.toml": "version = 3\n[plugins.'io.containerd.cri.v1.runtime'.cni]\n  bin_dir = \"/var/lib/rancher/k3s/data/cni\"\n  conf_dir = \"/var/lib/rancher/k3s/agent/etc/cni/net.d\"\n"},
			bins:  []string{"/var/lib/rancher/k3s/data/cni"}, conf: "/var/lib/rancher/k3s/agent/etc/cni/net.d", configs: []string{"/var/lib/rancher/k3s/agent/etc/containerd/config.toml"},
		},
		{
			name: "containerd with no config file",
			comm: "containerd", args: []string{"containerd"},
			bins: []string{"/opt/cni/bin"}, conf: "/etc/cni/net.d", configs: []string{"/etc/containerd/config.toml (absent: defaults)"},
		},
		{
			name: "containerd imports, merged in order",
			comm: "containerd", args: []string{"containerd", "--config=/etc/containerd/config.toml"},
			files: map[string]string{
				"/etc/containerd/config.toml":        "version = 3\nimports = ['conf.d/*.toml']\n[plugins.'io.containerd.cri.v1.runtime'.cni]\n  conf_dir = '/etc/cni/net.d'\n",
				"/etc/containerd/conf.d/10-cni.toml": "version = 3\n[plugins.'io.containerd.cri.v1.runtime'.cni]\n  bin_dirs = ['/opt/a']\n",
				"/etc/containerd/conf.d/20-cni.toml": "version = 3\n[plugins.'io.containerd.cri.v1.runtime'.cni]\n  conf_dir = '/etc/b'\n",
			},
			bins: []string{"/opt/a"}, conf: "/etc/b", configs: []string{"/etc/containerd/config.toml", "/etc/containerd/conf.d/10-cni.toml", "/etc/containerd/conf.d/20-cni.toml"},
		},
		{
			name: "CRI-O, drop-in and flags",
			comm: "crio", args: []string{"/usr/bin/crio", "--cni-plugin-dir", "/usr/libexec/cni", "--cni-plugin-dir=/var/lib/cni/bin"},
			files: map[string]string{
				"/etc/crio/crio.conf":               "[crio.network]\nnetwork_dir = \"/etc/cni/net.d/\"\n",
				"/etc/crio/crio.conf.d/00-k8s.conf": "[crio.network]\nnetwork_dir = \"/etc/kubernetes/cni/net.d/\"\nplugin_dirs = [\"/opt/x\"]\n",
			},
			bins: []string{"/usr/libexec/cni", "/var/lib/cni/bin"}, conf: "/etc/kubernetes/cni/net.d/", configs: []string{"/etc/crio/crio.conf", "/etc/crio/crio.conf.d/00-k8s.conf"},
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			all, _, err := FindAll(fakeProc(t, c.comm, c.args, c.files))
			if err != nil || len(all) != 1 {
				t.Fatalf("found %+v, %v; want one runtime", all, err)
			}
			d := all[0]
			if d.PID != 4242 || !reflect.DeepEqual(d.BinDirs, c.bins) || d.ConfDir != c.conf || !reflect.DeepEqual(d.Configs, c.configs) {
				t.Errorf("got %+v; want bins %q, conf %q, configs %q", d, c.bins, c.conf, c.configs)
			}
		})
	}
}

func TestFindFails(t *testing.T) {
	if _, _, err := FindAll(fakeProc(t, "dockerd", []string{"dockerd"}, nil)); !errors.Is(err, ErrNoRuntime) {
		t.Errorf("no runtime: %v, want ErrNoRuntime", err)
	}
	if _, _, err := FindAll(fakeProc(t, "containerd", []string{"containerd", "-c", "/etc/x.toml"}, nil)); err == nil {
		t.Error("a config named on the command line that does not exist: no error")
	}
	if _, _, err := FindAll(fakeProc(t, "containerd", []string{"containerd"}, map[string]string{"/etc/containerd/config.toml": "version = [\n"})); err == nil || !strings.Contains(err.Error(), "parse") {
		t.Errorf("a config that does not parse: %v", err)
	}
	// Docker's containerd, its CRI off, loads no CNI: it is no runtime of
	// the kubelet's, in each config version's spelling.
	for _, disabled := range []string{`["cri"]`, `["io.containerd.grpc.v1.cri"]`, `['io.containerd.cri.v1.runtime']`} {
		all, _, err := FindAll(fakeProc(t, "containerd", []string{"containerd"}, map[string]string{"/etc/containerd/config.toml": "disabled_plugins = " + disabled + "\n"}))
		if !errors.Is(err, ErrNoRuntime) || len(all) != 0 {
			t.Errorf("containerd with disabled_plugins = %s: found %+v, %v; want none", disabled, all, err)
		}
	}
}

func TestMismatch(t *testing.T) {
	proc := fakeProc(t, "containerd", []string{"containerd"}, map[string]string{
		"/etc/containerd/config.toml":                                  "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".cni]\n  bin_dir = \"/home/kubernetes/bin\"\n  conf_dir = \"/etc/cni/net.d\"\n",
		"/home/kubernetes/bin/loopback":                                "",
		"/etc/cni/net.d/10-x.conflist":                                 "",
		"/opt/cni/bin/bridge":                                          "",
		"/var/lib/rancher/k3s/agent/etc/cni/net.d/10-flannel.conflist": "",
	})
	all, _, err := FindAll(proc)
	if err != nil {
		t.Fatal(err)
	}
	d := all[0]
	// The agent sees the runtime's directories through its mounts: here, the
	// runtime's root itself.
	root := filepath.Join(proc.Root, "4242", "root")
	host := func(p string) string { return filepath.Join(root, p) }
	if why := d.Mismatch([]string{host("/opt/cni/bin"), host("/home/kubernetes/bin") + "/"}, host("/etc/cni/net.d")); why != "" {
		t.Errorf("agreeing dirs: %q", why)
	}
	why := d.Mismatch([]string{host("/opt/cni/bin")}, host("/etc/cni/net.d"))
	for _, want := range []string{"containerd (pid 4242, /etc/containerd/config.toml) loads CNI plugins from /home/kubernetes/bin", "installs the plugin into " + host("/opt/cni/bin"), "pods would start without the mesh"} {
		if !strings.Contains(why, want) {
			t.Errorf("mismatch %q does not say %q", why, want)
		}
	}
	if why := d.Mismatch([]string{host("/home/kubernetes/bin")}, host("/var/lib/rancher/k3s/agent/etc/cni/net.d")); !strings.Contains(why, "writes its chain entry to") || strings.Contains(why, "installs the plugin") {
		t.Errorf("conf dir mismatch: %q", why)
	}
	// The same names elsewhere are not the runtime's directories.
	other := t.TempDir()
	for _, dir := range []string{"etc/cni/net.d", "home/kubernetes/bin"} {
		if err := os.MkdirAll(filepath.Join(other, dir), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if why := d.Mismatch([]string{filepath.Join(other, "home/kubernetes/bin")}, filepath.Join(other, "etc/cni/net.d")); why == "" {
		t.Error("directories of the same name but not the runtime's passed")
	}
	if why := Serves(all, []string{host("/home/kubernetes/bin")}, host("/etc/cni/net.d")); why != "" {
		t.Errorf("Serves: %q", why)
	}
	if why := Serves(append(all, all...), []string{host("/opt/cni/bin")}, host("/etc/cni/net.d")); strings.Count(why, "pods would start without the mesh") != 2 {
		t.Errorf("Serves with two runtimes, neither serving: %q", why)
	}
}
