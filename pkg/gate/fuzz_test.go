package gate

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

// pathSafe: the identifier can become one path component (the data path names
// pins after interfaces) and one log field.
func pathSafe(s string) bool {
	return s != "" && s != "." && s != ".." && !strings.ContainsAny(s, "/\x00\n")
}

func checkAttachment(t *testing.T, a *gatepb.Attachment) {
	t.Helper()
	if !pathSafe(a.GetContainerId()) || !pathSafe(a.GetIfname()) || !pathSafe(a.GetNetwork()) || len(a.GetIfname()) > maxIfnameLen {
		t.Fatalf("accepted unsafe attachment %q", a)
	}
}

func checkInterfaces(t *testing.T, ifs []*gatepb.Interface) {
	t.Helper()
	if len(ifs) > maxInterfaces {
		t.Fatalf("accepted %d interfaces", len(ifs))
	}
	for _, i := range ifs {
		if !pathSafe(i.GetName()) || len(i.GetName()) > maxIfnameLen || strings.ContainsAny(i.GetName(), " \t:") {
			t.Fatalf("accepted interface name %q", i.GetName())
		}
		if m := i.GetMac(); m != "" {
			if _, err := net.ParseMAC(m); err != nil {
				t.Fatalf("accepted MAC %q", m)
			}
		}
		for _, a := range i.GetAddresses() {
			if _, err := netip.ParsePrefix(a); err != nil {
				t.Fatalf("accepted address %q", a)
			}
		}
	}
}

func checkNetns(t *testing.T, path string) {
	t.Helper()
	if !filepath.IsAbs(path) || filepath.Clean(path) != path || len(path) > maxPathLen {
		t.Fatalf("accepted netns path %q", path)
	}
}

// FuzzValidateRequests decodes arbitrary protobuf bytes as each gate request,
// the way they arrive on the socket, and validates them: validation never
// panics, every refusal wraps ErrInvalidRequest, and whatever is accepted is safe
// for the agent to use as path components, record keys and log fields.
// (FuzzValidateAdd covers Add field by field; this covers Del, Check and GC, and
// Add from the wire.)
func FuzzValidateRequests(f *testing.F) {
	add := validAdd()
	for kind, m := range []proto.Message{
		add,
		&gatepb.DelRequest{Attachment: add.GetAttachment(), NetnsPath: "/run/netns/gone"},
		&gatepb.CheckRequest{Pod: add.GetPod(), Attachment: add.GetAttachment(), NetnsPath: add.GetNetnsPath(), Interfaces: add.GetInterfaces()},
		&gatepb.GCRequest{Network: "net", Valid: []*gatepb.Attachment{{ContainerId: "a", Ifname: "eth0"}, {ContainerId: "b.c-d_e", Ifname: "net1"}}},
	} {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(uint8(kind), b)
	}
	f.Add(uint8(1), []byte{})
	f.Add(uint8(3), []byte{0x0a, 0x01, 0x2e}) // network "."
	f.Add(uint8(1), []byte{0x12, 0x00})       // an empty attachment

	f.Fuzz(func(t *testing.T, kind uint8, data []byte) {
		var (
			msg      proto.Message
			validate func() error
			accepted func(t *testing.T)
		)
		switch kind % 4 {
		case 0:
			r := &gatepb.AddRequest{}
			msg, validate = r, func() error { return ValidateAdd(r) }
			accepted = func(t *testing.T) {
				if r.GetPod() == nil {
					t.Fatal("accepted an add without pod identity")
				}
				checkAttachment(t, r.GetAttachment())
				checkNetns(t, r.GetNetnsPath())
				checkInterfaces(t, r.GetInterfaces())
			}
		case 1:
			r := &gatepb.DelRequest{}
			msg, validate = r, func() error { return ValidateDel(r) }
			accepted = func(t *testing.T) {
				checkAttachment(t, r.GetAttachment())
				if r.GetNetnsPath() != "" {
					checkNetns(t, r.GetNetnsPath())
				}
			}
		case 2:
			r := &gatepb.CheckRequest{}
			msg, validate = r, func() error { return ValidateCheck(r) }
			accepted = func(t *testing.T) {
				checkAttachment(t, r.GetAttachment())
				checkNetns(t, r.GetNetnsPath())
				checkInterfaces(t, r.GetInterfaces())
			}
		default:
			r := &gatepb.GCRequest{}
			msg, validate = r, func() error { return ValidateGC(r) }
			accepted = func(t *testing.T) {
				if !pathSafe(r.GetNetwork()) {
					t.Fatalf("accepted network %q", r.GetNetwork())
				}
				for _, a := range r.GetValid() {
					// GC keys take the request's network, not the attachment's.
					checkAttachment(t, &gatepb.Attachment{ContainerId: a.GetContainerId(), Ifname: a.GetIfname(), Network: r.GetNetwork()})
				}
			}
		}
		if proto.Unmarshal(data, msg) != nil {
			return
		}
		if err := validate(); err != nil {
			if !errors.Is(err, ErrInvalidRequest) {
				t.Fatalf("refusal does not wrap ErrInvalidRequest: %v", err)
			}
			return
		}
		accepted(t)
	})
}

// FuzzFitPodMetadata: whatever labels and annotations a runtime sends, the
// fitted pod passes the gate's validation of its metadata, every entry that
// already fitted is passed on unchanged (within the entry limit), and a key is
// only ever dropped, never invented.
func FuzzFitPodMetadata(f *testing.F) {
	f.Add("app", "web", "kubectl.kubernetes.io/last-applied-configuration", 70000, 3)
	f.Add("", "x", "a", 4097, 300)
	f.Add("k", "", "b", 0, 0)
	f.Fuzz(func(t *testing.T, lk, lv, ak string, bigLen, many int) {
		if bigLen < 0 || bigLen > 1<<17 || many < 0 || many > 600 {
			return
		}
		labels := map[string]string{lk: lv}
		annotations := map[string]string{ak: strings.Repeat("x", bigLen)}
		for i := range many {
			annotations[fmt.Sprintf("n%03d", i)] = "v"
		}
		pod := &gatepb.PodIdentity{Namespace: "ns", Name: "p", Labels: labels, Annotations: annotations}
		fitted, _ := FitPodMetadata(pod)
		if err := validateMetadata("label", fitted.GetLabels()); err != nil {
			t.Fatalf("fitted labels refused: %v", err)
		}
		if err := validateMetadata("annotation", fitted.GetAnnotations()); err != nil {
			t.Fatalf("fitted annotations refused: %v", err)
		}
		for _, pair := range []struct{ in, out map[string]string }{{labels, fitted.GetLabels()}, {annotations, fitted.GetAnnotations()}} {
			for k, v := range pair.out {
				orig, ok := pair.in[k]
				if !ok {
					t.Fatalf("key %q invented", k)
				}
				if len(orig) <= maxMetaValueLen && v != orig {
					t.Fatalf("value of %q changed although it fitted", k)
				}
			}
			if len(pair.in) <= maxMetadata {
				for k, v := range pair.in {
					if k != "" && len(k) <= maxMetaKeyLen && len(v) <= maxMetaValueLen && pair.out[k] != v {
						t.Fatalf("entry %q that fitted was not passed on", k)
					}
				}
			}
		}
	})
}
