package gate

import (
	"fmt"
	"maps"
	"slices"

	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

// FitPodMetadata makes a pod's labels and annotations fit the gate's bounds
// instead of letting one oversized entry refuse the pod (a large
// kubectl.kubernetes.io/last-applied-configuration annotation would otherwise
// keep the pod from ever starting, whatever the policy says). It returns a copy
// of pod, and one note per entry it changed, for the caller to log.
//
// What changes, and why no enrollment decision does:
//   - a value longer than the limit is replaced by a marker saying so. The key
//     stays, so selectors on its presence still match; selector values are
//     label values (at most 63 characters of [-A-Za-z0-9_.]), and the marker,
//     like the value it replaces, equals none of them.
//   - an entry whose key is empty or longer than any qualified name is dropped:
//     no selector can name it.
//   - beyond the entry limit, entries are dropped in key order, the last first.
//     A selector on a dropped key sees it absent; the pod's owner, who wrote
//     that many entries, could have left the key out as well, so nobody gains
//     a way around the mesh they did not already have.
func FitPodMetadata(pod *gatepb.PodIdentity) (*gatepb.PodIdentity, []string) {
	if pod == nil {
		return nil, nil
	}
	labels, ln := fitMetadata("label", pod.GetLabels())
	annotations, an := fitMetadata("annotation", pod.GetAnnotations())
	out := &gatepb.PodIdentity{
		Namespace:   pod.GetNamespace(),
		Name:        pod.GetName(),
		Uid:         pod.GetUid(),
		Labels:      labels,
		Annotations: annotations,
	}
	return out, append(ln, an...)
}

func fitMetadata(kind string, m map[string]string) (map[string]string, []string) {
	if m == nil {
		return nil, nil
	}
	var notes []string
	out := make(map[string]string, min(len(m), maxMetadata))
	keys := slices.Sorted(maps.Keys(m))
	for _, k := range keys {
		v := m[k]
		if k == "" || len(k) > maxMetaKeyLen {
			notes = append(notes, fmt.Sprintf("%s key %.80q dropped: empty or longer than %d", kind, k, maxMetaKeyLen))
			continue
		}
		if len(out) == maxMetadata {
			notes = append(notes, fmt.Sprintf("%s %.80q dropped: more than %d %ss", kind, k, maxMetadata, kind))
			continue
		}
		if len(v) > maxMetaValueLen {
			notes = append(notes, fmt.Sprintf("%s %.80q: %d-byte value not passed on (limit %d)", kind, k, len(v), maxMetaValueLen))
			v = fmt.Sprintf("<%d bytes: not passed on by mesh-agent>", len(v))
		}
		out[k] = v
	}
	return out, notes
}
