package node

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/cilium/ebpf/link"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/node/nodeenv"
)

// nodeSnapshot is what an install may change on the node and an uninstall
// must put back: the CNI conf dir byte for byte, the CNI bin dir, and every
// file of the node's bpffs (pins).
type nodeSnapshot struct {
	conf  map[string][]byte
	bins  map[string]string // name -> sha256
	bpffs []string
}

func snapshotNode(t *testing.T, n *nodeenv.Node) nodeSnapshot {
	t.Helper()
	s := nodeSnapshot{conf: fixtures.ReadFiles(t, n.Path(n.CNIConfDir)), bins: map[string]string{}}
	for name, data := range fixtures.ReadFiles(t, n.Path(n.CNIBinDir)) {
		sum := sha256.Sum256(data)
		s.bins[name] = hex.EncodeToString(sum[:])
	}
	root := n.Path("/sys/fs/bpf")
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p != root {
			rel, _ := filepath.Rel(root, p)
			s.bpffs = append(s.bpffs, rel)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(s.bpffs)
	return s
}

// mustEqual fails the test naming every difference from want.
func (s nodeSnapshot) mustEqual(t *testing.T, want nodeSnapshot) {
	t.Helper()
	for name, data := range want.conf {
		got, ok := s.conf[name]
		switch {
		case !ok:
			t.Errorf("CNI config %s is gone", name)
		case !bytes.Equal(got, data):
			t.Errorf("CNI config %s differs from before the install:\n got %q\nwant %q", name, got, data)
		}
	}
	for name := range s.conf {
		if _, ok := want.conf[name]; !ok {
			t.Errorf("CNI config %s was left behind", name)
		}
	}
	for name, sum := range want.bins {
		if s.bins[name] != sum {
			t.Errorf("CNI plugin %s changed or is gone", name)
		}
	}
	for name := range s.bins {
		if _, ok := want.bins[name]; !ok {
			t.Errorf("CNI plugin %s was left in the bin dir", name)
		}
	}
	if !slices.Equal(s.bpffs, want.bpffs) {
		t.Errorf("the node's bpffs holds %q, before the install %q", s.bpffs, want.bpffs)
	}
}

// pinnedLinkIDs lists the ids of every BPF link pinned under the agent's pin
// root on the node (its cgroup attachments and each pod's).
func pinnedLinkIDs(t *testing.T, n *nodeenv.Node) []link.ID {
	t.Helper()
	var ids []link.ID
	root := n.Path("/sys/fs/bpf/mesh-cni")
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		l, err := link.LoadPinnedLink(p, nil)
		if err != nil {
			return nil // a map
		}
		defer l.Close()
		info, err := l.Info()
		if err != nil {
			return err
		}
		ids = append(ids, info.ID)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(ids) == 0 {
		t.Fatalf("no links pinned under %s", root)
	}
	return ids
}

// checkLinksGone fails for every link that still exists after what: its
// program would still be attached to the host's cgroup root.
func checkLinksGone(t *testing.T, ids []link.ID, what string) {
	t.Helper()
	for _, id := range ids {
		l, err := link.NewFromID(id)
		if err == nil {
			info, _ := l.Info()
			l.Close()
			t.Errorf("link %d (type %v) still exists after %s", id, info.Type, what)
			continue
		}
		if !errors.Is(err, os.ErrNotExist) {
			t.Errorf("link %d: %v", id, err)
		}
	}
}
