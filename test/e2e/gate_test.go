package e2e

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"
	types100 "github.com/containernetworking/cni/pkg/types/100"

	"github.com/mesh-cni/mesh-cni/internal/cniplugin"
	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// TestBadInput's non-root caller, and the mode it opens the gate socket and
// its directories up to: the agent refuses the caller by its credentials.
const (
	nobodyUID      = 65534
	openSocketMode = 0o777
)

func cniCode(t testing.TB, err error) *types.Error {
	t.Helper()
	var cniErr *types.Error
	if !errors.As(err, &cniErr) {
		t.Fatalf("error %v is not a CNI error", err)
	}
	return cniErr
}

// TestAddWaitsForAgent is the gate's promise: with no agent, a pod's ADD is held
// after the primary plugin has done its work, and it completes soon after the
// agent becomes ready, with the primary plugin's result unchanged.
func TestAddWaitsForAgent(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	a := newAgent(t, "--datapath=none")
	node := meshNode(t)
	list := chain(t, node, a, "60s")
	pod := node.NewPod(t, "shop", "cart")

	type addResult struct {
		res types.Result
		err error
		at  time.Time
	}
	done := make(chan addResult, 1)
	go func() {
		res, err := node.Add(ctx, pod, list)
		done <- addResult{res, err, time.Now()}
	}()

	// The bridge plugin has run once eth0 exists in the pod; from then on only
	// the gate holds the ADD.
	fixtures.WaitFor(t, 30*time.Second, "bridge plugin to create eth0 in the pod", func() bool {
		return netns.Do(pod.NetNSPath, func() error { _, err := net.InterfaceByName("eth0"); return err }) == nil
	})
	select {
	case r := <-done:
		t.Fatalf("ADD completed with no agent running: %v", r.err)
	case <-time.After(2 * time.Second):
	}

	a.start(ctx)
	ready := time.Now()
	r := <-done
	if r.err != nil {
		t.Fatalf("ADD after the agent started: %v", r.err)
	}
	latency := r.at.Sub(ready)
	t.Logf("ADD completed %v after the agent reported ready", latency)
	if latency > time.Second {
		t.Errorf("ADD completed %v after the agent became ready, want within 1s", latency)
	}

	res, err := types100.GetResult(r.res)
	if err != nil {
		t.Fatal(err)
	}
	assertResultMatchesPod(t, res, pod)

	enrolled := a.list(ctx).GetEnrollments()
	if len(enrolled) != 1 {
		t.Fatalf("agent has %d enrollments, want 1", len(enrolled))
	}
	e := enrolled[0]
	if e.GetPod().GetNamespace() != "shop" || e.GetPod().GetName() != "cart" || e.GetPod().GetUid() != pod.UID ||
		e.GetAttachment().GetContainerId() != pod.ContainerID || e.GetNetnsPath() != pod.NetNSPath {
		t.Fatalf("enrollment %v does not describe the pod", e)
	}
	cookie, err := netns.Cookie(pod.NetNSPath)
	if err != nil || e.GetNetnsCookie() != cookie {
		t.Fatalf("enrollment netns cookie %d, pod's is %d (%v)", e.GetNetnsCookie(), cookie, err)
	}

	// The plugin passes prevResult through: fed the final result as prevResult,
	// it prints the same result back.
	stdin, err := json.Marshal(map[string]any{
		"cniVersion": "1.1.0", "name": "meshnet", "type": "mesh-cni",
		"socketPath": a.Socket, "gateTimeout": "10s", "prevResult": res,
	})
	if err != nil {
		t.Fatal(err)
	}
	out, cniErr := pluginCall{Command: "ADD", ContainerID: pod.ContainerID, Netns: pod.NetNSPath, IfName: "eth0",
		Args: argsString(pod.CNIArgs()), Stdin: stdin}.run(ctx, t)
	if cniErr != nil {
		t.Fatalf("direct ADD: %v", cniErr)
	}
	var echoed, want any
	wantJSON, _ := json.Marshal(res)
	if err := json.Unmarshal(out, &echoed); err != nil {
		t.Fatalf("plugin output is not JSON: %v: %s", err, out)
	}
	_ = json.Unmarshal(wantJSON, &want)
	if !reflect.DeepEqual(echoed, want) {
		t.Fatalf("plugin changed the result:\n got %s\nwant %s", out, wantJSON)
	}
}

// assertResultMatchesPod checks the chain's result against the pod's real
// interface: it is the bridge plugin's result.
func assertResultMatchesPod(t *testing.T, res *types100.Result, pod *harness.Pod) {
	t.Helper()
	var sandboxIf *types100.Interface
	idx := -1
	for i, iface := range res.Interfaces {
		if iface.Sandbox == pod.NetNSPath {
			sandboxIf, idx = iface, i
		}
	}
	if sandboxIf == nil || sandboxIf.Name != "eth0" {
		t.Fatalf("result has no eth0 in the pod's sandbox: %+v", res.Interfaces)
	}
	mac, addrs := interfaceState(t, pod, "eth0")
	if sandboxIf.Mac != mac {
		t.Fatalf("result MAC %s, pod's eth0 has %s", sandboxIf.Mac, mac)
	}
	var v4, v6 int
	for _, ip := range res.IPs {
		if ip.Interface == nil || *ip.Interface != idx {
			t.Fatalf("result IP %s not on the pod interface", ip.Address.String())
		}
		found := false
		for _, a := range addrs {
			if a == ip.Address.String() {
				found = true
			}
		}
		if !found {
			t.Fatalf("result IP %s is not on the pod's eth0 (%v)", ip.Address.String(), addrs)
		}
		if ip.Address.IP.To4() != nil {
			v4++
			if ip.Gateway == nil {
				t.Fatalf("IPv4 result without the bridge gateway: %+v", ip)
			}
		} else {
			v6++
		}
	}
	if v4 != 1 || v6 != 1 {
		t.Fatalf("result has %d IPv4 and %d IPv6 addresses, want dual-stack", v4, v6)
	}
	if len(res.Routes) == 0 {
		t.Fatal("result has no routes (the bridge's default route is missing)")
	}
}

func argsString(args [][2]string) string {
	parts := make([]string, len(args))
	for i, kv := range args {
		parts[i] = kv[0] + "=" + kv[1]
	}
	return strings.Join(parts, ";")
}

// TestAddTimesOutWithoutAgent: no agent ever comes, and ADD fails after the
// configured gateTimeout with "try again later" and a message naming the socket.
func TestAddTimesOutWithoutAgent(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	a := newAgent(t)
	node := meshNode(t)
	list := chain(t, node, a, "2s")
	pod := node.NewPod(t, "shop", "cart")

	start := time.Now()
	_, err := node.Add(ctx, pod, list)
	if err == nil {
		t.Fatal("ADD succeeded with no agent")
	}
	took := time.Since(start)
	cniErr := cniCode(t, err)
	if cniErr.Code != types.ErrTryAgainLater {
		t.Fatalf("error code %d, want %d (try again later): %v", cniErr.Code, types.ErrTryAgainLater, cniErr)
	}
	if !strings.Contains(cniErr.Msg, a.Socket) || !strings.Contains(cniErr.Msg, "not ready") {
		t.Fatalf("message %q should name the socket %s and say the agent is not ready", cniErr.Msg, a.Socket)
	}
	if took < 2*time.Second {
		t.Fatalf("ADD failed after %v, before the 2s gateTimeout", took)
	}
}

// TestExcludedNamespacePassesThrough: kube-system pods never wait for the agent.
func TestExcludedNamespacePassesThrough(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	a := newAgent(t)
	node := meshNode(t)
	list := chain(t, node, a, "5m")
	pod := node.NewPod(t, "kube-system", "coredns")
	start := time.Now()
	res, err := node.Add(ctx, pod, list)
	if err != nil {
		t.Fatalf("ADD of an excluded pod with no agent: %v", err)
	}
	if took := time.Since(start); took > time.Minute {
		t.Fatalf("excluded pod took %v: it waited for the agent", took)
	}
	r, err := types100.GetResult(res)
	if err != nil {
		t.Fatal(err)
	}
	assertResultMatchesPod(t, r, pod)
	if err := node.Del(ctx, pod, list); err != nil {
		t.Fatalf("DEL of an excluded pod with no agent: %v", err)
	}
}

// TestDelCheckGCStatus drives the other CNI verbs through libcni with the agent
// down and up.
func TestDelCheckGCStatus(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	a := newAgent(t, "--datapath=none")
	node := meshNode(t)
	list := chain(t, node, a, "30s")

	// Agent down: STATUS still succeeds, so the node's network stays ready
	// (pods wait at the gate instead); DEL succeeds too.
	if err := node.Status(ctx, list); err != nil {
		t.Fatalf("STATUS with no agent: %v; an absent agent must not make the node NotReady", err)
	}
	ghost := node.NewPod(t, "shop", "ghost")
	for i := 0; i < 2; i++ {
		if err := node.Del(ctx, ghost, list); err != nil {
			t.Fatalf("DEL #%d with the agent down: %v", i+1, err)
		}
	}

	a.start(ctx)
	if err := node.Status(ctx, list); err != nil {
		t.Fatalf("STATUS with a ready agent: %v", err)
	}
	pods := map[string]*harness.Pod{}
	for _, name := range []string{"keep", "stale", "uncached"} {
		p := node.NewPod(t, "shop", name)
		if _, err := node.Add(ctx, p, list); err != nil {
			t.Fatalf("ADD %s: %v", name, err)
		}
		pods[name] = p
	}
	if err := node.Check(ctx, pods["keep"], list); err != nil {
		t.Fatalf("CHECK of an enrolled pod: %v", err)
	}

	// The runtime forgot "uncached" (its libcni cache entry is lost), so only the
	// plugin's GC, which forwards the valid list to the agent, can release it.
	removeCacheFor(t, node.CacheDir, pods["uncached"].ContainerID)
	if err := node.GC(ctx, list, []types.GCAttachment{pods["keep"].Attachment()}); err != nil {
		t.Fatalf("GC: %v", err)
	}
	got := a.list(ctx).GetEnrollments()
	if len(got) != 1 || got[0].GetAttachment().GetContainerId() != pods["keep"].ContainerID {
		t.Fatalf("after GC the agent holds %v, want only pod keep", got)
	}

	// The early key name of the valid list works too.
	gcConf, _ := json.Marshal(map[string]any{
		"cniVersion": "1.1.0", "name": "meshnet", "type": "mesh-cni", "socketPath": a.Socket,
		"cni.dev/attachments": []map[string]string{},
	})
	if _, cniErr := (pluginCall{Command: "GC", Stdin: gcConf}).run(ctx, t); cniErr != nil {
		t.Fatalf("GC with cni.dev/attachments: %v", cniErr)
	}
	if n := len(a.list(ctx).GetEnrollments()); n != 0 {
		t.Fatalf("GC with an empty cni.dev/attachments list left %d enrollments", n)
	}
	// CHECK of a pod the agent no longer holds fails and says so.
	err := node.Check(ctx, pods["keep"], list)
	if err == nil {
		t.Fatal("CHECK passed for a pod the agent released")
	}
	if c := cniCode(t, err); c.Code != 103 {
		t.Fatalf("CHECK of a released pod: code %d (%v), want 103", c.Code, c)
	}

	// DEL with the agent down, twice, succeeds.
	a.stop(ctx)
	for i := 0; i < 2; i++ {
		if err := node.Del(ctx, pods["keep"], list); err != nil {
			t.Fatalf("DEL #%d with the agent stopped: %v", i+1, err)
		}
	}
}

func removeCacheFor(t *testing.T, dir, containerID string) {
	t.Helper()
	removed := 0
	err := filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() && strings.Contains(filepath.Base(path), containerID) {
			removed++
			return os.Remove(path)
		}
		return err
	})
	if err != nil || removed == 0 {
		t.Fatalf("remove libcni cache of %s: removed %d files, %v", containerID, removed, err)
	}
}

// TestBadInput: every kind of broken input gets a clear CNI error with the
// right code, and the agent is left holding nothing.
func TestBadInput(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	a := newAgent(t, "--datapath=none")
	a.start(ctx)
	node := meshNode(t)
	pod := node.NewPod(t, "shop", "cart")
	notNetns := filepath.Join(t.TempDir(), "plain-file")
	if err := os.WriteFile(notNetns, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	prev := map[string]any{"cniVersion": "1.1.0", "interfaces": []map[string]any{{"name": "eth0", "sandbox": pod.NetNSPath}},
		"ips": []map[string]any{{"address": "10.9.0.5/24", "interface": 0}}}
	conf := func(extra map[string]any) []byte {
		m := map[string]any{"cniVersion": "1.1.0", "name": "meshnet", "type": "mesh-cni", "socketPath": a.Socket, "gateTimeout": "5s", "prevResult": prev}
		for k, v := range extra {
			if v == nil {
				delete(m, k)
			} else {
				m[k] = v
			}
		}
		b, _ := json.Marshal(m)
		return b
	}
	goodArgs := argsString(pod.CNIArgs())
	nobody := &syscall.Credential{Uid: nobodyUID, Gid: nobodyUID}

	tests := []struct {
		name string
		call pluginCall
		code uint
		msg  string
	}{
		{"malformed json", pluginCall{Stdin: []byte(`{"cniVersion":"1.1.0","name":`)}, types.ErrDecodingFailure, "network config"},
		{"bad gateTimeout", pluginCall{Stdin: conf(map[string]any{"gateTimeout": "forever"})}, types.ErrInvalidNetworkConfig, "duration"},
		{"gateTimeout not a string", pluginCall{Stdin: conf(map[string]any{"gateTimeout": 30})}, types.ErrInvalidNetworkConfig, "duration"},
		{"gateTimeout over the limit", pluginCall{Stdin: conf(map[string]any{"gateTimeout": "1000h"})}, types.ErrInvalidNetworkConfig, "longer than the limit"},
		{"delTimeout over the limit", pluginCall{Stdin: conf(map[string]any{"delTimeout": "1h"})}, types.ErrInvalidNetworkConfig, "longer than the limit"},
		{"missing CNI_ARGS", pluginCall{Args: "-"}, types.ErrInvalidEnvironmentVariables, "K8S_POD_NAMESPACE"},
		{"garbage CNI_ARGS", pluginCall{Args: "this is not;key=value"}, types.ErrInvalidEnvironmentVariables, "KEY=VALUE"},
		{"missing netns", pluginCall{Netns: "/run/netns/mesh-e2e-does-not-exist"}, types.ErrInvalidNetNS, "not a network namespace"},
		{"netns is a plain file", pluginCall{Netns: notNetns}, types.ErrInvalidNetNS, "not a network namespace"},
		{"missing prevResult", pluginCall{Stdin: conf(map[string]any{"prevResult": nil})}, types.ErrInvalidNetworkConfig, "prevResult"},
		{"non-root caller", pluginCall{Credential: nobody}, cniplugin.ErrGateRefused, "no permission"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := tt.call
			c.Command = "ADD"
			c.ContainerID = "c0ffee"
			c.IfName = "eth0"
			if c.Netns == "" {
				c.Netns = pod.NetNSPath
			}
			switch c.Args {
			case "":
				c.Args = goodArgs
			case "-":
				c.Args = ""
			}
			if c.Stdin == nil {
				c.Stdin = conf(nil)
			}
			_, cniErr := c.run(ctx, t)
			if cniErr == nil {
				t.Fatal("ADD succeeded")
			}
			if cniErr.Code != tt.code || !strings.Contains(cniErr.Msg+cniErr.Details, tt.msg) {
				t.Fatalf("got code %d %q (%s), want code %d mentioning %q", cniErr.Code, cniErr.Msg, cniErr.Details, tt.code, tt.msg)
			}
		})
	}

	// SO_PEERCRED: even with the socket opened up on the filesystem, a non-root
	// peer is refused by the agent itself.
	t.Run("non-root peer on an open socket", func(t *testing.T) {
		for _, p := range []string{filepath.Dir(filepath.Dir(a.Socket)), filepath.Dir(a.Socket), a.Socket} {
			if err := os.Chmod(p, openSocketMode); err != nil {
				t.Fatal(err)
			}
		}
		_, cniErr := pluginCall{Command: "ADD", ContainerID: "c0ffee", IfName: "eth0", Netns: pod.NetNSPath,
			Args: goodArgs, Stdin: conf(nil), Credential: nobody}.run(ctx, t)
		if cniErr == nil || cniErr.Code != cniplugin.ErrGateRefused || !strings.Contains(cniErr.Details, fmt.Sprintf("uid %d", nobodyUID)) {
			t.Fatalf("non-root peer: %v, want code %d naming uid %d", cniErr, cniplugin.ErrGateRefused, nobodyUID)
		}
	})

	if n := len(a.list(ctx).GetEnrollments()); n != 0 {
		t.Fatalf("bad input left %d enrollments in the agent", n)
	}
}

// TestConcurrentPods: 50 pods through the chain at once, each enrolled exactly
// once; all deleted leaves the agent empty.
func TestConcurrentPods(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	a, node, list := meshedNode(ctx, t, "60s", "--datapath=none")
	const n = 50
	pods := make([]*harness.Pod, n)
	for i := range pods {
		pods[i] = node.NewPod(t, "load", fmt.Sprintf("pod-%d", i))
	}
	run := func(op func(*harness.Pod) error) []error {
		var wg sync.WaitGroup
		errs := make([]error, n)
		for i, p := range pods {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs[i] = op(p)
			}()
		}
		wg.Wait()
		return errs
	}
	for i, err := range run(func(p *harness.Pod) error { _, err := node.Add(ctx, p, list); return err }) {
		if err != nil {
			t.Errorf("ADD pod-%d: %v", i, err)
		}
	}
	if t.Failed() {
		a.diagnoseSocket(t, node)
	}
	if t.Failed() {
		t.FailNow()
	}
	seen := map[string]int{}
	for _, e := range a.list(ctx).GetEnrollments() {
		seen[e.GetAttachment().GetContainerId()]++
	}
	for i, p := range pods {
		if seen[p.ContainerID] != 1 {
			t.Errorf("pod-%d is enrolled %d times", i, seen[p.ContainerID])
		}
	}
	if len(seen) != n {
		t.Errorf("agent holds %d attachments, want %d", len(seen), n)
	}
	for i, err := range run(func(p *harness.Pod) error { return node.Del(ctx, p, list) }) {
		if err != nil {
			t.Errorf("DEL pod-%d: %v", i, err)
		}
	}
	if left := len(a.list(ctx).GetEnrollments()); left != 0 {
		t.Fatalf("after deleting every pod the agent holds %d enrollments", left)
	}
}
