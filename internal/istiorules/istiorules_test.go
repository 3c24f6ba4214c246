package istiorules

import (
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// ipt runs an iptables-nft command (iptables or ip6tables by v6) in the
// namespace at path.
func ipt(t *testing.T, path string, v6 bool, args ...string) {
	t.Helper()
	bin := "iptables-nft"
	if v6 {
		bin = "ip6tables-nft"
	}
	out, err := exec.Command("nsenter", append([]string{"--net=" + path, bin}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %v: %v\n%s", bin, args, err, out)
	}
}

// save is the namespace's rules as iptables-nft-save prints them, without
// comments and counters.
func save(t *testing.T, path string, v6 bool) string {
	t.Helper()
	bin := "iptables-nft-save"
	if v6 {
		bin = "ip6tables-nft-save"
	}
	out, err := exec.Command("nsenter", "--net="+path, bin).CombinedOutput()
	if err != nil {
		t.Fatalf("%s: %v\n%s", bin, err, out)
	}
	var lines []string
	for l := range strings.Lines(string(out)) {
		if strings.HasPrefix(l, "#") {
			continue
		}
		lines = append(lines, strings.TrimSpace(l))
	}
	return strings.Join(lines, "\n")
}

func needTools(t *testing.T) {
	t.Helper()
	fixtures.RequireRoot(t, "network namespaces")
	for _, b := range []string{"nsenter", "iptables-nft", "ip6tables-nft", "iptables-nft-save", "ip6tables-nft-save"} {
		if _, err := exec.LookPath(b); err != nil {
			t.Skipf("%s not found: %v", b, err)
		}
	}
}

// istioShaped puts chains and entry rules of istio-cni's names and shape in
// the namespace, for both families, with one rule in each chain.
func istioShaped(t *testing.T, path string) {
	t.Helper()
	for _, v6 := range []bool{false, true} {
		for _, table := range tables {
			for base, chain := range entries {
				ipt(t, path, v6, "-t", table, "-N", chain)
				ipt(t, path, v6, "-t", table, "-A", base, "-j", chain)
				ipt(t, path, v6, "-t", table, "-A", chain, "-p", "tcp", "-m", "mark", "!", "--mark", "0x539/0xfff", "-j", "RETURN")
			}
		}
		ipt(t, path, v6, "-t", "nat", "-A", ChainOutput, "-p", "tcp", "-j", "REDIRECT", "--to-ports", "15001")
	}
}

func open(t *testing.T, path string) *os.File {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

func TestRemove(t *testing.T) {
	needTools(t)
	ns := fixtures.NewNetns(t, filepath.Join(t.TempDir(), "pod"))
	istioShaped(t, ns.Path)
	// The pod's own: a chain and rules of other names stay.
	ipt(t, ns.Path, false, "-t", "nat", "-N", "ISTIO_OTHER")
	ipt(t, ns.Path, false, "-t", "nat", "-A", "OUTPUT", "-p", "udp", "-j", "ISTIO_OTHER")
	ipt(t, ns.Path, false, "-t", "filter", "-A", "OUTPUT", "-p", "tcp", "--dport", "9", "-j", "DROP")
	before := save(t, ns.Path, false)

	f := open(t, ns.Path)
	res, err := Remove(f)
	if err != nil {
		t.Fatalf("Remove: %v", err)
	}
	if len(res.Jumps) != 12 || len(res.Chains) != 12 || len(res.Kept) != 0 {
		t.Errorf("removed %d entry rules and %d chains, kept %d; want 12, 12 and 0: %+v", len(res.Jumps), len(res.Chains), len(res.Kept), res)
	}
	for _, v6 := range []bool{false, true} {
		if got := save(t, ns.Path, v6); strings.Contains(got, "ISTIO_PRERT") || strings.Contains(got, "ISTIO_OUTPUT") {
			t.Errorf("istio-cni's chains left (v6 %v):\n%s", v6, got)
		}
	}
	after := save(t, ns.Path, false)
	for _, want := range []string{":ISTIO_OTHER", "-A OUTPUT -p udp -j ISTIO_OTHER", "-A OUTPUT -p tcp -m tcp --dport 9 -j DROP"} {
		if !strings.Contains(after, want) {
			t.Errorf("the pod's own %q is gone; before:\n%s\nafter:\n%s", want, before, after)
		}
	}

	// Again: nothing there, nothing done.
	res, err = Remove(f)
	if err != nil || res.Found() {
		t.Errorf("second Remove: %+v, %v; want nothing found and no error", res, err)
	}
}

// A pod's root made a rule jumping to ISTIO_OUTPUT under a match: that rule
// is not istio-cni's and stays, so does the chain, emptied of istio-cni's
// rules, and the error says so.
func TestRemoveKeepsForeignJump(t *testing.T) {
	needTools(t)
	ns := fixtures.NewNetns(t, filepath.Join(t.TempDir(), "pod"))
	istioShaped(t, ns.Path)
	ipt(t, ns.Path, false, "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "--dport", "9", "-j", ChainOutput)

	res, err := Remove(open(t, ns.Path))
	if err == nil || !strings.Contains(err.Error(), "ip nat ISTIO_OUTPUT emptied but kept") {
		t.Fatalf("Remove: %v; want the kept chain reported", err)
	}
	if !slices.Equal(res.Kept, []string{"ip nat ISTIO_OUTPUT"}) || len(res.Chains) != 11 {
		t.Errorf("result %+v; want ip nat ISTIO_OUTPUT kept, the 11 others removed", res)
	}
	got := save(t, ns.Path, false)
	for _, want := range []string{":ISTIO_OUTPUT", "-A OUTPUT -p tcp -m tcp --dport 9 -j ISTIO_OUTPUT"} {
		if !strings.Contains(got, want) {
			t.Errorf("%q gone:\n%s", want, got)
		}
	}
	if strings.Contains(got, "REDIRECT") || strings.Contains(got, "-A ISTIO_OUTPUT") {
		t.Errorf("istio-cni's rules left in the kept chain:\n%s", got)
	}
}

// A connection ztunnel delivered before the switch (connmark 0x111, given by
// mangle ISTIO_PRERT to packets of ztunnel's mark) keeps mangle
// ISTIO_OUTPUT, which restores its replies' mark, until it closes; every other
// chain goes at once, ISTIO_PRERT first, so no new connection gets the
// connmark.
func TestRemoveWaitsForMarkedConnections(t *testing.T) {
	needTools(t)
	ns := fixtures.NewNetns(t, filepath.Join(t.TempDir(), "pod"))
	istioShaped(t, ns.Path)
	ipt(t, ns.Path, false, "-t", "mangle", "-I", ChainPrerouting, "-m", "mark", "--mark", "0x539/0xfff", "-j", "CONNMARK", "--set-xmark", "0x111/0xfff")
	ipt(t, ns.Path, false, "-t", "mangle", "-I", ChainOutput, "-m", "connmark", "--mark", "0x111/0xfff", "-j", "CONNMARK", "--restore-mark", "--nfmask", "0xffffffff", "--ctmask", "0xffffffff")

	var ln net.Listener
	if err := netns.Do(ns.Path, func() error {
		var err error
		ln, err = net.Listen("tcp4", "127.0.0.1:15001") // where the nat chain redirects

		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil {
			accepted <- c
		}
	}()
	var c net.Conn
	if err := netns.Do(ns.Path, func() error {
		d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
			var serr error
			err := rc.Control(func(fd uintptr) { serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_MARK, 0x539) })
			return errors.Join(err, serr)
		}}
		var err error
		c, err = d.Dial("tcp4", ln.Addr().String())
		return err
	}); err != nil {
		t.Fatal(err)
	}
	server := <-accepted

	f := open(t, ns.Path)
	res, err := Remove(f)
	if err != nil {
		t.Fatalf("Remove: %v", err)
	}
	if !res.Pending() || len(res.Deferred) != 1 || !strings.HasPrefix(res.Deferred[0], "ip mangle ISTIO_OUTPUT (1 connections") {
		t.Fatalf("deferred %q; want ip mangle ISTIO_OUTPUT, for the one connection", res.Deferred)
	}
	if len(res.Chains) != 11 {
		t.Errorf("removed %v; want every chain but ip mangle ISTIO_OUTPUT", res.Chains)
	}
	got := save(t, ns.Path, false)
	if !strings.Contains(got, "-A OUTPUT -j ISTIO_OUTPUT") || strings.Contains(got, ChainPrerouting) {
		t.Errorf("want mangle OUTPUT's jump to ISTIO_OUTPUT alone left:\n%s", got)
	}

	c.Close()
	server.Close()
	poll := time.Now().Add(10 * time.Second)
	for {
		res, err = Remove(f)
		if err != nil {
			t.Fatalf("Remove after the close: %v", err)
		}
		if !res.Pending() {
			break
		}
		if time.Now().After(poll) {
			t.Fatalf("still deferred after the connection closed: %v", res.Deferred)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !slices.Equal(res.Chains, []string{"ip mangle ISTIO_OUTPUT"}) {
		t.Errorf("removed %v after the close; want ip mangle ISTIO_OUTPUT", res.Chains)
	}
	if got := save(t, ns.Path, false); strings.Contains(got, "ISTIO_") {
		t.Errorf("left:\n%s", got)
	}
}

// A namespace istio-cni never touched: nothing found, no error, unchanged.
func TestRemoveNothing(t *testing.T) {
	needTools(t)
	ns := fixtures.NewNetns(t, filepath.Join(t.TempDir(), "pod"))
	ipt(t, ns.Path, false, "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "--dport", "9", "-j", "RETURN")
	before := save(t, ns.Path, false)
	res, err := Remove(open(t, ns.Path))
	if err != nil || res.Found() {
		t.Errorf("Remove: %+v, %v; want nothing found and no error", res, err)
	}
	if after := save(t, ns.Path, false); after != before {
		t.Errorf("rules changed:\n%s\nwas:\n%s", after, before)
	}
}

// iptables-legacy tables are reported, not read.
func TestRemoveReportsLegacyTables(t *testing.T) {
	needTools(t)
	if _, err := exec.LookPath("iptables-legacy"); err != nil {
		t.Skipf("iptables-legacy not found: %v", err)
	}
	ns := fixtures.NewNetns(t, filepath.Join(t.TempDir(), "pod"))
	out, err := exec.Command("nsenter", "--net="+ns.Path, "iptables-legacy", "-t", "nat", "-N", ChainOutput).CombinedOutput()
	if err != nil {
		t.Fatalf("iptables-legacy: %v\n%s", err, out)
	}
	_, err = Remove(open(t, ns.Path))
	if !errors.Is(err, ErrLegacyTables) || !strings.Contains(err.Error(), "ip nat") {
		t.Errorf("Remove: %v; want ErrLegacyTables naming ip nat", err)
	}
}
