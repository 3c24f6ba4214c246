package redirect

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/features"
	"github.com/cilium/ebpf/link"
	"go.uber.org/zap"
)

// Splicing moves the bytes an application in an enrolled pod writes to its
// proxy straight into the proxy's socket (an sk_msg program redirecting to the
// proxy's socket's receive queue) instead of through loopback TCP; the
// direction into the application stays on TCP. bpf/redirect.c says what
// decides per connection. What the Go side owns:
//   - the sk_msg program, attached to the splice_socks sockhash, which sockops
//     fills with applications' sockets at establishment (a socket keeps the
//     program it was inserted with), the proxies' going to splice_targets;
//   - the read accounting, pinned as links/splice_read, without which every
//     connection goes to TCP after max_unread bytes and never comes back: a
//     program on the sock_recv_length tracepoint (Linux 6.3 and later), else
//     an fexit program on tcp_bpf_recvmsg;
//   - the switch in splice_node, turned on only once both are in place, and
//     off first when splicing stops: each spliced connection then goes to TCP
//     at its next write;
//   - each pod's choice (SETTING_SPLICE), and taking the applications'
//     sockets of a pod that no longer asks out of splice_socks.

// DefaultSpliceMaxUnread is how many spliced bytes a proxy may leave unread on
// one connection before its writes go through TCP, whose buffers push back on
// the writer, until the proxy has caught up: a redirect is charged to no
// socket buffer limit, so without the bound one pod could fill the node's TCP
// memory. 1 MiB is below what loopback TCP buffers by default (tcp_rmem's and
// tcp_wmem's maximums).
const DefaultSpliceMaxUnread = 1 << 20

const spliceReadLink = "splice_read"

// spliceTracepointReader is the read accounting on the sock_recv_length
// tracepoint, which attaches where function tracing (fexit) is refused.
const spliceTracepointReader = "mesh_splice_read_tp"

// Reader variants by tcp_bpf_recvmsg's argument count, for kernels without
// the tracepoint: it lost nonblock in Linux 5.19 and addr_len in 6.18.
var spliceReaders = map[int]string{
	4: "mesh_splice_read_noaddr",
	5: "mesh_splice_read",
	6: "mesh_splice_read_nonblock",
}

// SpliceSupport returns nil when this kernel has what splicing needs, else
// why not.
func SpliceSupport() error {
	probes := []struct {
		name  string
		probe func() error
	}{
		{"sockhash maps", func() error { return features.HaveMapType(ebpf.SockHash) }},
		{"sk_msg programs", func() error { return features.HaveProgramType(ebpf.SkMsg) }},
		{"bpf_msg_redirect_hash in sk_msg programs",
			func() error { return features.HaveProgramHelper(ebpf.SkMsg, asm.FnMsgRedirectHash) }},
		{"bpf_get_netns_cookie in sk_msg programs",
			func() error { return features.HaveProgramHelper(ebpf.SkMsg, asm.FnGetNetnsCookie) }},
		{"sock_recv_length or tcp_bpf_recvmsg in the kernel's BTF", func() error { _, err := spliceReader(); return err }},
	}
	var missing []error
	for _, p := range probes {
		if err := p.probe(); err != nil {
			missing = append(missing, fmt.Errorf("%s: %w", p.name, err))
		}
	}
	return errors.Join(missing...)
}

// spliceReader names the read-accounting program for this kernel: the
// tracepoint's where it has one, else the one matching its tcp_bpf_recvmsg.
func spliceReader() (string, error) {
	spec, err := btf.LoadKernelSpec()
	if err != nil {
		return "", fmt.Errorf("kernel BTF: %w", err)
	}
	var tp *btf.Typedef
	if err := spec.TypeByName("btf_trace_sock_recv_length", &tp); err == nil {
		return spliceTracepointReader, nil
	}
	var fn *btf.Func
	if err := spec.TypeByName("tcp_bpf_recvmsg", &fn); err != nil {
		return "", err
	}
	proto, ok := fn.Type.(*btf.FuncProto)
	if !ok {
		return "", fmt.Errorf("tcp_bpf_recvmsg has type %T", fn.Type)
	}
	name, ok := spliceReaders[len(proto.Params)]
	if !ok {
		return "", fmt.Errorf("tcp_bpf_recvmsg takes %d arguments, not a known signature", len(proto.Params))
	}
	return name, nil
}

// setSplice turns splicing on or off as Config.Splice says. Splicing is an
// acceleration: when it cannot start, the data path runs without it.
func (d *Datapath) setSplice() {
	if !d.cfg.Splice {
		if err := d.stopSplice(); err != nil {
			d.log.Warn("switch off the splice of an earlier agent", zap.Error(err))
		}
		return
	}
	spec, err := loadRedirect()
	if err == nil {
		err = d.startSplice(spec)
	}
	if err != nil {
		d.spliceErr = err
		d.log.Warn("splicing is off: connections stay on TCP", zap.Error(err))
		if err := d.stopSplice(); err != nil {
			d.log.Warn("switch splicing off", zap.Error(err))
		}
	}
}

// startSplice loads the splice's programs, attaches them and turns splicing
// on. On error nothing is left switched on.
func (d *Datapath) startSplice(spec *ebpf.CollectionSpec) error {
	if err := SpliceSupport(); err != nil {
		return err
	}
	reader, err := spliceReader()
	if err != nil {
		return err
	}
	m := &d.objs.redirectMaps
	replace := map[string]*ebpf.Map{
		"splice_node": m.SpliceNode, "splice_socks": m.SpliceSocks, "splice_targets": m.SpliceTargets,
		"splice_flows": m.SpliceFlows, "splice_rx": m.SpliceRx,
	}
	msgSpec := spec.Programs["mesh_splice_msg"]
	readSpec := spec.Programs[reader]
	sub := &ebpf.CollectionSpec{
		Maps:      map[string]*ebpf.MapSpec{},
		Programs:  map[string]*ebpf.ProgramSpec{msgSpec.Name: msgSpec, readSpec.Name: readSpec},
		Variables: map[string]*ebpf.VariableSpec{},
		Types:     spec.Types,
		ByteOrder: spec.ByteOrder,
	}
	for name := range replace {
		sub.Maps[name] = spec.Maps[name]
	}
	coll, err := ebpf.NewCollectionWithOptions(sub, ebpf.CollectionOptions{MapReplacements: replace})
	if err != nil {
		var verr *ebpf.VerifierError
		if errors.As(err, &verr) {
			return fmt.Errorf("load the splice programs: %+v", verr)
		}
		return fmt.Errorf("load the splice programs: %w", err)
	}
	defer coll.Close()
	if err := link.RawAttachProgram(link.RawAttachProgramOptions{
		Target: m.SpliceSocks.FD(), Program: coll.Programs[msgSpec.Name], Attach: ebpf.AttachSkMsgVerdict,
	}); err != nil {
		return fmt.Errorf("attach the splice program to its sockhash: %w", err)
	}
	// The earlier agent's accounting goes first: reads in between are not
	// taken off, which can only send a connection to TCP early.
	pin := filepath.Join(d.pins.links(), spliceReadLink)
	if err := detachPinned(pin); err != nil {
		return fmt.Errorf("replace the splice read accounting: %w", err)
	}
	l, err := link.AttachTracing(link.TracingOptions{Program: coll.Programs[readSpec.Name]})
	if err != nil {
		return fmt.Errorf("attach the splice read accounting (%s): %w", reader, err)
	}
	if err := l.Pin(pin); err != nil {
		l.Close()
		return fmt.Errorf("pin the splice read accounting: %w", err)
	}
	maxUnread := d.cfg.SpliceMaxUnread
	if maxUnread <= 0 {
		maxUnread = DefaultSpliceMaxUnread
	}
	if err := m.SpliceNode.Put(uint32(0), redirectSpliceConfig{Enabled: 1, MaxUnread: maxUnread}); err != nil {
		return errors.Join(fmt.Errorf("turn splicing on: %w", err), detachPinned(pin), l.Close())
	}
	d.spliceRead = l
	d.log.Info("splicing the pod-local hop into the proxy", zap.Int64("maxUnread", maxUnread), zap.String("reader", reader))
	return nil
}

// stopSplice turns splicing off (each spliced connection goes to TCP at its
// next write, which keeps its order) and removes what an earlier agent
// attached for it. Sockets already in splice_socks keep their program.
func (d *Datapath) stopSplice() error {
	m := &d.objs.redirectMaps
	var errs []error
	if err := m.SpliceNode.Put(uint32(0), redirectSpliceConfig{}); err != nil {
		errs = append(errs, fmt.Errorf("turn splicing off: %w", err))
	}
	pin := filepath.Join(d.pins.links(), spliceReadLink)
	if _, err := os.Stat(pin); err == nil {
		errs = append(errs, detachPinned(pin))
	}
	return errors.Join(errs...)
}

// SpliceStatus is what the splice does now.
type SpliceStatus struct {
	// Enabled: splicing is on.
	Enabled bool `json:"enabled"`
	// Error says why it is off although it was asked for.
	Error string `json:"error,omitempty"`
	// Spliced counts the open connections whose writes into the proxy are
	// spliced; Behind those on TCP until the proxy has read what went
	// through TCP (after it left more than the bound unread, or a write
	// reached TCP before the splice); TCP those on TCP for good (a first
	// byte before the proxy's side was up, a socket the kernel would not
	// redirect to, a pod that stopped asking); Pending those waiting for the
	// proxy's side.
	Spliced int `json:"spliced"`
	Behind  int `json:"behind"`
	TCP     int `json:"tcp"`
	Pending int `json:"pending"`
}

// Splice reports the splice's state, counting its connections.
func (d *Datapath) Splice() (SpliceStatus, error) {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		return SpliceStatus{}, ErrClosed
	}
	st, err := readSplice(d.objs.SpliceNode, d.objs.SpliceFlows)
	st.Enabled = st.Enabled && d.spliceRead != nil
	if d.spliceErr != nil {
		st.Error = d.spliceErr.Error()
	}
	return st, err
}

// readSplice reads the switch and counts the connections of splice_flows.
func readSplice(node, flows *ebpf.Map) (SpliceStatus, error) {
	var (
		st   SpliceStatus
		conf redirectSpliceConfig
	)
	if err := node.Lookup(uint32(0), &conf); err != nil {
		return st, fmt.Errorf("read the splice switch: %w", err)
	}
	st.Enabled = conf.Enabled != 0
	var (
		k redirectTupleKey
		f redirectSpliceFlow
	)
	it := flows.Iterate()
	for it.Next(&k, &f) {
		switch f.State {
		case redirectSpliceStateSPLICE_READY:
			st.Spliced++
		case redirectSpliceStateSPLICE_BEHIND:
			st.Behind++
		case redirectSpliceStateSPLICE_TCP:
			st.TCP++
		default:
			st.Pending++
		}
	}
	if err := it.Err(); err != nil {
		return st, fmt.Errorf("read spliced connections: %w", err)
	}
	return st, nil
}

// inspectSplice reads the pinned splice state; a data path pinned by a build
// without the splice has none.
func inspectSplice(pins layout) (*SpliceStatus, error) {
	readOnly := &ebpf.LoadPinOptions{ReadOnly: true}
	node, err := ebpf.LoadPinnedMap(filepath.Join(pins.maps(), "splice_node"), readOnly)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("open pinned splice_node map: %w", err)
	}
	defer node.Close()
	flows, err := ebpf.LoadPinnedMap(filepath.Join(pins.maps(), "splice_flows"), readOnly)
	if err != nil {
		return nil, fmt.Errorf("open pinned splice_flows map: %w", err)
	}
	defer flows.Close()
	st, err := readSplice(node, flows)
	if err != nil {
		return nil, err
	}
	// The switch alone would splice with no read accounting: every
	// connection would go to TCP at its bound.
	if _, err := os.Stat(filepath.Join(pins.links(), spliceReadLink)); err != nil && st.Enabled {
		st.Enabled = false
		st.Error = "the switch is on but the read accounting (links/" + spliceReadLink + ") is not pinned"
	}
	return &st, nil
}

// SetSplice turns a pod's Settings.Splice on or off in place, without
// enrolling it again; changed reports whether it was otherwise. A pod that
// is not enrolled is ErrNotEnrolled. Turned on, the pod's new connections are
// spliced; turned off, its open ones go to TCP as unspliceApplications says.
func (d *Datapath) SetSplice(ctx context.Context, cookie uint64, on bool) (changed bool, err error) {
	unlock, err := d.lockPod(ctx, cookie)
	if err != nil {
		return false, err
	}
	defer unlock()
	d.mapMu.Lock()
	defer d.mapMu.Unlock()
	var v redirectPodSettings
	if err := d.objs.Pods.Lookup(cookie, &v); errors.Is(err, ebpf.ErrKeyNotExist) {
		return false, fmt.Errorf("netns cookie %d: %w", cookie, ErrNotEnrolled)
	} else if err != nil {
		return false, fmt.Errorf("read pod entry %d: %w", cookie, err)
	}
	was := v.Flags&redirectSettingFlagsSETTING_SPLICE != 0
	if was == on {
		return false, nil
	}
	v.Flags ^= redirectSettingFlagsSETTING_SPLICE
	if err := d.objs.Pods.Update(cookie, v, ebpf.UpdateExist); err != nil {
		return false, fmt.Errorf("write pod entry %d: %w", cookie, err)
	}
	if !on {
		if err := d.unspliceApplications(cookie); err != nil {
			return true, err
		}
	}
	return true, nil
}

// unspliceApplications takes a pod's applications' sockets out of
// splice_socks once the pod no longer asks for the splice (released, enrolled
// again without it): the splice's program no longer runs for their writes,
// which go through TCP after what was spliced (the proxy reads that first),
// and back on TCP's own reader a blocking read waits as on any socket. Their
// connections count as on TCP for good. The proxies' sockets stay in
// splice_targets until they close: taking one out would drop the spliced
// bytes it has not read. Callers hold the pod's lock and have updated or
// deleted its entry.
func (d *Datapath) unspliceApplications(cookie uint64) error {
	socks, err := d.splicedApplications(cookie)
	var errs []error
	for _, own := range socks {
		if err := d.objs.SpliceSocks.Delete(own); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, err)
			continue
		}
		// The connection's direction is keyed as the proxy sees it.
		flow := redirectTupleKey{Netns: own.Netns, Local: own.Remote, Remote: own.Local, LocalPort: own.RemotePort, RemotePort: own.LocalPort}
		var f redirectSpliceFlow
		if d.objs.SpliceFlows.Lookup(flow, &f) == nil {
			f.State = redirectSpliceStateSPLICE_TCP
			_ = d.objs.SpliceFlows.Update(flow, f, ebpf.UpdateExist) // gone meanwhile: closed
		}
	}
	if err := errors.Join(append(errs, err)...); err != nil {
		return fmt.Errorf("unsplice the applications of netns cookie %d: %w", cookie, err)
	}
	return nil
}

// splicedApplications lists the keys of the applications' sockets of netns
// cookie in splice_socks.
func (d *Datapath) splicedApplications(cookie uint64) ([]redirectTupleKey, error) {
	var (
		k    redirectTupleKey
		v    uint64 // the socket's cookie
		mine []redirectTupleKey
	)
	it := d.objs.SpliceSocks.Iterate()
	for it.Next(&k, &v) {
		if k.Netns == cookie {
			mine = append(mine, k)
		}
	}
	if err := it.Err(); err != nil {
		return mine, fmt.Errorf("list spliced sockets: %w", err)
	}
	return mine, nil
}
