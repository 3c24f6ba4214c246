package runtimecni

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/mesh-cni/mesh-cni/internal/hostproc"
	"github.com/mesh-cni/mesh-cni/internal/hostproc/hostproctest"
)

// k3sConfig is k3s' containerd config: CNI under /var/lib/rancher/k3s.
const k3sConfig = "version = 3\n[plugins.'io.containerd.cri.v1.runtime'.cni]\n  bin_dir = '/var/lib/rancher/k3s/data/cni'\n  conf_dir = '/var/lib/rancher/k3s/agent/etc/cni/net.d'\n"

// k3sArgs is how k3s starts its containerd.
var k3sArgs = []string{"containerd", "-c", "/var/lib/rancher/k3s/agent/etc/containerd/config.toml"}

// k3sNode is a node whose runtime is k3s' containerd, pid 4242, with its
// directories, and the kubeadm layout's too (a DaemonSet rendered for the
// default platform mounts those).
func k3sNode(t *testing.T) *hostproctest.Node {
	t.Helper()
	n := hostproctest.New(t)
	n.Files(n.Root, map[string]string{
		"/var/lib/rancher/k3s/agent/etc/containerd/config.toml":        k3sConfig,
		"/var/lib/rancher/k3s/agent/etc/cni/net.d/10-flannel.conflist": "{}",
		"/var/lib/rancher/k3s/data/cni/flannel":                        "",
		"/etc/cni/net.d/":                                              "",
		"/opt/cni/bin/":                                                "",
	})
	n.Process(4242, "containerd", k3sArgs, n.Root, n.Netns, "0::/system.slice/k3s.service\n")
	return n
}

func TestDecide(t *testing.T) {
	for _, c := range []struct {
		name     string
		node     func(t *testing.T) *hostproctest.Node
		want     func(n *hostproctest.Node) Want
		bins     func(n *hostproctest.Node) []string
		conf     func(n *hostproctest.Node) string
		bin, cnf Via
		note     string
	}{
		{
			// helm template on k3s: the DaemonSet mounts the default
			// layout's directories, which k3s never reads; the agent
			// installs into k3s' through the host's root.
			name: "k3s, default mounts",
			node: k3sNode,
			want: func(n *hostproctest.Node) Want {
				return Want{BinDirs: []string{n.Mount("/opt/cni/bin")}, ConfDir: n.Mount("/etc/cni/net.d")}
			},
			bins: func(n *hostproctest.Node) []string { return []string{n.Host("/var/lib/rancher/k3s/data/cni")} },
			conf: func(n *hostproctest.Node) string { return n.Host("/var/lib/rancher/k3s/agent/etc/cni/net.d") },
			bin:  ViaHostRoot, cnf: ViaHostRoot,
		},
		{
			// platform: k3s: the mounts are k3s' directories.
			name: "k3s, the platform's mounts",
			node: k3sNode,
			want: func(n *hostproctest.Node) Want {
				return Want{BinDirs: []string{n.Mount("/var/lib/rancher/k3s/data/cni")}, ConfDir: n.Mount("/var/lib/rancher/k3s/agent/etc/cni/net.d")}
			},
			bins: func(n *hostproctest.Node) []string { return []string{n.Mount("/var/lib/rancher/k3s/data/cni")} },
			conf: func(n *hostproctest.Node) string { return n.Mount("/var/lib/rancher/k3s/agent/etc/cni/net.d") },
			bin:  ViaMount, cnf: ViaMount,
		},
		{
			// cni.confDir set: it wins, and the note says the runtime does
			// not read it; the plugin goes where the runtime looks.
			name: "k3s, conf dir named by the operator",
			node: k3sNode,
			want: func(n *hostproctest.Node) Want {
				return Want{BinDirs: []string{n.Mount("/opt/cni/bin")}, ConfDir: n.Mount("/etc/cni/net.d"), ExplicitConf: true}
			},
			bins: func(n *hostproctest.Node) []string { return []string{n.Host("/var/lib/rancher/k3s/data/cni")} },
			conf: func(n *hostproctest.Node) string { return n.Mount("/etc/cni/net.d") },
			bin:  ViaHostRoot, cnf: ViaFlag,
			note: "only a meta plugin that reads it runs the chain entry",
		},
		{
			name: "k3s, both named by the operator",
			node: k3sNode,
			want: func(n *hostproctest.Node) Want {
				return Want{BinDirs: []string{n.Mount("/opt/cni/bin")}, ConfDir: n.Mount("/etc/cni/net.d"), ExplicitBin: true, ExplicitConf: true}
			},
			bins: func(n *hostproctest.Node) []string { return []string{n.Mount("/opt/cni/bin")} },
			conf: func(n *hostproctest.Node) string { return n.Mount("/etc/cni/net.d") },
			bin:  ViaFlag, cnf: ViaFlag,
			note: "is none of /var/lib/rancher/k3s/data/cni",
		},
		{
			// A runtime whose config and directories are links (as on a
			// host that keeps /etc in a store): absolute targets are
			// followed in the host's root, never the agent's.
			name: "conf dir behind absolute links",
			node: func(t *testing.T) *hostproctest.Node {
				n := hostproctest.New(t)
				n.Files(n.Root, map[string]string{
					"/nix/store/x-containerd.toml":    "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".cni]\n  bin_dir = \"/usr/libexec/cni\"\n  conf_dir = \"/etc/cni/net.d\"\n",
					"/var/lib/cni-conf/net.d/10.conf": "{}",
					"/usr/lib/cni/loopback":           "",
				})
				for link, target := range map[string]string{"/etc/cni": "/var/lib/cni-conf", "/usr/libexec/cni": "../lib/cni", "/etc/containerd/config.toml": "/nix/store/x-containerd.toml"} {
					if err := os.MkdirAll(filepath.Dir(n.Mount(link)), 0o755); err != nil {
						t.Fatal(err)
					}
					if err := os.Symlink(target, n.Mount(link)); err != nil {
						t.Fatal(err)
					}
				}
				n.Process(4242, "containerd", []string{"containerd"}, n.Root, n.Netns, n.HostCgroup)
				return n
			},
			want: func(n *hostproctest.Node) Want {
				return Want{BinDirs: []string{"/nonexistent/bin"}, ConfDir: "/nonexistent/conf"}
			},
			bins: func(n *hostproctest.Node) []string { return []string{n.Host("/usr/lib/cni")} },
			conf: func(n *hostproctest.Node) string { return n.Host("/var/lib/cni-conf/net.d") },
			bin:  ViaHostRoot, cnf: ViaHostRoot,
		},
		{
			// No runtime of the host's own: the flags' directories.
			name: "no runtime",
			node: hostproctest.New,
			want: func(n *hostproctest.Node) Want {
				return Want{BinDirs: []string{"/opt/cni/bin"}, ConfDir: "/etc/cni/net.d"}
			},
			bins: func(n *hostproctest.Node) []string { return []string{"/opt/cni/bin"} },
			conf: func(n *hostproctest.Node) string { return "/etc/cni/net.d" },
			bin:  ViaDefault, cnf: ViaDefault,
			note: "the container runtime's CNI directories are unknown",
		},
		{
			// Two runtimes (Docker's containerd next to the kubelet's, say,
			// both reading the default layout): one decision.
			name: "two runtimes, the same directories",
			node: func(t *testing.T) *hostproctest.Node {
				n := hostproctest.New(t)
				n.Files(n.Root, map[string]string{"/etc/cni/net.d/": "", "/opt/cni/bin/": "", "/etc/crio/crio.conf": "[crio.network]\nplugin_dirs = [\"/opt/cni/bin\"]\nnetwork_dir = \"/etc/cni/net.d\"\n"})
				n.Process(4242, "containerd", []string{"containerd"}, n.Root, n.Netns, n.HostCgroup)
				n.Process(4343, "crio", []string{"crio"}, n.Root, n.Netns, "0::/system.slice/crio.service\n")
				return n
			},
			want: func(n *hostproctest.Node) Want { return Want{BinDirs: []string{"/x/bin"}, ConfDir: "/x/conf"} },
			bins: func(n *hostproctest.Node) []string { return []string{n.Host("/opt/cni/bin")} },
			conf: func(n *hostproctest.Node) string { return n.Host("/etc/cni/net.d") },
			bin:  ViaHostRoot, cnf: ViaHostRoot,
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			n := c.node(t)
			p, err := Decide(n.Procfs(), c.want(n))
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(p.BinDirs, c.bins(n)) || p.ConfDir != c.conf(n) || p.Bin != c.bin || p.Conf != c.cnf {
				t.Errorf("decided %s; want bins %q (%s), conf %q (%s)", p, c.bins(n), c.bin, c.conf(n), c.cnf)
			}
			notes := strings.Join(p.Notes, "\n")
			if (c.note == "") != (notes == "") || !strings.Contains(notes, c.note) {
				t.Errorf("notes %q, want one saying %q", notes, c.note)
			}
		})
	}
}

// What keeps the agent not ready: each error names the runtime's directory
// and why the agent cannot install there.
func TestDecideFails(t *testing.T) {
	t.Run("runtime's conf dir missing", func(t *testing.T) {
		n := hostproctest.New(t)
		n.Files(n.Root, map[string]string{"/var/lib/rancher/k3s/agent/etc/containerd/config.toml": k3sConfig, "/var/lib/rancher/k3s/data/cni/": ""})
		n.Process(4242, "containerd", k3sArgs, n.Root, n.Netns, n.HostCgroup)
		_, err := Decide(n.Procfs(), Want{BinDirs: []string{"/opt/cni/bin"}, ConfDir: "/etc/cni/net.d"})
		if err == nil || !strings.Contains(err.Error(), "/var/lib/rancher/k3s/agent/etc/cni/net.d does not exist") {
			t.Errorf("Decide: %v", err)
		}
	})
	t.Run("runtime's bin dirs missing", func(t *testing.T) {
		n := hostproctest.New(t)
		n.Files(n.Root, map[string]string{"/var/lib/rancher/k3s/agent/etc/containerd/config.toml": k3sConfig, "/var/lib/rancher/k3s/agent/etc/cni/net.d/": ""})
		n.Process(4242, "containerd", k3sArgs, n.Root, n.Netns, n.HostCgroup)
		_, err := Decide(n.Procfs(), Want{BinDirs: []string{"/opt/cni/bin"}, ConfDir: "/etc/cni/net.d"})
		if err == nil || !strings.Contains(err.Error(), "loads CNI plugins from /var/lib/rancher/k3s/data/cni, which the agent cannot reach") {
			t.Errorf("Decide: %v", err)
		}
	})
	t.Run("check: the mounts are not the runtime's", func(t *testing.T) {
		n := k3sNode(t)
		_, err := Decide(n.Procfs(), Want{BinDirs: []string{n.Mount("/opt/cni/bin")}, ConfDir: n.Mount("/etc/cni/net.d"), Check: true})
		if err == nil || !strings.Contains(err.Error(), "pods would start without the mesh") {
			t.Errorf("Decide: %v", err)
		}
		// The platform's mounts pass the check.
		p, err := Decide(n.Procfs(), Want{BinDirs: []string{n.Mount("/var/lib/rancher/k3s/data/cni")}, ConfDir: n.Mount("/var/lib/rancher/k3s/agent/etc/cni/net.d"), Check: true})
		if err != nil || p.Bin != ViaMount || p.Conf != ViaMount || p.Runtime == nil || p.Runtime.PID != 4242 {
			t.Errorf("Decide: %s, %v", p, err)
		}
	})
	t.Run("two runtimes, different directories", func(t *testing.T) {
		n := k3sNode(t)
		n.Files(n.Root, map[string]string{"/etc/crio/crio.conf": "[crio.network]\nplugin_dirs = [\"/opt/cni/bin\"]\nnetwork_dir = \"/etc/cni/net.d\"\n"})
		n.Process(4343, "crio", []string{"crio"}, n.Root, n.Netns, "0::/system.slice/crio.service\n")
		_, err := Decide(n.Procfs(), Want{BinDirs: []string{"/x/bin"}, ConfDir: "/x/conf"})
		if err == nil || !strings.Contains(err.Error(), "2 container runtimes load CNI from different directories") {
			t.Errorf("Decide: %v", err)
		}
		// The flags' directories are one runtime's: that one.
		p, err := Decide(n.Procfs(), Want{BinDirs: []string{n.Mount("/opt/cni/bin")}, ConfDir: n.Mount("/etc/cni/net.d")})
		if err != nil || p.Runtime == nil || p.Runtime.PID != 4343 || p.Bin != ViaMount || p.Conf != ViaMount {
			t.Errorf("Decide: %s, %v", p, err)
		}
	})
}

// A process in a pod may be named containerd and read a config of its own
// making that points at any directory of the host. It is refused, whatever
// its pid, and never read: with the host's runtime, the agent installs where
// that one loads from; without it, into the flags' directories, never the
// attacker's.
func TestDecideRefusesPods(t *testing.T) {
	evil := "version = 3\n[plugins.'io.containerd.cri.v1.runtime'.cni]\n  bin_dirs = ['/usr/local/sbin']\n  conf_dir = '/etc/cron.d'\n"
	attack := func(n *hostproctest.Node) map[int]hostproc.Check {
		// Its own config, in its image, in the host's /tmp (a hostPath it
		// was given) and in a directory it named.
		n.Files(n.PodRoot, map[string]string{"/etc/containerd/config.toml": evil, "/etc/cron.d/": "", "/usr/local/sbin/": ""})
		n.Files(n.Root, map[string]string{"/tmp/evil.toml": evil, "/etc/cron.d/": "", "/usr/local/sbin/": ""})
		n.Process(10, "containerd", []string{"containerd"}, n.PodRoot, n.PodNetns, n.PodCgroup)
		n.Process(11, "containerd", []string{"containerd", "-c", "/tmp/evil.toml"}, n.Root, n.PodNetns, n.HostCgroup)
		n.Process(12, "containerd", []string{"containerd", "-c", "/tmp/evil.toml"}, n.Root, n.Netns, n.PodCgroup)
		n.Process(13, "crio", []string{"crio", "--cni-config-dir=/etc/cron.d", "--cni-plugin-dir=/usr/local/sbin"}, n.Root, n.Netns, "0::/kubepods/besteffort/pod0f1e2d3c-aaaa-bbbb-cccc-123456789abc/"+strings.Repeat("cd", 32)+"\n")
		return map[int]hostproc.Check{10: hostproc.CheckRoot, 11: hostproc.CheckNetNS, 12: hostproc.CheckCgroup, 13: hostproc.CheckCgroup}
	}
	check := func(t *testing.T, p Place, want map[int]hostproc.Check) {
		t.Helper()
		got := map[int]hostproc.Check{}
		for _, r := range p.Refused {
			got[r.PID] = r.Check
		}
		if !reflect.DeepEqual(got, want) {
			t.Errorf("refused %v, want %v", got, want)
		}
		for _, d := range append(p.BinDirs, p.ConfDir) {
			if strings.Contains(d, "cron.d") || strings.Contains(d, "sbin") {
				t.Errorf("the attacker steered the agent to %s", d)
			}
		}
	}
	t.Run("with the host's runtime", func(t *testing.T) {
		n := k3sNode(t)
		refusals := attack(n)
		p, err := Decide(n.Procfs(), Want{BinDirs: []string{n.Mount("/opt/cni/bin")}, ConfDir: n.Mount("/etc/cni/net.d")})
		if err != nil || p.Runtime == nil || p.Runtime.PID != 4242 || p.ConfDir != n.Host("/var/lib/rancher/k3s/agent/etc/cni/net.d") {
			t.Fatalf("Decide: %s, %v; want k3s' containerd's directories", p, err)
		}
		check(t, p, refusals)
	})
	t.Run("alone", func(t *testing.T) {
		n := hostproctest.New(t)
		refusals := attack(n)
		p, err := Decide(n.Procfs(), Want{BinDirs: []string{"/opt/cni/bin"}, ConfDir: "/etc/cni/net.d"})
		if err != nil || p.Runtime != nil || p.Bin != ViaDefault || p.ConfDir != "/etc/cni/net.d" {
			t.Fatalf("Decide: %s, %v; want the flags' directories", p, err)
		}
		check(t, p, refusals)
	})
}
