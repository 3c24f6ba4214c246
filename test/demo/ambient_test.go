package demo

import (
	"context"
	"encoding/json"
	"net/netip"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/proxy"
)

// TestDemoAmbient is `make demo-ambient`: the same simulated node, but no proxy
// inside any pod. One node proxy process (the reference proxy in ztunnel's
// role) runs in the node's own namespace and takes the pods from the agent's
// ZDS socket, opening its listeners inside each pod's network namespace.
func TestDemoAmbient(t *testing.T) {
	ctx := fixtures.Context(t, 5*time.Minute)
	d := newDemo(t)
	say, node, bins := d.say, d.node, d.bins
	zdsSocket := filepath.Join(d.dir, "ztunnel", "ztunnel.sock")

	say.step("The mesh agent installs itself into the CNI chain and opens its ZDS socket")
	agentArgs := append(d.agentArgs(), "--gate-timeout", "1m", "--zds-socket", zdsSocket, "--zds-without-service-accounts")
	harness.StartProcess(t, harness.ProcessOptions{Path: bins.Path("mesh-agent"), Args: agentArgs, Name: "mesh-agent"})
	readyCtx, cancelReady := context.WithTimeout(ctx, time.Minute)
	err := harness.WaitForHealthy(readyCtx, d.socket)
	cancelReady()
	if err != nil {
		t.Fatalf("agent not ready: %v", err)
	}
	conf, _, err := node.LoadConflist()
	if err != nil {
		t.Fatal(err)
	}
	say.say("mesh-agent is ready; the node's chain is now %s", pluginTypes(conf))
	say.say("it serves ZDS, the protocol ztunnel speaks, on %s", zdsSocket)

	say.step("One node proxy for the whole node, instead of a proxy in every pod")
	records := filepath.Join(t.TempDir(), "node-proxy.jsonl")
	nodeProxy := harness.StartProcess(t, harness.ProcessOptions{
		Path: bins.Path("refproxy"), Args: []string{"-zds", zdsSocket, "-record", records}, Name: "node-proxy",
		// In a cgroup of its own, as ztunnel's container: the agent knows the node
		// proxy by the cgroup of the process that connected to its ZDS socket.
		OwnCgroup: true,
	})
	readyCtx, cancelReady = context.WithTimeout(ctx, 30*time.Second)
	_, err = nodeProxy.WaitForLine(readyCtx, "ready")
	cancelReady()
	if err != nil {
		t.Fatal(err)
	}
	say.say("the node proxy (pid %d) runs in the node's own network namespace, in no pod", nodeProxy.Pid())
	say.say("it connected to the agent's ZDS socket and received its first snapshot: no pods yet")

	say.step("Two pods start; the agent hands each to the node proxy")
	server := node.NewPod(t, "shop", "server")
	client := node.NewPod(t, "shop", "client")
	names := map[string]string{}
	for _, p := range []*harness.Pod{server, client} {
		names[p.UID] = p.Namespace + "/" + p.Name
		if _, err := node.Add(ctx, p, conf); err != nil {
			t.Fatal(err)
		}
		say.say("pod %s (%s) admitted: enrolled in eBPF redirection, then its network namespace was sent to the node proxy over ZDS;"+
			" the ADD returned only once the proxy acked it", names[p.UID], p.IPv4(t))
		addrs := listenersOf(ctx, t, nodeProxy, p)
		say.say("the node proxy received %s and opened listeners inside it: %s", names[p.UID], strings.Join(addrs, ", "))
		socks := socketsInPod(ctx, t, p, nodeProxy.Pid())
		if len(socks) != len(addrs) {
			t.Fatalf("ss shows the node proxy listening on %v inside %s, its log says %v", socks, p.Name, addrs)
		}
		say.say("ss run inside %s's namespace shows them: %s, owned by pid %d, the node proxy outside the pod",
			names[p.UID], strings.Join(socks, ", "), nodeProxy.Pid())
	}
	seen := serveGreeting(t, server)
	target := netip.AddrPortFrom(server.IPv4(t), 8080)
	say.say("shop/server's application listens on :8080; neither pod runs a proxy of its own")

	say.step("shop/client calls shop/server")
	reply, err := request(ctx, client, target)
	if err != nil {
		t.Fatal(err)
	}
	say.say("client sent \"hello\" to %s and got %q", target, reply)
	out, in := nodeProxyHops(ctx, t, records, client, server, target)
	say.say("node proxy, listener in %s (outbound): accepted from %s, original destination %s (recovered with %s)",
		names[out.Pod], out.Client, out.OriginalDst, out.DstSource)
	say.say("node proxy, listener in %s (inbound):  accepted from %s, original destination %s (recovered with %s)",
		names[in.Pod], in.Client, in.OriginalDst, in.DstSource)
	say.say("eBPF turned the client's connect to %s into one to the node proxy's listener at 127.0.0.1:15001 inside the client pod, and handed"+
		" the SYN arriving at the server pod to the listener at :15006 inside it", target)
	say.say("so the request went out through the client pod's listener and in through the server pod's listener of the one node proxy")
	say.say("the server application saw the connection coming from %s: the node proxy's connection from inside the server pod, not the client", seen()[0])
	if seen()[0] == client.IPv4(t).String() {
		t.Fatal("the server saw the client directly: the node proxy's inbound listener was bypassed")
	}

	say.step("Clean up")
	for _, p := range []*harness.Pod{client, server} {
		if err := node.Del(ctx, p, conf); err != nil {
			t.Fatal(err)
		}
		// DEL returns once the node proxy acked the removal, so its listeners
		// are closed by now (the namespace itself goes with the sandbox later).
		if left := socketsInPod(ctx, t, p, nodeProxy.Pid()); len(left) != 0 {
			t.Fatalf("listeners %v still open inside %s after its DEL", left, p.Name)
		}
		say.say("pod %s deleted: the agent released its redirection and told the node proxy over ZDS, which closed its listeners there", names[p.UID])
	}
	say.say("mesh-agent uninstall restores the primary config and removes the data path")
}

// listenersOf waits for the node proxy's log line that it serves p and returns
// the addresses it listens on inside p.
func listenersOf(ctx context.Context, t *testing.T, nodeProxy *harness.Process, p *harness.Pod) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	line, err := nodeProxy.WaitForLine(ctx, `"pod":"`+p.UID+`"`)
	if err != nil {
		t.Fatalf("node proxy never served %s: %v", p.Name, err)
	}
	var entry struct {
		Msg   string   `json:"msg"`
		Addrs []string `json:"addrs"`
	}
	if err := json.Unmarshal([]byte(line), &entry); err != nil || entry.Msg != "proxy listening" || len(entry.Addrs) == 0 {
		t.Fatalf("node proxy's first line about %s is not its listeners (%v): %s", p.Name, err, line)
	}
	return entry.Addrs
}

var ssUsers = regexp.MustCompile(`pid=(\d+)`)

// socketsInPod lists the TCP listeners inside p's network namespace that belong
// to the process pid, sorted.
func socketsInPod(ctx context.Context, t *testing.T, p *harness.Pod, pid int) []string {
	t.Helper()
	out, err := p.Exec(ctx, "ss", "-Hltnp")
	if err != nil {
		t.Fatal(err)
	}
	var addrs []string
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		fields := strings.Fields(line)
		if len(fields) < 5 {
			continue
		}
		if m := ssUsers.FindStringSubmatch(line); m == nil || m[1] != strconv.Itoa(pid) {
			continue
		}
		addrs = append(addrs, fields[3])
	}
	slices.Sort(addrs)
	return addrs
}

// nodeProxyHops waits for the node proxy's records of one connection to
// target: outbound in from's listener and inbound in to's.
func nodeProxyHops(ctx context.Context, t *testing.T, path string, from, to *harness.Pod, target netip.AddrPort) (out, in proxy.Record) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	var gotOut, gotIn bool
	_, err := proxy.WaitForRecords(ctx, path, func(recs []proxy.Record) bool {
		for _, r := range recs {
			if r.OriginalDst.Addr().Unmap() != target.Addr() || r.OriginalDst.Port() != target.Port() || r.Error != "" {
				continue
			}
			switch {
			case r.Direction == proxy.Outbound && r.Pod == from.UID:
				out, gotOut = r, true
			case r.Direction == proxy.Inbound && r.Pod == to.UID:
				in, gotIn = r, true
			}
		}
		return gotOut && gotIn
	})
	if err != nil {
		t.Fatalf("node proxy records of %s -> %s (outbound in %s, inbound in %s): %v", from.Name, target, from.Name, to.Name, err)
	}
	return out, in
}
