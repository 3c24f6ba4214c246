package redirect

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/link"
)

// testdata/splice-layout.o is the data path's object as the last build that
// could splice built it (the object beside gen.go before the splice was
// retired).
const spliceLayoutObject = "testdata/splice-layout.o"

// A node upgraded from a build that spliced: its splice switch, maps, read
// accounting link and pod flag are pinned beside this build's data path, and
// a proxy socket still sits in splice_targets. Opening this build turns the
// switch off, detaches the link, clears the flag and unpins every splice map
// but splice_targets, which moves to retired/ and goes at the first start
// after its last socket closed.
func TestRetireSplice(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	d, cfg := testDatapath(t)
	a, _ := newPodPair(t)
	e := enroll(t, d, a, testSettings())
	var v redirectPodSettings
	if err := d.objs.Pods.Lookup(e.Cookie, &v); err != nil {
		t.Fatal(err)
	}
	v.Flags |= retiredSpliceFlag
	if err := d.objs.Pods.Update(e.Cookie, v, ebpf.UpdateExist); err != nil {
		t.Fatal(err)
	}
	mapsDir, linksDir := d.pins.maps(), d.pins.links()
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}

	spec, err := ebpf.LoadCollectionSpec(spliceLayoutObject)
	if err != nil {
		t.Fatal(err)
	}
	old := map[string]*ebpf.Map{}
	for _, name := range append(retiredSpliceMaps(), retiredSpliceTargets) {
		m, err := ebpf.NewMap(spec.Maps[name])
		if err != nil {
			t.Fatalf("the earlier build's %s: %v", name, err)
		}
		t.Cleanup(func() { m.Close() })
		if err := m.Pin(filepath.Join(mapsDir, name)); err != nil {
			t.Fatal(err)
		}
		old[name] = m
	}
	on := make([]byte, old[retiredSpliceSwitch].ValueSize())
	on[0] = 1
	if err := old[retiredSpliceSwitch].Put(uint32(0), on); err != nil {
		t.Fatal(err)
	}
	// The read accounting, as the earlier build attached and pinned it: on
	// the sock_recv_length tracepoint (Linux 6.3 and later), else an fexit
	// program matching this kernel's tcp_bpf_recvmsg.
	prog := spec.Programs[earlierSpliceReader(t)]
	coll, err := ebpf.NewCollectionWithOptions(&ebpf.CollectionSpec{
		Maps:      map[string]*ebpf.MapSpec{"splice_flows": spec.Maps["splice_flows"], "splice_rx": spec.Maps["splice_rx"]},
		Programs:  map[string]*ebpf.ProgramSpec{prog.Name: prog},
		Variables: map[string]*ebpf.VariableSpec{},
		Types:     spec.Types,
		ByteOrder: spec.ByteOrder,
	}, ebpf.CollectionOptions{MapReplacements: map[string]*ebpf.Map{"splice_flows": old["splice_flows"], "splice_rx": old["splice_rx"]}})
	if err != nil {
		t.Fatalf("the earlier build's read accounting: %v", err)
	}
	l, err := link.AttachTracing(link.TracingOptions{Program: coll.Programs[prog.Name]})
	coll.Close()
	if err != nil {
		t.Fatal(err)
	}
	pin := filepath.Join(linksDir, retiredSpliceLink)
	if err := l.Pin(pin); err != nil {
		t.Fatal(err)
	}
	info, err := l.Info()
	if err != nil {
		t.Fatal(err)
	}
	l.Close()
	// A proxy's socket of a spliced connection, in splice_targets.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	client, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	server, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer server.Close()
	raw, err := client.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var putErr error
	key := make([]byte, old[retiredSpliceTargets].KeySize())
	if err := raw.Control(func(fd uintptr) { putErr = old[retiredSpliceTargets].Put(key, uint64(fd)) }); err != nil || putErr != nil {
		t.Fatalf("a socket into splice_targets: %v, %v", err, putErr)
	}

	d, err = Open(ctx, cfg)
	if err != nil {
		t.Fatalf("open over the splice's pins: %v", err)
	}
	t.Cleanup(func() { d.Close() })
	got := make([]byte, len(on))
	if err := old[retiredSpliceSwitch].Lookup(uint32(0), got); err != nil || got[0] != 0 {
		t.Errorf("the splice switch reads %v (%v), want off", got, err)
	}
	for _, name := range retiredSpliceMaps() {
		if _, err := os.Stat(filepath.Join(mapsDir, name)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("maps/%s still pinned (%v)", name, err)
		}
	}
	if _, err := os.Stat(pin); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("links/%s still pinned (%v)", retiredSpliceLink, err)
	}
	if l, err := link.NewFromID(info.ID); err == nil {
		l.Close()
		t.Errorf("the read accounting link %d still exists", info.ID)
	}
	if err := d.objs.Pods.Lookup(e.Cookie, &v); err != nil || v.Flags&retiredSpliceFlag != 0 {
		t.Errorf("pod %d: flags %#x (%v), want the splice flag cleared", e.Cookie, v.Flags, err)
	}
	targets := filepath.Join(d.pins.retired(), retiredSpliceTargets)
	if _, err := os.Stat(targets); err != nil {
		t.Errorf("%s unpinned while a proxy socket is in it: %v", retiredSpliceTargets, err)
	}

	// The proxy's connection closes: its socket leaves the map, and the next
	// start unpins it.
	client.Close()
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	d, err = Open(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	if _, err := os.Stat(targets); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s still pinned after its last socket closed (%v)", targets, err)
	}
}

// earlierSpliceReader names the earlier build's read accounting program for
// this kernel, chosen as that build chose it.
func earlierSpliceReader(t *testing.T) string {
	t.Helper()
	spec, err := btf.LoadKernelSpec()
	if err != nil {
		t.Fatalf("kernel BTF: %v", err)
	}
	var tp *btf.Typedef
	if spec.TypeByName("btf_trace_sock_recv_length", &tp) == nil {
		return "mesh_splice_read_tp"
	}
	var fn *btf.Func
	if err := spec.TypeByName("tcp_bpf_recvmsg", &fn); err != nil {
		t.Fatalf("neither the tracepoint nor tcp_bpf_recvmsg in the kernel's BTF: %v", err)
	}
	proto, ok := fn.Type.(*btf.FuncProto)
	if !ok {
		t.Fatalf("tcp_bpf_recvmsg has type %T", fn.Type)
	}
	// Its arguments: addr_len went in 6.18, nonblock in 5.19.
	name, ok := map[int]string{4: "mesh_splice_read_noaddr", 5: "mesh_splice_read", 6: "mesh_splice_read_nonblock"}[len(proto.Params)]
	if !ok {
		t.Fatalf("tcp_bpf_recvmsg takes %d arguments", len(proto.Params))
	}
	return name
}
