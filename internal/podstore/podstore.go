// Package podstore keeps the agent's enrollment records on disk, one small JSON
// file per pod attachment, so a restarted agent knows which pods it enrolled.
//
// Every write goes through atomicfile: a temporary file in the same directory
// renamed over the record, so a crash at any point leaves either the old
// record, the new one, or a stray temporary file that the next Open removes;
// never a half-written record under a record's name.
package podstore

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/mesh-cni/mesh-cni/internal/atomicfile"
)

// Key identifies one network attachment of a pod, as CNI does.
type Key struct {
	Network     string `json:"network"`
	ContainerID string `json:"containerID"`
	Ifname      string `json:"ifname"`
}

func (k Key) String() string { return k.Network + "/" + k.ContainerID + "/" + k.Ifname }

// fileName derives a fixed-length name from the key, so nothing a caller sends can
// shape a path.
func (k Key) fileName() string {
	sum := sha256.Sum256([]byte(k.Network + "\x00" + k.ContainerID + "\x00" + k.Ifname))
	return hex.EncodeToString(sum[:16]) + recordSuffix
}

// Interface is one interface inside the pod's network namespace.
type Interface struct {
	Name      string   `json:"name"`
	MAC       string   `json:"mac,omitempty"`
	Addresses []string `json:"addresses,omitempty"`
}

// Record is what the agent knows about one enrolled attachment.
type Record struct {
	Key       Key    `json:"key"`
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	UID       string `json:"uid,omitempty"`
	// ServiceAccount is the pod's Kubernetes service account, as the
	// enrollment source read it (spec.serviceAccountName); empty when the
	// source cannot know it. A node proxy such as ztunnel derives the pod's
	// identity from it.
	ServiceAccount string      `json:"serviceAccount,omitempty"`
	NetnsPath      string      `json:"netnsPath"`
	NetnsCookie    uint64      `json:"netnsCookie"`
	Interfaces     []Interface `json:"interfaces,omitempty"`
	// Source is the entry point the pod came through (the gate request's
	// source, such as SOURCE_CNI), or SourceAdopted.
	Source     string    `json:"source"`
	EnrolledAt time.Time `json:"enrolledAt"`
	// Skipped: the pod reached the agent but the policy keeps it out of the mesh.
	// It is recorded so that a later policy or label change can enroll it.
	Skipped bool `json:"skipped,omitempty"`
	// Labels and Annotations the entry point passed (KNI, hook), kept for
	// re-deciding the pod later.
	Labels      map[string]string `json:"labels,omitempty"`
	Annotations map[string]string `json:"annotations,omitempty"`
	// Capture is how the pod's own redirection differs from the node's
	// settings, as the enrollment source decided: kept so a repair or an
	// agent restart applies the same.
	Capture Capture `json:"capture,omitzero"`
}

// Capture are a pod's own deviations from the node's redirection settings, from
// its annotations (Istio's ambient.istio.io/dns-capture and
// ambient.istio.io/bypass-inbound-capture under the istio profile).
type Capture struct {
	// DNS, when set, turns the pod's DNS capture on or off whatever the node's
	// setting.
	DNS *bool `json:"dns,omitempty"`
	// BypassInbound leaves the pod's inbound connections uncaptured.
	BypassInbound bool `json:"bypassInbound,omitempty"`
	// KubeletPorts, when not nil, are the only ports of the pod the kubelet's
	// connections reach past its inbound capture: those of its own probes and
	// hooks (empty: none). Nil: any port (a source that does not read the
	// pod's spec).
	KubeletPorts *[]uint16 `json:"kubeletPorts,omitempty"`
	// Sidecar, when set, captures the pod as its own sidecar's in-pod rules
	// would (Istio's sidecar mode) instead of for the node proxy: it is not
	// handed to the node proxy, and DNS and BypassInbound do not apply.
	Sidecar *Sidecar `json:"sidecar,omitempty"`
}

// Sidecar is the capture of a pod whose proxy is one of its own containers,
// as Istio's sidecar injection and istio-cni set it up: outbound to 15001,
// inbound to 15006, the lists its annotations give.
type Sidecar struct {
	// ProxyUID is the uid the proxy container runs as: its processes are the
	// proxy while its cgroup is not known (any container of the pod can run as
	// it too).
	ProxyUID uint32 `json:"proxyUID"`
	// ProxyContainer is the proxy container's runtime id once it runs (from
	// the pod's status), and CgroupUID the uid its pod's cgroup is named
	// after: together they name the container's cgroup, whose processes are
	// then the proxy and no one else.
	ProxyContainer string `json:"proxyContainer,omitempty"`
	CgroupUID      string `json:"cgroupUID,omitempty"`
	// The ports and destinations never captured.
	InboundExcludedPorts  []uint16       `json:"inboundExcludedPorts,omitempty"`
	OutboundExcludedPorts []uint16       `json:"outboundExcludedPorts,omitempty"`
	ExcludedCIDRs         []netip.Prefix `json:"excludedCIDRs,omitempty"`
	// OutboundCIDRsOnly redirects only IncludedCIDRs and, to any
	// destination, OutboundIncludedPorts.
	OutboundCIDRsOnly     bool           `json:"outboundCIDRsOnly,omitempty"`
	IncludedCIDRs         []netip.Prefix `json:"includedCIDRs,omitempty"`
	OutboundIncludedPorts []uint16       `json:"outboundIncludedPorts,omitempty"`
	// InboundPortsOnly captures only InboundIncludedPorts (none when empty).
	InboundPortsOnly     bool     `json:"inboundPortsOnly,omitempty"`
	InboundIncludedPorts []uint16 `json:"inboundIncludedPorts,omitempty"`
	// DNS sends the pod's DNS to the sidecar's resolver (15053).
	DNS bool `json:"dns,omitempty"`
}

// Equal reports whether c and o capture the same way.
func (c Capture) Equal(o Capture) bool {
	eqPtr := func(a, b *bool) bool { return (a == nil) == (b == nil) && (a == nil || *a == *b) }
	eqPorts := func(a, b *[]uint16) bool { return (a == nil) == (b == nil) && (a == nil || slices.Equal(*a, *b)) }
	eqSidecar := func(a, b *Sidecar) bool { return (a == nil) == (b == nil) && (a == nil || reflect.DeepEqual(*a, *b)) }
	return eqPtr(c.DNS, o.DNS) && c.BypassInbound == o.BypassInbound && eqPorts(c.KubeletPorts, o.KubeletPorts) &&
		eqSidecar(c.Sidecar, o.Sidecar)
}

// SourceAdopted is the Source of a record the agent made for a pod that was
// already running when it started (installed on a live node): no entry point
// ever asked for it, so its key is the agent's reading of the host, and the
// runtime's DEL may name the attachment differently (matched by pod uid).
const SourceAdopted = "ADOPTED"

const (
	recordSuffix = ".json"
	// tempPrefix started the temporary files of agents that wrote records
	// without atomicfile; Open still removes their leftovers.
	tempPrefix = ".tmp-"
	dirMode    = 0o700
	fileMode   = 0o600
)

// Store is the set of records in one directory, cached in memory.
type Store struct {
	dir     string
	mu      sync.Mutex
	records map[Key]Record
}

// Open loads every record in dir (created 0700 if missing). Stray temporary files
// from an interrupted write are removed; a record that cannot be parsed is moved
// aside with a ".corrupt" suffix and reported in the returned problems, so one bad
// file never stops the agent.
func Open(dir string) (*Store, []error, error) {
	if err := os.MkdirAll(dir, dirMode); err != nil {
		return nil, nil, fmt.Errorf("create pod state directory %q: %w", dir, err)
	}
	if err := os.Chmod(dir, dirMode); err != nil {
		return nil, nil, fmt.Errorf("set mode of pod state directory %q: %w", dir, err)
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, nil, fmt.Errorf("read pod state directory %q: %w", dir, err)
	}
	s := &Store{dir: dir, records: make(map[Key]Record)}
	var problems []error
	for _, e := range entries {
		name := e.Name()
		path := filepath.Join(dir, name)
		switch {
		case strings.HasPrefix(name, atomicfile.TempPrefix), strings.HasPrefix(name, tempPrefix):
			if err := os.Remove(path); err != nil {
				problems = append(problems, fmt.Errorf("remove interrupted write %q: %w", path, err))
			}
		case strings.HasSuffix(name, recordSuffix) && e.Type().IsRegular():
			rec, err := readRecord(path)
			if err == nil && rec.Key.fileName() != name {
				err = fmt.Errorf("pod record %q holds %s, whose record has another name", path, rec.Key)
			}
			if err != nil {
				problems = append(problems, err)
				if rerr := os.Rename(path, path+".corrupt"); rerr != nil {
					problems = append(problems, fmt.Errorf("move aside %q: %w", path, rerr))
				}
				continue
			}
			s.records[rec.Key] = rec
		}
	}
	return s, problems, nil
}

func readRecord(path string) (Record, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return Record{}, fmt.Errorf("read pod record %q: %w", path, err)
	}
	var rec Record
	if err := json.Unmarshal(data, &rec); err != nil {
		return Record{}, fmt.Errorf("parse pod record %q: %w", path, err)
	}
	if rec.Key.Network == "" || rec.Key.ContainerID == "" || rec.Key.Ifname == "" {
		return Record{}, fmt.Errorf("pod record %q has an incomplete key", path)
	}
	return rec, nil
}

// Dir is the directory the store lives in.
func (s *Store) Dir() string { return s.dir }

// Get returns the record for k.
func (s *Store) Get(k Key) (Record, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.records[k]
	return r, ok
}

// List returns all records, sorted by key.
func (s *Store) List() []Record {
	s.mu.Lock()
	out := make([]Record, 0, len(s.records))
	for _, r := range s.records {
		out = append(out, r)
	}
	s.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].Key.String() < out[j].Key.String() })
	return out
}

// Len is the number of records.
func (s *Store) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.records)
}

// Put writes rec durably and then caches it.
func (s *Store) Put(rec Record) error {
	data, err := json.Marshal(rec)
	if err != nil {
		return fmt.Errorf("encode pod record %s: %w", rec.Key, err)
	}
	// No fsync: a record describes pods of the current boot only (after a
	// reboot every network namespace it names is gone), and the page cache
	// survives a crash of the agent itself; the rename keeps every record whole.
	// fsync cost milliseconds per pod on a disk-backed /run.
	opts := atomicfile.Options{Mode: fileMode, NoSync: true}
	if err := atomicfile.WriteFile(filepath.Join(s.dir, rec.Key.fileName()), data, opts); err != nil {
		return fmt.Errorf("store pod record %s: %w", rec.Key, err)
	}
	s.mu.Lock()
	s.records[rec.Key] = rec
	s.mu.Unlock()
	return nil
}

// Delete removes the record for k; a missing record is not an error.
func (s *Store) Delete(k Key) error {
	path := filepath.Join(s.dir, k.fileName())
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("delete pod record %s: %w", k, err)
	}
	s.mu.Lock()
	delete(s.records, k)
	s.mu.Unlock()
	return nil
}

// Read loads the records in dir without changing anything (no clean-up of
// interrupted writes, nothing moved aside): for tools that inspect a node.
func Read(dir string) ([]Record, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("read pod state directory %q: %w", dir, err)
	}
	var out []Record
	var errs []error
	for _, e := range entries {
		if !strings.HasSuffix(e.Name(), recordSuffix) || !e.Type().IsRegular() {
			continue
		}
		rec, err := readRecord(filepath.Join(dir, e.Name()))
		if err != nil {
			errs = append(errs, err)
			continue
		}
		out = append(out, rec)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key.String() < out[j].Key.String() })
	return out, errors.Join(errs...)
}
