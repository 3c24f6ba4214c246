package redirect

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"slices"
	"syscall"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/pkg/netns"
)

// listenerSlots is LISTENER_SLOTS of bpf/redirect.c.
const listenerSlots = 8

// Address families as the listener keys hold them.
const (
	afInet  = 2
	afInet6 = 10
)

// addListenPorts makes sockops collect the listeners of these ports.
func (d *Datapath) addListenPorts(ports ...uint16) error {
	for _, p := range ports {
		if p == 0 {
			continue
		}
		if err := d.objs.ListenPorts.Update(p, uint8(1), ebpf.UpdateAny); err != nil {
			return fmt.Errorf("add inbound port %d: %w", p, err)
		}
	}
	return nil
}

// hasListener reports whether any listener of the pod's inbound port is collected.
func hasListener(m *ebpf.Map, cookie uint64, port uint16) bool {
	for _, fam := range []uint8{afInet6, afInet} {
		for slot := range uint8(listenerSlots) {
			var sockCookie uint64
			k := redirectListenerKey{Netns: cookie, Port: port, Family: fam, Slot: slot}
			if m.Lookup(&k, &sockCookie) == nil {
				return true
			}
		}
	}
	return false
}

// collectExisting collects listeners of port that were open in the pod's netns
// before sockops could see them start listening (a proxy already running when its
// pod is enrolled, or when this data path was installed). Inside the netns it asks
// the kernel (sock_diag, one exact lookup per family) whether anything listens on
// the port, and only then runs the listener iterator, which walks every TCP socket
// of the netns: a new pod, the common case, costs two netlink round trips.
func (d *Datapath) collectExisting(nsFd int, cookie uint64, port uint16) error {
	if hasListener(d.objs.Listeners, cookie, port) {
		return nil
	}
	return netns.DoFd(nsFd, func() error {
		listening, err := listenerOnPort(port)
		if err != nil || !listening {
			return err
		}
		it, err := link.AttachIter(link.IterOptions{Program: d.objs.MeshCollectListeners})
		if err != nil {
			return fmt.Errorf("attach listener iterator: %w", err)
		}
		defer it.Close()
		r, err := it.Open()
		if err != nil {
			return fmt.Errorf("open listener iterator: %w", err)
		}
		defer r.Close()
		if _, err := io.Copy(io.Discard, r); err != nil {
			return fmt.Errorf("run listener iterator: %w", err)
		}
		return nil
	})
}

// listenerOnPort reports whether a TCP socket listens on the wildcard address at
// port in the calling thread's netns (IPv6 [::], or IPv4 0.0.0.0 which a
// dual-stack [::] listener also answers for).
func listenerOnPort(port uint16) (bool, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_SOCK_DIAG)
	if err != nil {
		return false, fmt.Errorf("sock_diag socket: %w", err)
	}
	defer unix.Close(fd)
	for _, fam := range []uint8{unix.AF_INET6, unix.AF_INET} {
		found, err := diagLookupListener(fd, fam, port)
		if err != nil || found {
			return found, err
		}
	}
	return false, nil
}

// diagLookupListener sends one SOCK_DIAG_BY_FAMILY exact lookup (not a dump, which
// would walk the node's whole listening hash) for a TCP socket with local address
// any:port. The kernel resolves it like an incoming connection would be.
func diagLookupListener(fd int, family uint8, port uint16) (bool, error) {
	const (
		hdrLen = unix.SizeofNlMsghdr
		reqLen = 56 // struct inet_diag_req_v2
	)
	buf := make([]byte, hdrLen+reqLen)
	ne := binary.NativeEndian
	ne.PutUint32(buf[0:], uint32(len(buf)))
	ne.PutUint16(buf[4:], unix.SOCK_DIAG_BY_FAMILY)
	ne.PutUint16(buf[6:], unix.NLM_F_REQUEST)
	ne.PutUint32(buf[8:], 1) // sequence
	req := buf[hdrLen:]
	req[0] = family
	req[1] = unix.IPPROTO_TCP
	ne.PutUint32(req[4:], 1<<unix.BPF_TCP_LISTEN)
	id := req[8:] // struct inet_diag_sockid
	binary.BigEndian.PutUint16(id[0:], port)
	binary.BigEndian.PutUint16(id[2:], 1) // a remote port no listener lookup uses
	ne.PutUint32(id[36:], 0)              // any interface
	ne.PutUint32(id[40:], ^uint32(0))     // INET_DIAG_NOCOOKIE
	ne.PutUint32(id[44:], ^uint32(0))
	if err := unix.Sendto(fd, buf, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return false, fmt.Errorf("sock_diag request: %w", err)
	}
	resp := make([]byte, 4096)
	n, _, err := unix.Recvfrom(fd, resp, 0)
	if err != nil {
		return false, fmt.Errorf("sock_diag response: %w", err)
	}
	msgs, err := syscall.ParseNetlinkMessage(resp[:n])
	if err != nil || len(msgs) == 0 {
		return false, fmt.Errorf("sock_diag response: %w", errors.Join(err, errors.New("no message")))
	}
	m := msgs[0]
	switch m.Header.Type {
	case unix.SOCK_DIAG_BY_FAMILY:
		return true, nil
	case unix.NLMSG_ERROR:
		if len(m.Data) < 4 {
			return false, errors.New("sock_diag: short error message")
		}
		errno := syscall.Errno(-int32(ne.Uint32(m.Data)))
		if errno == unix.ENOENT {
			return false, nil
		}
		return false, fmt.Errorf("sock_diag lookup: %w", errno)
	}
	return false, fmt.Errorf("sock_diag: unexpected message type %d", m.Header.Type)
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
	slices.SortFunc(out, func(a, b Refusal) int { return cmpUint64(a.Cookie, b.Cookie) })
	return out, nil
}

// Listeners counts the collected inbound listeners of a pod (both families).
func (d *Datapath) Listeners(cookie uint64) (int, error) {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		return 0, ErrClosed
	}
	var s redirectPodSettings
	if err := d.objs.Pods.Lookup(cookie, &s); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return 0, fmt.Errorf("netns cookie %d: %w", cookie, ErrNotEnrolled)
		}
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
