package redirect

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// HookState is one cgroup socket program's attachment, as pinned.
type HookState struct {
	Name     string `json:"name"`
	Pinned   bool   `json:"pinned"`
	Attached bool   `json:"attached"`
	// CgroupID is the cgroup the link is attached to (0 when detached).
	CgroupID uint64 `json:"cgroupID,omitempty"`
	Problem  string `json:"problem,omitempty"`
}

// LinkState is one pod interface's pinned TCX link.
type LinkState struct {
	Name     string `json:"name"`
	Index    int    `json:"index"`
	Attached bool   `json:"attached"`
}

// PodState is one enrolled network namespace, as pinned.
type PodState struct {
	Cookie uint64      `json:"netnsCookie"`
	Links  []LinkState `json:"links"`
}

// Snapshot is the pinned data path as it stands, read without loading programs
// or changing anything: what `mesh-agent status` and `check` show, whether or not
// an agent runs.
type Snapshot struct {
	PinRoot  string      `json:"pinRoot"`
	Hooks    []HookState `json:"hooks"`
	Pods     []PodState  `json:"pods"`
	Counters Counters    `json:"counters"`
}

// ErrNotInstalled: nothing is pinned under the root.
var ErrNotInstalled = errors.New("no data path is pinned there")

// Inspect reads the data path pinned under pinRoot, read-only.
func Inspect(ctx context.Context, pinRoot string) (Snapshot, error) {
	pins := layout(filepath.Clean(pinRoot))
	snap := Snapshot{PinRoot: string(pins)}
	if err := ctx.Err(); err != nil {
		return snap, err
	}
	readOnly := &ebpf.LoadPinOptions{ReadOnly: true}
	settings, err := ebpf.LoadPinnedMap(filepath.Join(pins.maps(), "settings"), readOnly)
	if errors.Is(err, os.ErrNotExist) {
		return snap, fmt.Errorf("%s: %w", pinRoot, ErrNotInstalled)
	}
	if err != nil {
		return snap, fmt.Errorf("open pinned settings map: %w", err)
	}
	defer settings.Close()

	for _, h := range cgroupHooks {
		snap.Hooks = append(snap.Hooks, inspectHook(filepath.Join(pins.links(), h.name), h.name))
	}

	var cookie uint64
	value := make([]byte, settings.ValueSize())
	it := settings.Iterate()
	for it.Next(&cookie, &value) {
		pod := PodState{Cookie: cookie}
		podPins, err := readPodPins(pins.pod(cookie))
		if err != nil {
			return snap, err
		}
		for _, p := range podPins {
			pod.Links = append(pod.Links, LinkState{Name: p.name, Index: p.index, Attached: tcxAttached(p.path)})
		}
		snap.Pods = append(snap.Pods, pod)
	}
	if err := it.Err(); err != nil {
		return snap, fmt.Errorf("iterate settings map: %w", err)
	}
	slices.SortFunc(snap.Pods, func(a, b PodState) int {
		switch {
		case a.Cookie < b.Cookie:
			return -1
		case a.Cookie > b.Cookie:
			return 1
		}
		return 0
	})

	counters, err := ebpf.LoadPinnedMap(filepath.Join(pins.maps(), "counters"), readOnly)
	if err != nil {
		return snap, fmt.Errorf("open pinned counters map: %w", err)
	}
	defer counters.Close()
	snap.Counters, err = sumCounters(counters)
	return snap, err
}

func inspectHook(path, name string) HookState {
	st := HookState{Name: name}
	l, err := link.LoadPinnedLink(path, nil)
	if err != nil {
		st.Problem = err.Error()
		return st
	}
	defer l.Close()
	st.Pinned = true
	info, err := l.Info()
	if err != nil {
		st.Problem = err.Error()
		return st
	}
	if cg := info.Cgroup(); cg != nil && cg.CgroupId != 0 {
		st.Attached, st.CgroupID = true, cg.CgroupId
	} else {
		st.Problem = "detached"
	}
	return st
}

func tcxAttached(path string) bool {
	l, err := link.LoadPinnedLink(path, nil)
	if err != nil {
		return false
	}
	defer l.Close()
	info, err := l.Info()
	return err == nil && info.TCX() != nil && info.TCX().Ifindex != 0
}
