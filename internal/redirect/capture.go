package redirect

import (
	"errors"
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"
)

// CgroupRef names a cgroup the way the data path matches it: its id (the
// directory's inode on cgroupfs, never reused) and its depth below the cgroup v2
// root, for bpf_get_current_ancestor_cgroup_id. The zero value names none.
type CgroupRef struct {
	ID    uint64
	Level uint32
}

// CgroupRef resolves a cgroup path as SetProxyCgroups takes it (absolute, or
// relative to this data path's cgroup v2 root).
func (d *Datapath) CgroupRef(path string) (CgroupRef, error) {
	id, level, err := cgroupIDLevel(d.cgroup, d.cgroupPath(path))
	return CgroupRef{ID: id, Level: level}, err
}

// Capture is what an in-pod sidecar's capture adds to a pod's settings: Istio's
// sidecar mode, where the proxy is one of the pod's own containers and the pod's
// annotations narrow what is captured. The zero value adds nothing.
type Capture struct {
	// ProxyCgroup, when set, is the pod's own proxy: processes of this cgroup
	// (the sidecar container's) and below it. Their connects are never
	// redirected and their connections into the pod never captured.
	ProxyCgroup CgroupRef
	// LocalToInbound sends the proxy's connects to the pod's local addresses
	// other than 127.0.0.1 and ::1 (its own address, 127.0.0.6) to its inbound
	// port, with their original destination, as Istio's sidecar rules do for
	// the proxy's uid: but from a socket bound to 127.0.0.6 or ::6 (the
	// proxy's inbound passthrough), to Istio's tunnel port 15008, or to port 53
	// with DNS capture.
	LocalToInbound bool
	// OutboundCIDRsOnly redirects only outbound connects to IncludedCIDRs
	// (after the exclusions), and, whatever the destination, to
	// OutboundIncludedPorts.
	OutboundCIDRsOnly     bool
	IncludedCIDRs         []netip.Prefix
	OutboundIncludedPorts []uint16
	// InboundPortsOnly captures only inbound connections to
	// InboundIncludedPorts (none when empty).
	InboundPortsOnly     bool
	InboundIncludedPorts []uint16
}

// IsZero reports whether c adds nothing: the pod has no pod_capture entry.
func (c Capture) IsZero() bool {
	return c.ProxyCgroup == CgroupRef{} && !c.LocalToInbound && !c.OutboundCIDRsOnly && !c.InboundPortsOnly &&
		len(c.IncludedCIDRs) == 0 && len(c.OutboundIncludedPorts) == 0 && len(c.InboundIncludedPorts) == 0
}

func (c Capture) validate() []error {
	var errs []error
	if c.ProxyCgroup.ID == 0 && c.ProxyCgroup.Level != 0 {
		errs = append(errs, errors.New("proxy cgroup with a level and no id"))
	}
	if len(c.IncludedCIDRs) > 0 && !c.OutboundCIDRsOnly {
		errs = append(errs, errors.New("included CIDRs without OutboundCIDRsOnly"))
	}
	if len(c.OutboundIncludedPorts) > 0 && !c.OutboundCIDRsOnly {
		errs = append(errs, errors.New("included outbound ports without OutboundCIDRsOnly"))
	}
	if len(c.InboundIncludedPorts) > 0 && !c.InboundPortsOnly {
		errs = append(errs, errors.New("included inbound ports without InboundPortsOnly"))
	}
	errs = append(errs, validatePrefixes("included CIDR", c.IncludedCIDRs)...)
	errs = append(errs, validatePortList("outbound included", c.OutboundIncludedPorts)...)
	errs = append(errs, validatePortList("inbound included", c.InboundIncludedPorts)...)
	return errs
}

func (c Capture) normalized() Capture {
	n := c
	n.IncludedCIDRs = normalizePrefixes(c.IncludedCIDRs)
	n.OutboundIncludedPorts = normalizePorts(c.OutboundIncludedPorts)
	n.InboundIncludedPorts = normalizePorts(c.InboundIncludedPorts)
	return n
}

// captureSets are the sets a pod's pod_capture entry names.
type captureSets struct{ included, outPorts, inPorts uint32 }

func captureSetsOf(v redirectPodCaptureInfo) captureSets {
	return captureSets{v.IncludedSet, v.OutboundIncludeSet, v.InboundIncludeSet}
}

func (c Capture) toBPF(cs captureSets) redirectPodCaptureInfo {
	v := redirectPodCaptureInfo{
		Proxy:              redirectProxyCgroup{Id: c.ProxyCgroup.ID, Level: c.ProxyCgroup.Level},
		IncludedSet:        cs.included,
		OutboundIncludeSet: cs.outPorts,
		InboundIncludeSet:  cs.inPorts,
	}
	setFlag(&v.Flags, c.ProxyCgroup.ID != 0, redirectCaptureFlagsCAPTURE_PROXY_CGROUP)
	setFlag(&v.Flags, c.LocalToInbound, redirectCaptureFlagsCAPTURE_LOCAL_TO_INBOUND)
	setFlag(&v.Flags, c.OutboundCIDRsOnly, redirectCaptureFlagsCAPTURE_INCLUDED_CIDRS)
	setFlag(&v.Flags, cs.outPorts != 0, redirectCaptureFlagsCAPTURE_INCLUDED_OUTBOUND_PORTS)
	setFlag(&v.Flags, c.InboundPortsOnly, redirectCaptureFlagsCAPTURE_INCLUDED_INBOUND_PORTS)
	return v
}

func (d *Datapath) captureFromBPF(v redirectPodCaptureInfo) Capture {
	c := Capture{
		LocalToInbound:    v.Flags&redirectCaptureFlagsCAPTURE_LOCAL_TO_INBOUND != 0,
		OutboundCIDRsOnly: v.Flags&redirectCaptureFlagsCAPTURE_INCLUDED_CIDRS != 0,
		InboundPortsOnly:  v.Flags&redirectCaptureFlagsCAPTURE_INCLUDED_INBOUND_PORTS != 0,
	}
	if v.Flags&redirectCaptureFlagsCAPTURE_PROXY_CGROUP != 0 {
		c.ProxyCgroup = CgroupRef{ID: v.Proxy.Id, Level: v.Proxy.Level}
	}
	if c.OutboundCIDRsOnly {
		c.IncludedCIDRs = normalizePrefixes(d.excluded.members(v.IncludedSet))
		if v.Flags&redirectCaptureFlagsCAPTURE_INCLUDED_OUTBOUND_PORTS != 0 {
			c.OutboundIncludedPorts = normalizePorts(d.ports.members(v.OutboundIncludeSet))
		}
	}
	if c.InboundPortsOnly {
		c.InboundIncludedPorts = normalizePorts(d.ports.members(v.InboundIncludeSet))
	}
	return c
}

// podCapture reads the pod's pod_capture entry; nil when it has none.
func (d *Datapath) podCapture(cookie uint64) (*redirectPodCaptureInfo, error) {
	return podEntry[redirectPodCaptureInfo](d.objs.PodCapture, cookie, "pod_capture")
}

// putCapture writes the pod's pod_capture entry for c, or removes it for a zero
// c. undo puts back what was there (before the pods entry is written, a failure
// must leave the pod as it was); done releases the sets the replaced entry named.
// Callers hold mapMu.
func (d *Datapath) putCapture(cookie uint64, c Capture) (undo, done func(), _ error) {
	old, err := d.podCapture(cookie)
	if err != nil {
		return nil, nil, err
	}
	var cs captureSets
	if !c.IsZero() {
		var errs acquisitions
		id, err := d.excluded.acquire(c.IncludedCIDRs)
		errs.take(&cs.included, id, err)
		id, err = d.ports.acquire(c.OutboundIncludedPorts)
		errs.take(&cs.outPorts, id, err)
		id, err = d.ports.acquire(c.InboundIncludedPorts)
		errs.take(&cs.inPorts, id, err)
		if err := errors.Join(errs...); err != nil {
			d.releaseCaptureSets(cs)
			return nil, nil, err
		}
		err = d.objs.PodCapture.Put(cookie, c.toBPF(cs))
		if err != nil {
			d.releaseCaptureSets(cs)
			return nil, nil, fmt.Errorf("write pod_capture entry: %w", err)
		}
	} else if old != nil {
		if err := d.objs.PodCapture.Delete(cookie); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return nil, nil, fmt.Errorf("delete pod_capture entry: %w", err)
		}
	}
	undo = func() {
		if old != nil {
			_ = d.objs.PodCapture.Put(cookie, *old)
		} else {
			_ = d.objs.PodCapture.Delete(cookie)
		}
		d.releaseCaptureSets(cs)
	}
	done = func() {
		if old != nil {
			d.releaseCaptureSets(captureSetsOf(*old))
		}
	}
	return undo, done, nil
}

// deleteCapture removes the pod's pod_capture entry and releases its sets.
// Callers hold mapMu.
func (d *Datapath) deleteCapture(cookie uint64) error {
	old, err := d.podCapture(cookie)
	if err != nil || old == nil {
		return err
	}
	if err := d.objs.PodCapture.Delete(cookie); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("delete pod_capture entry: %w", err)
	}
	d.releaseCaptureSets(captureSetsOf(*old))
	return nil
}

func (d *Datapath) releaseCaptureSets(cs captureSets) {
	d.excluded.release(cs.included)
	d.ports.release(cs.outPorts)
	d.ports.release(cs.inPorts)
}
