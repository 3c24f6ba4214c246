package harness_test

import (
	"errors"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

func TestMain(m *testing.M) {
	harness.Main(m, harness.Options{Packages: harness.ReferencePlugins()})
}

// rootReason is why these tests need root.
const rootReason = "these tests make network namespaces"

func TestReferencePluginsBuilt(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	t.Parallel()
	ctx := fixtures.Context(t, 2*time.Minute)
	harness.Bins(t).Require(t, harness.ReferencePluginNames()...)
	node := harness.NewNode(t, harness.NodeOptions{})
	for _, name := range harness.ReferencePluginNames() {
		info, err := node.CNI.GetVersionInfo(ctx, name)
		if err != nil {
			t.Fatalf("VERSION of %s: %v", name, err)
		}
		if !slices.Contains(info.SupportedVersions(), harness.CNIVersion) {
			t.Errorf("%s supports %v, want %s among them", name, info.SupportedVersions(), harness.CNIVersion)
		}
	}
}

// TestBridgeDualStack drives the reference primary network through libcni the way a
// runtime does and checks real pod-to-pod TCP, CHECK, STATUS, GC and DEL.
func TestBridgeDualStack(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	t.Parallel()
	ctx := fixtures.Context(t, 2*time.Minute)
	node := harness.NewNode(t, harness.NodeOptions{})
	list := node.Conflist(t, "meshtest")
	client := node.NewPod(t, "default", "client")
	server := node.NewPod(t, "default", "server")

	if err := node.Status(ctx, list); err != nil {
		t.Fatalf("STATUS: %v", err)
	}
	for _, pod := range []*harness.Pod{client, server} {
		if _, err := node.Add(ctx, pod, list); err != nil {
			t.Fatalf("ADD: %v", err)
		}
		if !node.IPv4Range.Contains(pod.IPv4(t)) || !node.IPv6Range.Contains(pod.IPv6(t)) {
			t.Fatalf("pod %s got %v, want addresses in %s and %s", pod.Name, pod.Addrs(), node.IPv4Range, node.IPv6Range)
		}
	}
	requireVeths(t, node, 2)
	requireAllocations(t, node, list.Name, client, server)

	// Real TCP, client pod -> server pod, over each family.
	for _, tc := range []struct {
		network string
		dst     netip.Addr
		src     netip.Addr
	}{
		{"tcp4", server.IPv4(t), client.IPv4(t)},
		{"tcp6", server.IPv6(t), client.IPv6(t)},
	} {
		ln := server.Listen(t, tc.network, net.JoinHostPort(tc.dst.String(), "0"))
		fixtures.ServeEcho(t, ln)
		conn, err := client.Dial(ctx, tc.network, ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		if err := fixtures.EchoRoundTrip(ctx, conn, []byte("hello over "+tc.network)); err != nil {
			t.Fatalf("%s echo: %v", tc.network, err)
		}
		local := conn.LocalAddr().(*net.TCPAddr).AddrPort().Addr().Unmap()
		if local != tc.src {
			t.Errorf("%s connection left from %s, want the client pod's %s", tc.network, local, tc.src)
		}
		conn.Close()
	}

	for _, pod := range []*harness.Pod{client, server} {
		if err := node.Check(ctx, pod, list); err != nil {
			t.Fatalf("CHECK: %v", err)
		}
	}

	// GC through libcni: the server's attachment is not valid any more, so libcni
	// DELetes it from its cache; the client's stays.
	if err := node.GC(ctx, list, []types.GCAttachment{client.Attachment()}); err != nil {
		t.Fatalf("GC: %v", err)
	}
	requireVeths(t, node, 1)
	requireAllocations(t, node, list.Name, client)
	if err := node.Check(ctx, client, list); err != nil {
		t.Fatalf("CHECK after GC: %v", err)
	}

	// DEL is idempotent, also for the attachment GC already removed.
	for range 2 {
		if err := node.Del(ctx, client, list); err != nil {
			t.Fatalf("DEL: %v", err)
		}
	}
	if err := node.Del(ctx, server, list); err != nil {
		t.Fatalf("DEL after GC: %v", err)
	}
	requireVeths(t, node, 0)
	requireAllocations(t, node, list.Name)
	requireNoCachedResults(t, node)
	if client.Result() != nil {
		t.Errorf("client still has a result after DEL")
	}
}

// TestCleanupReleasesEverything adds pods in a subtest that never deletes them and
// checks that the subtest's cleanup DELeted them and removed every namespace.
func TestCleanupReleasesEverything(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	t.Parallel()
	dir := t.TempDir()
	var (
		node  *harness.Node
		paths []string
	)
	network := "leaktest"
	t.Run("add", func(t *testing.T) {
		ctx := fixtures.Context(t, 2*time.Minute)
		node = harness.NewNode(t, harness.NodeOptions{Dir: dir})
		list := node.Conflist(t, network)
		paths = append(paths, node.NetNSPath)
		for _, name := range []string{"a", "b"} {
			pod := node.NewPod(t, "default", name)
			paths = append(paths, pod.NetNSPath)
			if _, err := node.Add(ctx, pod, list); err != nil {
				t.Fatal(err)
			}
		}
		requireVeths(t, node, 2)
		if a, err := node.Allocations(network); err != nil || len(a) != 4 {
			t.Fatalf("allocations = %v (%v), want 4", a, err)
		}
	})
	for _, p := range paths {
		if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("netns %s still there after cleanup (stat: %v)", p, err)
		}
	}
	leaked, err := harness.LeakedNetns()
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range leaked {
		if slices.Contains(paths, l) {
			t.Errorf("netns %s still mounted after cleanup", l)
		}
	}
	requireAllocations(t, node, network)
	requireNoCachedResults(t, node)
}

// TestChainedExtraPlugin shows the extra entries of Conflist run chained after the
// bridge, as the mesh-cni entry will.
func TestChainedExtraPlugin(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	t.Parallel()
	ctx := fixtures.Context(t, 2*time.Minute)
	node := harness.NewNode(t, harness.NodeOptions{})
	list := node.Conflist(t, "chained", map[string]any{
		"type":         "portmap",
		"capabilities": map[string]any{"portMappings": true},
	})
	if len(list.Plugins) != 2 || list.Plugins[1].Network.Type != "portmap" {
		t.Fatalf("plugins = %+v, want [bridge portmap]", list.Plugins)
	}
	pod := node.NewPod(t, "default", "chained")
	res, err := node.Add(ctx, pod, list)
	if err != nil {
		t.Fatal(err)
	}
	if res.Version() != harness.CNIVersion || len(pod.Addrs()) != 2 {
		t.Fatalf("result %s with %v, want %s with two addresses", res.Version(), pod.Addrs(), harness.CNIVersion)
	}
	if err := node.Check(ctx, pod, list); err != nil {
		t.Fatal(err)
	}
	if err := node.Del(ctx, pod, list); err != nil {
		t.Fatal(err)
	}
}

// TestArgsOverride proves per-call CNI_ARGS reach the plugins: the bridge plugin
// rejects unknown args unless IgnoreUnknown is set.
func TestArgsOverride(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	t.Parallel()
	ctx := fixtures.Context(t, 2*time.Minute)
	node := harness.NewNode(t, harness.NodeOptions{})
	list := node.Conflist(t, "argstest")
	pod := node.NewPod(t, "default", "args")

	_, err := node.Add(ctx, pod, list, harness.WithArgs([][2]string{{"K8S_POD_NAME", "args"}}))
	var cniErr *types.Error
	if !errors.As(err, &cniErr) {
		t.Fatalf("ADD with unknown args and no IgnoreUnknown = %v, want a CNI error", err)
	}
	if _, err := node.Add(ctx, pod, list, harness.WithArgs(nil)); err != nil {
		t.Fatalf("ADD without CNI_ARGS: %v", err)
	}
	// Left attached on purpose: the pod's cleanup DELetes it.
}

func TestLoadConflist(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	t.Parallel()
	node := harness.NewNode(t, harness.NodeOptions{})
	if _, _, err := node.LoadConflist(); err == nil {
		t.Fatal("LoadConflist on an empty conf dir succeeded")
	}
	node.WriteConf(t, "05-broken.conflist", []byte("{not json"))
	node.WriteConflist(t, "20-second.conflist", node.Conflist(t, "second"))
	single := `{"cniVersion":"1.1.0","name":"first","type":"bridge","bridge":"cni0","ipam":{"type":"host-local","subnet":"10.1.2.0/24"}}`
	firstPath := node.WriteConf(t, "10-first.conf", []byte(single))
	list, path, err := node.LoadConflist()
	if err != nil {
		t.Fatal(err)
	}
	if path != firstPath || list.Name != "first" || len(list.Plugins) != 1 || list.CNIVersion != "1.1.0" {
		t.Fatalf("LoadConflist = %q from %s, want the .conf file as a one-plugin list", list.Name, path)
	}
}

func TestProcess(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	t.Parallel()
	ctx := fixtures.Context(t, 2*time.Minute)

	t.Run("ready line and stop", func(t *testing.T) {
		p := harness.StartProcess(t, harness.ProcessOptions{
			Path: "/bin/sh",
			Args: []string{"-c", `echo starting; echo "listening on 127.0.0.1:1234" >&2; exec sleep 600`},
		})
		line, err := p.WaitForLine(ctx, "listening on")
		if err != nil {
			t.Fatal(err)
		}
		if line != "listening on 127.0.0.1:1234" {
			t.Fatalf("line = %q", line)
		}
		// The line may already have been seen: waiting again still finds it.
		if _, err := p.WaitForLine(ctx, "starting"); err != nil {
			t.Fatal(err)
		}
		err = p.Stop(ctx)
		var exitErr *exec.ExitError
		if !errors.As(err, &exitErr) || exitErr.Sys().(syscall.WaitStatus).Signal() != syscall.SIGTERM {
			t.Fatalf("Stop = %v, want the process ended by SIGTERM", err)
		}
		if out, err := os.ReadFile(p.LogPath()); err != nil || !strings.Contains(string(out), "starting") {
			t.Fatalf("log file = %q (%v)", out, err)
		}
	})

	t.Run("exits before the line", func(t *testing.T) {
		p := harness.StartProcess(t, harness.ProcessOptions{Path: "/bin/sh", Args: []string{"-c", "echo bye; exit 3"}})
		if _, err := p.WaitForLine(ctx, "ready"); err == nil {
			t.Fatal("WaitForLine succeeded for a process that exited without the line")
		}
		var exitErr *exec.ExitError
		if err := p.Wait(ctx); !errors.As(err, &exitErr) || exitErr.ExitCode() != 3 {
			t.Fatalf("Wait = %v, want exit status 3", err)
		}
	})

	t.Run("kill", func(t *testing.T) {
		p := harness.StartProcess(t, harness.ProcessOptions{Path: "/bin/sleep", Args: []string{"600"}})
		if err := p.Kill(); err != nil {
			t.Fatal(err)
		}
		<-p.Done()
	})

	t.Run("in pod netns as another user", func(t *testing.T) {
		node := harness.NewNode(t, harness.NodeOptions{})
		pod := node.NewPod(t, "default", "proc")
		p := pod.Start(t, harness.ProcessOptions{
			Path:       "/bin/sh",
			Args:       []string{"-c", "id -u; readlink /proc/self/ns/net"},
			Dir:        "/",
			Credential: &syscall.Credential{Uid: 65534, Gid: 65534},
		})
		if err := p.Wait(ctx); err != nil {
			t.Fatalf("%v: %s", err, p.Output())
		}
		var st syscall.Stat_t
		if err := syscall.Stat(pod.NetNSPath, &st); err != nil {
			t.Fatal(err)
		}
		want := "65534\nnet:[" + strconv.FormatUint(st.Ino, 10) + "]\n"
		if p.Output() != want {
			t.Fatalf("output = %q, want %q", p.Output(), want)
		}

		out, err := pod.Exec(ctx, "readlink", "/proc/self/ns/net")
		if err != nil || string(out) != "net:["+strconv.FormatUint(st.Ino, 10)+"]\n" {
			t.Fatalf("Exec in pod = %q, %v", out, err)
		}
	})
}

func requireVeths(t *testing.T, node *harness.Node, want int) {
	t.Helper()
	veths, err := node.Veths()
	if err != nil {
		t.Fatal(err)
	}
	if len(veths) != want {
		t.Fatalf("node has veths %v, want %d", veths, want)
	}
}

// requireAllocations checks host-local holds exactly the pods' addresses.
func requireAllocations(t *testing.T, node *harness.Node, network string, pods ...*harness.Pod) {
	t.Helper()
	allocs, err := node.Allocations(network)
	if err != nil {
		t.Fatal(err)
	}
	var got, want []string
	for _, a := range allocs {
		got = append(got, a.ContainerID+" "+a.IfName+" "+a.Addr.String())
	}
	for _, p := range pods {
		for _, addr := range p.Addrs() {
			want = append(want, p.ContainerID+" "+p.IfName+" "+addr.String())
		}
	}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("host-local allocations:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

func requireNoCachedResults(t *testing.T, node *harness.Node) {
	t.Helper()
	entries, err := os.ReadDir(filepath.Join(node.CacheDir, "results"))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	if len(entries) != 0 {
		t.Fatalf("libcni cache still holds %d results", len(entries))
	}
}

// TestCheckLeaks plants a namespace with the harness's prefix, as a test that forgot
// its cleanup would, and checks the leak check finds and removes it. Not parallel:
// CheckLeaks also reports this process's running children.
func TestCheckLeaks(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	path := filepath.Join(harness.NetnsDir, harness.NetnsPrefix()+"planted")
	fixtures.NewNetns(t, path)
	leaked, err := harness.LeakedNetns()
	if err != nil || !slices.Contains(leaked, path) {
		t.Fatalf("LeakedNetns = %v, %v; want it to list %s", leaked, err, path)
	}
	var report strings.Builder
	if err := harness.CheckLeaks(&report); err == nil || !strings.Contains(err.Error(), path) {
		t.Fatalf("CheckLeaks = %v, want an error naming %s", err, path)
	}
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("CheckLeaks left %s behind (stat: %v; report %q)", path, err, report.String())
	}
	if err := harness.CheckLeaks(&report); err != nil {
		t.Fatalf("CheckLeaks after removal = %v", err)
	}
}

// TestConcurrentPods drives several pods through one node at once, as a runtime
// starting many pods does; run with -race it also checks the harness's own locking.
func TestConcurrentPods(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	t.Parallel()
	ctx := fixtures.Context(t, 2*time.Minute)
	node := harness.NewNode(t, harness.NodeOptions{})
	list := node.Conflist(t, "concurrent")
	pods := make([]*harness.Pod, 6)
	for i := range pods {
		pods[i] = node.NewPod(t, "default", "pod-"+strconv.Itoa(i))
	}
	run := func(op func(*harness.Pod) error) {
		t.Helper()
		errs := make(chan error, len(pods))
		for _, p := range pods {
			go func() { errs <- op(p) }()
		}
		for range pods {
			if err := <-errs; err != nil {
				t.Error(err)
			}
		}
		if t.Failed() {
			t.FailNow()
		}
	}
	bridgeMAC := requireBridge(t, node).MAC.String()
	run(func(p *harness.Pod) error { _, err := node.Add(ctx, p, list); return err })
	requireVeths(t, node, len(pods))
	// The bridge keeps the MAC the harness gave it, whatever its ports' MACs are,
	// so the bridge plugin's CHECK holds for every pod.
	if got := requireBridge(t, node).MAC.String(); got != bridgeMAC {
		t.Fatalf("bridge MAC changed from %s to %s as pods joined", bridgeMAC, got)
	}
	requireAllocations(t, node, list.Name, pods...)
	run(func(p *harness.Pod) error { return node.Check(ctx, p, list) })
	run(func(p *harness.Pod) error { return node.Del(ctx, p, list) })
	requireVeths(t, node, 0)
	requireAllocations(t, node, list.Name)
}

// TestPluginCreatesBridge checks the node mode where the bridge plugin makes the
// bridge itself.
func TestPluginCreatesBridge(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	t.Parallel()
	ctx := fixtures.Context(t, 2*time.Minute)
	node := harness.NewNode(t, harness.NodeOptions{PluginCreatesBridge: true})
	links, err := node.Links()
	if err != nil {
		t.Fatal(err)
	}
	if slices.ContainsFunc(links, func(l harness.Link) bool { return l.Name == node.BridgeName }) {
		t.Fatalf("node has %s before any ADD", node.BridgeName)
	}
	list := node.Conflist(t, "plugin-bridge")
	pod := node.NewPod(t, "default", "first")
	if _, err := node.Add(ctx, pod, list); err != nil {
		t.Fatal(err)
	}
	requireBridge(t, node)
	requireVeths(t, node, 1)
}

func requireBridge(t *testing.T, node *harness.Node) harness.Link {
	t.Helper()
	links, err := node.Links()
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range links {
		if l.Name == node.BridgeName && l.Type == "bridge" {
			return l
		}
	}
	t.Fatalf("no bridge %s in node netns (links %v)", node.BridgeName, links)
	return harness.Link{}
}

// TestPrimaryOption: every primary the harness offers, in every family, gives
// pods exactly the addresses of the node's families from its ranges, real TCP
// between two pods on each address, a passing CHECK, and a DEL that leaves the
// node's interfaces as they were. A kernel without the primary's driver (ipvlan
// here) skips its rows.
func TestPrimaryOption(t *testing.T) {
	fixtures.RequireRoot(t, rootReason)
	t.Parallel()
	for _, primary := range harness.Primaries() {
		for _, families := range []harness.Families{harness.IPv4Only, harness.IPv6Only, harness.DualStack} {
			t.Run(string(primary)+"/"+families.String(), func(t *testing.T) {
				t.Parallel()
				ctx := fixtures.Context(t, 2*time.Minute)
				node := harness.NewNode(t, harness.NodeOptions{Primary: primary, Families: families})
				node.RequirePrimary(t)
				list := node.Conflist(t, "primary")
				if got := list.Plugins[0].Network.Type; got != primary.Plugin() {
					t.Fatalf("conflist starts with %s, want %s", got, primary.Plugin())
				}
				before, err := node.Links()
				if err != nil {
					t.Fatal(err)
				}
				client, server := node.NewPod(t, "default", "client"), node.NewPod(t, "default", "server")
				for _, pod := range []*harness.Pod{client, server} {
					if _, err := node.Add(ctx, pod, list); err != nil {
						t.Fatalf("ADD: %v", err)
					}
					var v4, v6 int
					for _, a := range pod.Addrs() {
						switch {
						case a.Is4() && node.IPv4Range.Contains(a):
							v4++
						case a.Is6() && node.IPv6Range.Contains(a):
							v6++
						default:
							t.Fatalf("pod %s got %s, outside the node's ranges", pod.Name, a)
						}
					}
					if (v4 == 1) != families.HasIPv4() || (v6 == 1) != families.HasIPv6() || v4 > 1 || v6 > 1 {
						t.Fatalf("pod %s got %v, want one address per family of %s", pod.Name, pod.Addrs(), families)
					}
				}
				for _, dst := range server.Addrs() {
					ln := server.Listen(t, "tcp", net.JoinHostPort(dst.String(), "0"))
					fixtures.ServeEcho(t, ln)
					conn, err := client.Dial(ctx, "tcp", ln.Addr().String())
					if err != nil {
						t.Fatal(err)
					}
					if err := fixtures.EchoRoundTrip(ctx, conn, []byte("hello")); err != nil {
						t.Fatalf("echo to %s: %v", dst, err)
					}
					conn.Close()
				}
				for _, pod := range []*harness.Pod{client, server} {
					if err := node.Check(ctx, pod, list); err != nil {
						t.Fatalf("CHECK: %v", err)
					}
					if err := node.Del(ctx, pod, list); err != nil {
						t.Fatalf("DEL: %v", err)
					}
				}
				after, err := node.Links()
				if err != nil {
					t.Fatal(err)
				}
				name := func(l harness.Link) string { return l.Name + "/" + l.Type }
				if !slices.Equal(sortedNames(before, name), sortedNames(after, name)) {
					t.Fatalf("node interfaces after DEL %v, before ADD %v", after, before)
				}
			})
		}
	}
}

func sortedNames[T any](items []T, name func(T) string) []string {
	out := make([]string, 0, len(items))
	for _, it := range items {
		out = append(out, name(it))
	}
	slices.Sort(out)
	return out
}
