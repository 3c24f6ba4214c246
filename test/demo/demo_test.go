package demo

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/proxy"
)

func TestMain(m *testing.M) {
	harness.Main(m, harness.Options{Packages: harness.AllBinaries()})
}

// narrator prints the demo's story: to the terminal under `make demo`
// (MESH_DEMO=1), to the test log otherwise.
type narrator struct {
	t     *testing.T
	out   io.Writer
	start time.Time
}

func (n *narrator) say(format string, args ...any) {
	line := fmt.Sprintf(format, args...)
	if n.out != nil {
		fmt.Fprintf(n.out, "[%5.1fs] %s\n", time.Since(n.start).Seconds(), line)
		return
	}
	n.t.Log(line)
}

func (n *narrator) step(title string) {
	if n.out != nil {
		fmt.Fprintf(n.out, "\n== %s\n", title)
		return
	}
	n.t.Log("== " + title)
}

// demo is where both demos start: the narrator, and a simulated node whose
// primary CNI config is [bridge + host-local], with a directory for the
// agent's socket, pod state, bpffs and install state.
type demo struct {
	say    *narrator
	node   *harness.Node
	bins   *harness.Binaries
	socket string
	dir    string
}

// newDemo tells and makes the node. The directory is short-named (a Unix
// socket's path is limited to 107 bytes); in cleanup the agent's uninstall
// restores the node's CNI config and removes the data path, then it goes.
func newDemo(t *testing.T) *demo {
	t.Helper()
	d := &demo{say: &narrator{t: t, start: time.Now()}, bins: harness.Bins(t)}
	if os.Getenv("MESH_DEMO") != "" {
		d.say.out = os.Stdout
	}
	d.say.step("A simulated node")
	d.node = harness.NewNode(t, harness.NodeOptions{})
	primary, err := d.node.ConflistJSON("podnet")
	if err != nil {
		t.Fatal(err)
	}
	primaryFile := d.node.WriteConf(t, "10-bridge.conflist", primary)
	d.say.say("node network namespace %s with bridge %s; pods get %s and %s",
		filepath.Base(d.node.NetNSPath), d.node.BridgeName, d.node.IPv4Range, d.node.IPv6Range)
	d.say.say("the primary CNI config is %s: [bridge + host-local]", filepath.Base(primaryFile))

	if d.dir, err = os.MkdirTemp("", "mesh-demo-"); err != nil {
		t.Fatal(err)
	}
	d.socket = filepath.Join(d.dir, "run", "gate.sock")
	t.Cleanup(func() {
		out, err := exec.Command(d.bins.Path("mesh-agent"), append(append([]string{"uninstall"}, d.paths()...), "--log-level", "warn")...).CombinedOutput()
		if err != nil {
			t.Errorf("uninstall: %v\n%s", err, out)
		}
		os.RemoveAll(d.dir)
	})
	return d
}

// paths are the flags naming the agent's data path and what it installs,
// which run and uninstall take alike.
func (d *demo) paths() []string {
	return []string{"--bpffs-root", filepath.Join(d.dir, "bpf"), "--cni-conf-dir", d.node.ConfDir, "--cni-bin-dir", d.node.BinDir,
		"--install-state-dir", filepath.Join(d.dir, "install")}
}

// agentArgs runs the agent on the demo's paths, installing itself into the
// node's chain, quiet but for warnings, with no metrics listener.
func (d *demo) agentArgs() []string {
	return append(append([]string{"run", "--socket", d.socket, "--state-dir", filepath.Join(d.dir, "pods")}, d.paths()...),
		"--plugin-binary", d.bins.Path("mesh-cni"), "--metrics-addr=", "--log-level", "warn")
}

func TestDemo(t *testing.T) {
	ctx := fixtures.Context(t, 5*time.Minute)
	d := newDemo(t)
	say, node, bins := d.say, d.node, d.bins
	agentArgs := append(d.agentArgs(), "--gate-timeout", "2m", "--zds-socket=",
		// The demo's proxies run in each pod, beside the application, and are known
		// by ztunnel's mark (an opt-in; the ambient demo's node proxy is known by
		// its cgroup instead).
		"--proxy-mark", "0x539")
	startAgent := func() *harness.Process {
		p := harness.StartProcess(t, harness.ProcessOptions{Path: bins.Path("mesh-agent"), Args: agentArgs, Name: "mesh-agent"})
		readyCtx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		if err := harness.WaitForHealthy(readyCtx, d.socket); err != nil {
			t.Fatalf("agent not ready: %v", err)
		}
		return p
	}

	say.step("The mesh agent installs itself into the CNI chain")
	agent := startAgent()
	conf, _, err := node.LoadConflist()
	if err != nil {
		t.Fatal(err)
	}
	say.say("mesh-agent is ready; the node's chain is now %s", pluginTypes(conf))
	if err := agent.Stop(ctx); err != nil {
		t.Fatalf("stop agent: %v", err)
	}
	say.say("mesh-agent stopped (as in an upgrade or a node reboot); the chain entry and the pinned eBPF data path stay in place")

	say.step("A pod starts while the agent is away: the gate holds it")
	server := node.NewPod(t, "shop", "server")
	type added struct {
		err error
		at  time.Time
	}
	serverDone := make(chan added, 1)
	addStart := time.Now()
	go func() {
		_, err := node.Add(ctx, server, conf)
		serverDone <- added{err, time.Now()}
	}()
	for i := 0; i < 3; i++ {
		select {
		case r := <-serverDone:
			t.Fatalf("pod was admitted with no agent running: %v", r.err)
		case <-time.After(time.Second):
			say.say("pod shop/server: network set up by the bridge plugin, still held at the mesh-cni gate (%.0fs)", time.Since(addStart).Seconds())
		}
	}
	say.say("starting mesh-agent again")
	started := time.Now()
	agent = startAgent()
	r := <-serverDone
	if r.err != nil {
		t.Fatalf("ADD after the agent started: %v", r.err)
	}
	_ = agent
	say.say("pod shop/server admitted %v after the agent process was started (it loads its pinned data path, reconciles, becomes ready, then enrolls the pod)",
		r.at.Sub(started).Round(time.Millisecond))

	say.step("Two meshed pods, each with a proxy")
	client := node.NewPod(t, "shop", "client")
	if _, err := node.Add(ctx, client, conf); err != nil {
		t.Fatal(err)
	}
	outsider := node.NewPod(t, "kube-system", "outsider")
	if _, err := node.Add(ctx, outsider, conf); err != nil {
		t.Fatal(err)
	}
	say.say("shop/client %s, shop/server %s: enrolled; kube-system/outsider %s: out of the mesh (excluded namespace)",
		client.IPv4(t), server.IPv4(t), outsider.IPv4(t))
	_, clientRecords := client.StartRefproxy(ctx, t)
	_, serverRecords := server.StartRefproxy(ctx, t)
	say.say("the reference proxy listens inside each meshed pod on 127.0.0.1:15001 (outbound) and :15006 (inbound)")
	seen := serveGreeting(t, server)
	target := netip.AddrPortFrom(server.IPv4(t), 8080)

	say.step("shop/client calls shop/server")
	reply, err := request(ctx, client, target)
	if err != nil {
		t.Fatal(err)
	}
	say.say("client sent \"hello\" to %s and got %q", target, reply)
	outRecs := proxy.AwaitRecords(ctx, t, clientRecords, 1)
	inRecs := proxy.AwaitRecords(ctx, t, serverRecords, 1)
	say.say("client's proxy (outbound): from %s, original destination %s (recovered with %s)", outRecs[0].Client, outRecs[0].OriginalDst, outRecs[0].DstSource)
	say.say("server's proxy (inbound):  from %s, original destination %s (recovered with %s)", inRecs[0].Client, inRecs[0].OriginalDst, inRecs[0].DstSource)
	say.say("the server application saw the connection coming from %s: its own proxy, not the client", seen()[0])
	if outRecs[0].OriginalDst.Addr().Unmap() != target.Addr() || inRecs[0].OriginalDst.Addr().Unmap() != target.Addr() {
		t.Fatalf("proxies recorded the wrong destination: %+v %+v", outRecs[0], inRecs[0])
	}

	say.step("kube-system/outsider calls the same server on an excluded port, and a port-8080 call goes only through the server's proxy")
	excluded := serveGreetingOn(t, server, 15020)
	if _, err := request(ctx, outsider, netip.AddrPortFrom(server.IPv4(t), 15020)); err != nil {
		t.Fatal(err)
	}
	say.say("outsider -> server:15020 (a proxy port, excluded): the server saw %s directly; no proxy was involved", excluded()[0])
	if _, err := request(ctx, outsider, target); err != nil {
		t.Fatal(err)
	}
	outAfter := proxy.MustReadRecords(t, clientRecords)
	inAfter := proxy.AwaitRecords(ctx, t, serverRecords, 2)
	say.say("outsider -> server:8080: the outsider has no redirection (client proxy still has %d record), the server's inbound proxy took it (%d records)", len(outAfter), len(inAfter))
	if len(outAfter) != 1 {
		t.Fatalf("the outsider's connection went through the client's proxy")
	}

	say.step("Clean up")
	for _, p := range []*harness.Pod{client, server, outsider} {
		if err := node.Del(ctx, p, conf); err != nil {
			t.Fatal(err)
		}
	}
	say.say("pods deleted; mesh-agent uninstall restores the primary config and removes the data path")
}

func pluginTypes(l *libcni.NetworkConfigList) string {
	types := make([]string, len(l.Plugins))
	for i, p := range l.Plugins {
		types[i] = p.Network.Type
	}
	return "[" + strings.Join(types, ", ") + "]"
}

func serveGreeting(t *testing.T, p *harness.Pod) func() []string { return serveGreetingOn(t, p, 8080) }

// serveGreetingOn answers each connection with a greeting and remembers the
// client addresses it saw.
func serveGreetingOn(t *testing.T, p *harness.Pod, port int) func() []string {
	ln := p.Listen(t, "tcp", fmt.Sprintf("[::]:%d", port))
	clients := make(chan string, 64)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			ap := netip.MustParseAddrPort(c.RemoteAddr().String())
			clients <- ap.Addr().Unmap().String()
			go func() {
				defer c.Close()
				buf := make([]byte, 64)
				n, _ := c.Read(buf)
				fmt.Fprintf(c, "hi from %s/%s, you said %s", p.Namespace, p.Name, bytes.TrimSpace(buf[:n]))
			}()
		}
	}()
	var seen []string
	return func() []string {
		for {
			select {
			case c := <-clients:
				seen = append(seen, c)
			default:
				return seen
			}
		}
	}
}

func request(ctx context.Context, p *harness.Pod, target netip.AddrPort) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	c, err := p.Dial(ctx, "tcp", target.String())
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, "hello"); err != nil {
		return "", err
	}
	c.(*net.TCPConn).CloseWrite()
	out, err := io.ReadAll(c)
	return string(out), err
}
