package redirect

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"go.uber.org/zap"
)

// packetHook is the pin name of the BPF LSM link that refuses packet sockets.
const packetHook = "socket_create"

// ErrNoPacketHook is returned when a pod asks for DenyPacketSockets but the data path runs
// without its BPF LSM program (Config.PacketSockets off, or the node has no BPF
// LSM).
var ErrNoPacketHook = errors.New("packet sockets cannot be refused: the data path runs without its BPF LSM program (--deny-packet-sockets)")

// attachPacketHook loads mesh_socket_create and attaches it to the BPF LSM's
// socket_create hook, pinned under links/. A link an earlier agent pinned is
// replaced after the new one is attached (an LSM link cannot be updated in place),
// so no socket creation goes unchecked meanwhile.
func (d *Datapath) attachPacketHook(spec *ebpf.CollectionSpec, undo *undoStack) error {
	var objs struct {
		Prog *ebpf.Program `ebpf:"mesh_socket_create"`
	}
	opts := &ebpf.CollectionOptions{MapReplacements: map[string]*ebpf.Map{"pods": d.objs.Pods, "socket_refusals": d.objs.SocketRefusals}}
	if err := spec.LoadAndAssign(&objs, opts); err != nil {
		return fmt.Errorf("load the packet-socket hook: %w", err)
	}
	defer objs.Prog.Close()
	l, err := link.AttachLSM(link.LSMOptions{Program: objs.Prog})
	if err != nil {
		return fmt.Errorf("attach the packet-socket hook to the BPF LSM (the node's kernel must run it: its lsm= list names bpf): %w", err)
	}
	pin := filepath.Join(d.pins.links(), packetHook)
	if old, err := link.LoadPinnedLink(pin, nil); err == nil {
		_ = old.Unpin()
		old.Close()
	}
	if err := l.Pin(pin); err != nil {
		l.Close()
		return fmt.Errorf("pin the packet-socket hook: %w", err)
	}
	undo.push(func() error { return detachPinned(pin) })
	d.packetHook = l
	d.log.Info("packet sockets of pods that ask for it are refused (BPF LSM socket_create)")
	return nil
}

// dropPacketHook removes a packet-socket hook an earlier agent attached, when
// this one runs without it.
func (d *Datapath) dropPacketHook() {
	pin := filepath.Join(d.pins.links(), packetHook)
	if _, err := os.Stat(pin); err != nil {
		return
	}
	if err := detachPinned(pin); err != nil {
		d.log.Warn("remove the packet-socket hook", zap.Error(err))
	}
}

// BPFLSMActive reports whether the running kernel has the BPF LSM in its list of
// active LSMs (/sys/kernel/security/lsm, where securityfs is mounted).
func BPFLSMActive() (bool, error) {
	b, err := os.ReadFile("/sys/kernel/security/lsm")
	if err != nil {
		return false, err
	}
	for _, l := range strings.Split(strings.TrimSpace(string(b)), ",") {
		if l == "bpf" {
			return true, nil
		}
	}
	return false, nil
}
