package redirect

import (
	"cmp"
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

// PodState is one enrolled network namespace, as pinned.
type PodState struct {
	Cookie uint64 `json:"netnsCookie"`
	// Attached: the pod's sk_lookup link is attached to a namespace.
	Attached bool `json:"attached"`
	// NetnsInode is the namespace the link is pinned for.
	NetnsInode uint64 `json:"netnsInode,omitempty"`
	// Listeners is how many of the inbound proxy's listeners are collected: 0
	// means connections to the pod fail closed (or pass, fail-open).
	Listeners int `json:"listeners"`
	// LegacyLinks are an earlier version's per-interface links still pinned.
	LegacyLinks []string `json:"legacyLinks,omitempty"`
	// Proxy says how the pod's own proxy (a sidecar) is told apart, when it
	// has one: by its container's cgroup, or, while that is not known, by
	// its uid, which any container of the pod can also run as.
	Proxy string `json:"proxy,omitempty"`
}

// Snapshot is the pinned data path as it stands, read without loading programs
// or changing anything: what `mesh-agent status` and `check` show, whether or not
// an agent runs.
type Snapshot struct {
	PinRoot  string      `json:"pinRoot"`
	Hooks    []HookState `json:"hooks"`
	Pods     []PodState  `json:"pods"`
	Refused  []Refusal   `json:"refusedListeners,omitempty"`
	Counters Counters    `json:"counters"`
}

// ErrNotInstalled is returned when nothing is pinned under the root.
var ErrNotInstalled = errors.New("no data path is pinned there")

// Inspect reads the data path pinned under pinRoot, read-only.
func Inspect(ctx context.Context, pinRoot string) (Snapshot, error) {
	pins := layout(filepath.Clean(pinRoot))
	snap := Snapshot{PinRoot: string(pins)}
	if err := ctx.Err(); err != nil {
		return snap, err
	}
	readOnly := &ebpf.LoadPinOptions{ReadOnly: true}
	pods, err := ebpf.LoadPinnedMap(filepath.Join(pins.maps(), "pods"), readOnly)
	if errors.Is(err, os.ErrNotExist) {
		return snap, fmt.Errorf("%s: %w", pinRoot, ErrNotInstalled)
	}
	if err != nil {
		return snap, fmt.Errorf("open pinned pods map: %w", err)
	}
	defer pods.Close()
	listeners, err := ebpf.LoadPinnedMap(filepath.Join(pins.maps(), "listeners"), readOnly)
	if err != nil {
		return snap, fmt.Errorf("open pinned listeners map: %w", err)
	}
	defer listeners.Close()
	// Pinned by builds that capture for sidecars.
	captures, err := ebpf.LoadPinnedMap(filepath.Join(pins.maps(), "pod_capture"), readOnly)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return snap, fmt.Errorf("open pinned pod_capture map: %w", err)
	}
	if captures != nil {
		defer captures.Close()
	}

	for _, h := range cgroupHooks {
		snap.Hooks = append(snap.Hooks, inspectHook(filepath.Join(pins.links(), h.name), h.name))
	}

	var (
		cookie uint64
		value  redirectPodSettings
	)
	it := pods.Iterate()
	for it.Next(&cookie, &value) {
		pod := PodState{Cookie: cookie, Listeners: countListeners(listeners, cookie, value.InboundPort)}
		var c redirectPodCaptureInfo
		if captures != nil && captures.Lookup(cookie, &c) == nil {
			pod.Proxy = sidecarProxy(value, c)
		}
		pp, err := readPodPins(pins.pod(cookie))
		if err != nil {
			return snap, err
		}
		if pp.lookup != nil {
			pod.NetnsInode = pp.lookup.ino
			pod.Attached = netnsLinkAttached(pp.lookup.path)
		}
		for _, l := range pp.legacy {
			pod.LegacyLinks = append(pod.LegacyLinks, filepath.Base(l))
		}
		snap.Pods = append(snap.Pods, pod)
	}
	if err := it.Err(); err != nil {
		return snap, fmt.Errorf("iterate pods map: %w", err)
	}
	slices.SortFunc(snap.Pods, func(a, b PodState) int { return cmp.Compare(a.Cookie, b.Cookie) })

	refused, err := ebpf.LoadPinnedMap(filepath.Join(pins.maps(), "listen_refused"), readOnly)
	if err != nil {
		return snap, fmt.Errorf("open pinned listen_refused map: %w", err)
	}
	defer refused.Close()
	if snap.Refused, err = readRefusals(refused); err != nil {
		return snap, err
	}

	counters, err := ebpf.LoadPinnedMap(filepath.Join(pins.maps(), "counters"), readOnly)
	if err != nil {
		return snap, fmt.Errorf("open pinned counters map: %w", err)
	}
	defer counters.Close()
	// Pinned by builds since the counters map's size was pinned.
	refusals, err := ebpf.LoadPinnedMap(filepath.Join(pins.maps(), "socket_refusals"), readOnly)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return snap, fmt.Errorf("open pinned socket_refusals map: %w", err)
	}
	if refusals != nil {
		defer refusals.Close()
	}
	snap.Counters, err = sumCounters(counters, refusals)
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

func netnsLinkAttached(path string) bool {
	l, info, err := pinnedLinkInfo(path)
	if err != nil {
		return false
	}
	defer l.Close()
	return info.NetNs() != nil && info.NetNs().NetnsInode != 0
}

// sidecarProxy says how a sidecar pod's proxy is known (PodState.Proxy).
func sidecarProxy(v redirectPodSettings, c redirectPodCaptureInfo) string {
	switch {
	case c.Flags&redirectCaptureFlagsCAPTURE_PROXY_CGROUP != 0:
		return fmt.Sprintf("sidecar container's cgroup (id %d)", c.Proxy.Id)
	case v.Flags&redirectSettingFlagsSETTING_PROXY_UID != 0:
		return fmt.Sprintf("uid %d: the sidecar container's cgroup is not known yet, and any container of the pod running as this uid passes as the proxy", v.ProxyUid)
	}
	return "none: every process of the pod is captured"
}
