package redirect

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"strconv"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/link"
)

// podCookieMarker is POD_COOKIE_MARKER of bpf/lib/common.h.
const podCookieMarker = 0x6d6573682d636e69

// lookupTemplate builds each pod's sk_lookup program from mesh_lookup: the same
// instructions with the pod's netns cookie in place of the marker. An sk_lookup
// program cannot learn which namespace it runs in (its context has no netns and
// bpf_get_netns_cookie is not available to it), and bpf_sk_assign would hand a
// connection to a listener of any namespace, so the identity is fixed at load time
// by the agent rather than derived from anything a packet or a pod controls. The
// per-pod program only passes its cookie on and tail-calls the shared
// mesh_lookup_main, which makes the decision: loading it costs a verifier pass over
// a few instructions. It carries its maps and no BTF, so no BTF blob is loaded
// either.
type lookupTemplate struct {
	spec   *ebpf.ProgramSpec
	marker int // index of the instruction loading the marker
}

func newLookupTemplate(ps *ebpf.ProgramSpec, maps *redirectMaps) (*lookupTemplate, error) {
	if ps == nil {
		return nil, errors.New("BPF object has no mesh_lookup program")
	}
	spec := ps.Copy()
	byName := map[string]*ebpf.Map{"lookup_scratch": maps.LookupScratch, "lookup_main": maps.LookupMain}
	marker := -1
	for i := range spec.Instructions {
		ins := btf.WithFuncMetadata(spec.Instructions[i], nil).WithSource(nil)
		if ref := ins.Reference(); ref != "" && ins.IsLoadFromMap() {
			m, ok := byName[ref]
			if !ok {
				return nil, fmt.Errorf("mesh_lookup uses map %q the loader does not know", ref)
			}
			if err := ins.AssociateMap(m); err != nil {
				return nil, fmt.Errorf("mesh_lookup: map %q: %w", ref, err)
			}
		}
		if ins.OpCode.IsDWordLoad() && ins.Src == 0 && uint64(ins.Constant) == podCookieMarker {
			if marker >= 0 {
				return nil, errors.New("mesh_lookup loads the pod cookie marker more than once")
			}
			marker = i
		}
		spec.Instructions[i] = ins
	}
	if marker < 0 {
		return nil, errors.New("mesh_lookup has no pod cookie marker")
	}
	return &lookupTemplate{spec: spec, marker: marker}, nil
}

// specFor is the program for the pod with this netns cookie.
func (t *lookupTemplate) specFor(cookie uint64) *ebpf.ProgramSpec {
	s := *t.spec
	s.Instructions = slices.Clone(t.spec.Instructions)
	s.Instructions[t.marker].Constant = int64(cookie)
	return &s
}

// load loads the pod's program.
func (t *lookupTemplate) load(cookie uint64) (*ebpf.Program, error) {
	p, err := ebpf.NewProgram(t.specFor(cookie))
	if err != nil {
		var verr *ebpf.VerifierError
		if errors.As(err, &verr) {
			return nil, fmt.Errorf("load sk_lookup program: %+v", verr)
		}
		return nil, fmt.Errorf("load sk_lookup program: %w", err)
	}
	return p, nil
}

// hasTag reports whether tag is the kernel's tag of the pod's program: what a loaded
// program built by specFor(cookie) reports, and nothing else does.
func (t *lookupTemplate) hasTag(cookie uint64, tag string) (bool, error) {
	return t.specFor(cookie).Instructions.HasTag(tag, hostByteOrder())
}

// lookupPinName is the pin of a pod's sk_lookup link: the namespace inode it was
// attached to is part of the name, so Check can tell that it is still attached to
// the same namespace.
func lookupPinName(netnsIno uint64) string { return "lookup_" + strconv.FormatUint(netnsIno, 10) }

// checkLookup reports why the link pinned at path is not the intact inbound capture
// of the pod with this cookie in the namespace with inode ino, or nil.
func (d *Datapath) checkLookup(cookie uint64, path string, ino uint64) error {
	l, info, err := pinnedLinkInfo(path)
	if err != nil {
		return fmt.Errorf("%w: %w", err, ErrLinkBroken)
	}
	defer l.Close()
	ns := info.NetNs()
	switch {
	case ns == nil:
		return fmt.Errorf("pinned link is %v, not a netns link: %w", info.Type, ErrLinkBroken)
	case ns.NetnsInode == 0:
		return fmt.Errorf("link detached (namespace gone): %w", ErrLinkBroken)
	case uint64(ns.NetnsInode) != ino:
		return fmt.Errorf("link attached to netns inode %d, pinned for %d: %w", ns.NetnsInode, ino, ErrLinkBroken)
	}
	same, err := d.runsLookupFor(info.Program, cookie)
	if err != nil {
		return fmt.Errorf("%w: %w", err, ErrLinkBroken)
	}
	if !same {
		return fmt.Errorf("link runs program %d, not this pod's: %w", info.Program, ErrLinkBroken)
	}
	return nil
}

// pinnedLinkInfo opens the link pinned at path and reads its info; close l
// when done.
func pinnedLinkInfo(path string) (link.Link, *link.Info, error) {
	l, err := link.LoadPinnedLink(path, nil)
	if err != nil {
		return nil, nil, fmt.Errorf("load pinned link %s: %w", path, err)
	}
	info, err := l.Info()
	if err != nil {
		l.Close()
		return nil, nil, fmt.Errorf("link info %s: %w", path, err)
	}
	return l, info, nil
}

// runsLookupFor reports whether program id is this build's sk_lookup program for
// the cookie.
func (d *Datapath) runsLookupFor(id ebpf.ProgramID, cookie uint64) (bool, error) {
	p, err := ebpf.NewProgramFromID(id)
	if err != nil {
		return false, fmt.Errorf("open program %d: %w", id, err)
	}
	defer p.Close()
	pi, err := p.Info()
	if err != nil {
		return false, fmt.Errorf("program %d info: %w", id, err)
	}
	same, err := d.lookup.hasTag(cookie, pi.Tag)
	if err != nil {
		return false, fmt.Errorf("program tag: %w", err)
	}
	return same, nil
}

// refreshLookup switches an adopted pod's link to this build's program when it runs
// another (an upgrade), atomically with link.Update.
func (d *Datapath) refreshLookup(cookie uint64, path string) error {
	l, info, err := pinnedLinkInfo(path)
	if err != nil {
		return err
	}
	defer l.Close()
	if same, err := d.runsLookupFor(info.Program, cookie); err == nil && same {
		return nil
	}
	p, err := d.lookup.load(cookie)
	if err != nil {
		return err
	}
	defer p.Close()
	if err := l.Update(p); err != nil {
		return fmt.Errorf("update link %s: %w", path, err)
	}
	return nil
}

// hostByteOrder is binary.LittleEndian or binary.BigEndian, as the program was built
// for this host (cilium/ebpf takes only those two).
func hostByteOrder() binary.ByteOrder {
	if binary.NativeEndian.Uint16([]byte{1, 0}) == 1 {
		return binary.LittleEndian
	}
	return binary.BigEndian
}
