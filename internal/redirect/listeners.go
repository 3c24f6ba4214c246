package redirect

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"syscall"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/internal/netns"
)

// listenerSlots is LISTENER_SLOTS of bpf/lib/common.h.
const listenerSlots = 8

// Address families as the listener keys hold them.
const (
	afInet  = 2
	afInet6 = 10
)

// collectExisting collects the listeners of port open in the pod's netns that no
// slot holds yet: listeners sockops did not see start because their pod was not
// enrolled then (a proxy already running when its pod is enrolled, or when this
// data path was installed), or that were refused while the map was full. Enroll
// calls it only when its sock_diag lookup in the pod's namespace found something
// listening on the port (a new pod, the common case, costs that lookup alone); the
// reconcile pass, for pods with a refused listener. It lists the listeners, finds
// the processes holding those not collected yet, takes a descriptor of each
// (pidfd_getfd) and puts it into its slots, as sockops would have. (A BPF TCP
// iterator could insert them from the kernel, but updating a SOCKHASH from one
// deadlocks on Linux 5.15, where the iterator holds the socket's lock: seen in the
// kernel matrix.)
func (d *Datapath) collectExisting(nsFd int, cookie uint64, port uint16) error {
	var listeners []diagSocket
	err := netns.DoFd(nsFd, func() error {
		var err error
		listeners, err = listenersOnPort(port)
		return err
	})
	if err != nil || len(listeners) == 0 {
		return err
	}
	slotted := slottedSockets(d.objs.Listeners, cookie, port)
	listeners = slices.DeleteFunc(listeners, func(l diagSocket) bool { return slotted[l.cookie] })
	if len(listeners) == 0 {
		return nil
	}
	fds, err := socketsByInode(listeners)
	defer func() {
		for _, f := range fds {
			f.Close()
		}
	}()
	errs := []error{err}
	for _, l := range listeners {
		if f := fds[l.inode]; f != nil {
			errs = append(errs, d.slotListener(cookie, port, l.family, f))
		}
	}
	return errors.Join(errs...)
}

// slottedSockets are the socket cookies in a pod's slots of port.
func slottedSockets(m *ebpf.Map, cookie uint64, port uint16) map[uint64]bool {
	out := map[uint64]bool{}
	for _, fam := range []uint8{afInet6, afInet} {
		for slot := range uint8(listenerSlots) {
			var sockCookie uint64
			k := redirectListenerKey{Netns: cookie, Port: port, Family: fam, Slot: slot}
			if m.Lookup(&k, &sockCookie) == nil {
				out[sockCookie] = true
			}
		}
	}
	return out
}

// dropListeners removes a released pod's listeners from their slots and its
// refusal records.
func (d *Datapath) dropListeners(cookie uint64, port uint16) {
	for _, fam := range []uint8{afInet6, afInet} {
		for slot := range uint8(listenerSlots) {
			_ = d.objs.Listeners.Delete(&redirectListenerKey{Netns: cookie, Port: port, Family: fam, Slot: slot})
		}
		_ = d.objs.ListenRefused.Delete(&redirectListenerKey{Netns: cookie, Port: port, Family: fam})
	}
}

// Recollect collects the pod's listeners that are open but not held (refused
// while the map was full, or open before the pod was enrolled and missed), so a
// pod whose proxy was refused is captured again once there is room, without its
// proxy having to listen again. The reconcile pass calls it for pods with a
// refusal on record.
func (d *Datapath) Recollect(ctx context.Context, netnsPath string) error {
	ns, err := netns.OpenHandle(netnsPath)
	if err != nil {
		return fmt.Errorf("recollect: %w", err)
	}
	defer ns.Close()
	cookie, nsFile := ns.Cookie, ns.File
	s, unlock, err := d.lockEnrolled(ctx, cookie)
	if err != nil {
		return fmt.Errorf("recollect %s: %w", netnsPath, err)
	}
	defer unlock()
	// A listener refused again is recorded again by slotListener.
	for _, fam := range []uint8{afInet6, afInet} {
		_ = d.objs.ListenRefused.Delete(&redirectListenerKey{Netns: cookie, Port: s.InboundPort, Family: fam})
	}
	if err := d.collectExisting(int(nsFile.Fd()), cookie, s.InboundPort); err != nil {
		return fmt.Errorf("recollect %s: %w", netnsPath, err)
	}
	return nil
}

// slotListener puts a listener into the first free slot of its family, and an
// IPv6 one into the IPv4 slots too, as sockops does. A refusal (an MPTCP listener,
// every slot taken) is recorded as sockops records one.
func (d *Datapath) slotListener(cookie uint64, port uint16, family uint8, f *os.File) error {
	families := []uint8{family}
	if family == afInet6 {
		families = append(families, afInet)
	}
	for i, fam := range families {
		var err error
		for slot := range uint8(listenerSlots) {
			k := redirectListenerKey{Netns: cookie, Port: port, Family: fam, Slot: slot}
			err = d.objs.Listeners.Update(&k, uint64(f.Fd()), ebpf.UpdateNoExist)
			if !errors.Is(err, ebpf.ErrKeyExist) {
				break
			}
		}
		switch {
		case err == nil:
		case i > 0:
			// In its own family's slots already; IPv4 slots are for a
			// dual-stack listener only.
			return nil
		default:
			errno := unix.EEXIST
			_ = errors.As(err, &errno)
			d.recordRefusal(cookie, port, fam, errno)
			return fmt.Errorf("collect a listener of port %d: %w", port, err)
		}
	}
	return nil
}

// recordRefusal counts a listener that could not be collected, where sockops
// counts its own.
func (d *Datapath) recordRefusal(cookie uint64, port uint16, family uint8, errno unix.Errno) {
	k := redirectListenerKey{Netns: cookie, Port: port, Family: family}
	var r redirectListenerRefusal
	_ = d.objs.ListenRefused.Lookup(&k, &r)
	r.Err, r.Count = -int32(errno), r.Count+1
	_ = d.objs.ListenRefused.Put(&k, &r)
}

// Refusal is a proxy listener the data path could not collect, so connections to
// its pod fail closed (or pass, fail-open) instead of reaching it.
type Refusal struct {
	Cookie uint64 `json:"netnsCookie"`
	Port   uint16 `json:"port"`
	Family string `json:"family"`
	// Reason is the kernel's error: "operation not supported" for an MPTCP
	// listener (Go's net.Listen default since 1.24), "file exists" when every
	// slot of the port is taken.
	Reason string `json:"reason"`
	Count  uint32 `json:"count"`
}

// Refusals lists the listeners that could not be collected, by namespace.
func (d *Datapath) Refusals() ([]Refusal, error) {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		return nil, ErrClosed
	}
	return readRefusals(d.objs.ListenRefused)
}

func readRefusals(m *ebpf.Map) ([]Refusal, error) {
	var (
		out []Refusal
		k   redirectListenerKey
		v   redirectListenerRefusal
	)
	it := m.Iterate()
	for it.Next(&k, &v) {
		out = append(out, Refusal{
			Cookie: k.Netns, Port: k.Port, Family: familyName(k.Family),
			Reason: syscall.Errno(-v.Err).Error(), Count: v.Count,
		})
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read refused listeners: %w", err)
	}
	slices.SortFunc(out, func(a, b Refusal) int { return cmp.Compare(a.Cookie, b.Cookie) })
	return out, nil
}

// podSettings reads the pod's settings entry: ErrNotEnrolled (naming the
// cookie) when it has none.
func (d *Datapath) podSettings(cookie uint64) (redirectPodSettings, error) {
	var s redirectPodSettings
	err := d.objs.Pods.Lookup(cookie, &s)
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return s, fmt.Errorf("netns cookie %d: %w", cookie, ErrNotEnrolled)
	}
	return s, err
}

// lockEnrolled locks the pod (lockPod) and reads its settings entry; a pod
// without one is ErrNotEnrolled, and is not left locked.
func (d *Datapath) lockEnrolled(ctx context.Context, cookie uint64) (redirectPodSettings, func(), error) {
	unlock, err := d.lockPod(ctx, cookie)
	if err != nil {
		return redirectPodSettings{}, nil, err
	}
	s, err := d.podSettings(cookie)
	if err != nil {
		unlock()
		return s, nil, err
	}
	return s, unlock, nil
}

// Listeners counts the collected inbound listeners of a pod (both families).
func (d *Datapath) Listeners(cookie uint64) (int, error) {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		return 0, ErrClosed
	}
	s, err := d.podSettings(cookie)
	if err != nil {
		return 0, err
	}
	return countListeners(d.objs.Listeners, cookie, s.InboundPort), nil
}

func countListeners(m *ebpf.Map, cookie uint64, port uint16) int {
	n := 0
	for _, fam := range []uint8{afInet6, afInet} {
		for slot := range uint8(listenerSlots) {
			var sockCookie uint64
			k := redirectListenerKey{Netns: cookie, Port: port, Family: fam, Slot: slot}
			if m.Lookup(&k, &sockCookie) == nil {
				n++
			}
		}
	}
	return n
}

func familyName(f uint8) string {
	switch f {
	case afInet:
		return "ipv4"
	case afInet6:
		return "ipv6"
	}
	return fmt.Sprint(f)
}
