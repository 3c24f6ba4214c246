package e2e

import (
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/proxy"
)

// agentCapabilities is the set the agent needs, as SECURITY.md says: sys_admin for
// setns into pods and mounting bpffs, which the kernel also accepts for the BPF
// checks CAP_BPF and CAP_PERFMON would pass (so those add nothing); net_admin for
// the reply route in each pod's namespace (rtnetlink and the net sysctls check for
// it alone); and sys_ptrace to take a descriptor of a proxy's listener from its
// process. Without any of them the test fails (each dropped in turn: an ADD fails
// without net_admin).
func agentCapabilities() []string { return []string{"sys_admin", "net_admin", "sys_ptrace"} }

// TestAgentWithLeastCapabilities runs the real agent, and its uninstall, with only
// agentCapabilities in its bounding set (so a root process has no other): pods held
// at the gate until it is ready and enrolled, proxies that were listening before
// their pods were enrolled captured, traffic through both proxies over IPv4 and
// IPv6, DEL, and an uninstall that leaves no pins. (The chain-entry installer is
// off here; it writes only root-owned files.)
func TestAgentWithLeastCapabilities(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	setpriv := []string{"setpriv", "--bounding-set=-all,+" + strings.Join(agentCapabilities(), ",+"), "--"}
	a := newAgent(t)
	a.Wrapper = setpriv
	node := meshNode(t)
	list := chain(t, node, a, "30s")

	// Both pods are added before the agent starts, and held at the gate; their
	// proxies start listening meanwhile, so the agent has to take the inbound
	// listeners from the proxies' processes when it enrolls the pods.
	client := &meshPod{Pod: node.NewPod(t, "shop", "caps-client")}
	srv := &meshPod{Pod: node.NewPod(t, "shop", "caps-server")}
	held := make(chan error, 2)
	for _, p := range []*meshPod{client, srv} {
		go func() {
			_, err := node.Add(ctx, p.Pod, list)
			held <- err
		}()
	}
	client.startProxy(ctx, t)
	srv.startProxy(ctx, t)
	a.start(ctx)
	for range 2 {
		if err := <-held; err != nil {
			t.Fatalf("ADD held at the gate: %v", err)
		}
	}
	if got, want := capEff(t, a.Proc.Pid()), capMask(t, agentCapabilities()); got != want {
		t.Fatalf("the agent runs with capabilities %#x, want exactly %#x", got, want)
	}

	srv.ServeEcho(t, 8080)
	for i, dst := range []netip.Addr{srv.IPv4(t), srv.IPv6(t)} {
		target := netip.AddrPortFrom(dst, 8080)
		if err := client.EchoRoundTrip(ctx, target, []byte("least privilege")); err != nil {
			t.Fatalf("client -> %s: %v", target, err)
		}
		if in := proxy.AwaitRecords(ctx, t, srv.records, i+1)[i]; in.Direction != "inbound" || !sameAddrPort(in.OriginalDst, target) {
			t.Fatalf("server proxy record %+v, want inbound to %s", in, target)
		}
	}
	if err := node.Del(ctx, srv.Pod, list); err != nil {
		t.Fatalf("DEL: %v", err)
	}
	a.stop(ctx)

	// The product's uninstall, with the same capabilities.
	args := append(setpriv, harness.Bins(t).Path("mesh-agent"), "uninstall", "--bpffs-root", a.BPFFS, "--cni-install=false", "--log-level", "warn")
	if out, err := exec.CommandContext(ctx, args[0], args[1:]...).CombinedOutput(); err != nil {
		t.Fatalf("uninstall with the agent's capabilities: %v\n%s", err, out)
	}
	if _, err := os.Stat(a.BPFFS); !os.IsNotExist(err) {
		t.Fatalf("pins left after uninstall: %v", err)
	}
}

// capEff is a process's effective capability set.
func capEff(t *testing.T, pid int) uint64 {
	t.Helper()
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(status), "\n") {
		if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			n, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatalf("no CapEff in /proc/%d/status", pid)
	return 0
}

func capMask(t *testing.T, names []string) uint64 {
	t.Helper()
	bits := map[string]int{"bpf": unix.CAP_BPF, "perfmon": unix.CAP_PERFMON, "net_admin": unix.CAP_NET_ADMIN,
		"sys_admin": unix.CAP_SYS_ADMIN, "sys_ptrace": unix.CAP_SYS_PTRACE}
	var m uint64
	for _, n := range names {
		b, ok := bits[n]
		if !ok {
			t.Fatalf("unknown capability %s", n)
		}
		m |= 1 << b
	}
	return m
}
