package redirect

import (
	"errors"
	"fmt"
	"os"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/features"

	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/internal/netns"
)

// KernelFloor is the oldest Linux release with every feature the data path uses.
const KernelFloor = "5.15"

// Feature is one kernel facility the data path needs, with the release that
// brought it.
type Feature struct {
	Name  string `json:"name"`
	Since string `json:"since"`
	probe func() error
}

// features lists what the data path needs, the newest last. Each probe loads a
// trivial program or map, or asks the kernel directly.
var kernelFeatures = []Feature{
	{"BPF socket local storage", "5.2", func() error { return features.HaveMapType(ebpf.SkStorage) }},
	{"bpf_get_current_ancestor_cgroup_id in cgroup sock_addr programs", "5.7",
		func() error { return features.HaveProgramHelper(ebpf.CGroupSockAddr, asm.FnGetCurrentAncestorCgroupId) }},
	{"sk_lookup programs", "5.9", func() error { return features.HaveProgramType(ebpf.SkLookup) }},
	{"bpf_sk_assign in sk_lookup programs", "5.9", func() error { return features.HaveProgramHelper(ebpf.SkLookup, asm.FnSkAssign) }},
	{"SO_NETNS_COOKIE", "5.14", func() error { _, err := netns.CurrentCookie(); return err }},
	// Listeners open before enrollment are taken from their process.
	{"pidfd_getfd", "5.6", probePidfdGetfd},
	{"bpf_get_netns_cookie in sock_ops programs", "5.15",
		func() error { return features.HaveProgramHelper(ebpf.SockOps, asm.FnGetNetnsCookie) }},
	{"bpf_get_netns_cookie in cgroup sockopt programs", "5.15",
		func() error { return features.HaveProgramHelper(ebpf.CGroupSockopt, asm.FnGetNetnsCookie) }},
}

// ErrKernelFeature is wrapped by errors about a missing kernel feature.
var ErrKernelFeature = errors.New("kernel lacks a feature the data path needs")

// MissingFeatures lists the features this kernel lacks (empty when it has all).
// A probe that fails for another reason (no privilege) counts as missing, with the
// reason.
func MissingFeatures() []error {
	var missing []error
	for _, f := range kernelFeatures {
		if err := f.probe(); err != nil {
			if errors.Is(err, ebpf.ErrNotSupported) {
				missing = append(missing, fmt.Errorf("%s (Linux %s or newer): %w", f.Name, f.Since, ErrKernelFeature))
			} else {
				missing = append(missing, fmt.Errorf("%s (Linux %s or newer): probe failed: %w: %w", f.Name, f.Since, err, ErrKernelFeature))
			}
		}
	}
	return missing
}

// CheckKernel returns an error naming every missing feature, or nil.
func CheckKernel() error {
	missing := MissingFeatures()
	if len(missing) == 0 {
		return nil
	}
	return fmt.Errorf("the data path needs Linux %s or newer: %w", KernelFloor, errors.Join(missing...))
}

// probePidfdGetfd takes a descriptor of this process from itself.
func probePidfdGetfd() error {
	pidfd, err := unix.PidfdOpen(os.Getpid(), 0)
	if err != nil {
		return fmt.Errorf("pidfd_open: %w", errOrUnsupported(err))
	}
	defer unix.Close(pidfd)
	fd, err := unix.PidfdGetfd(pidfd, 0, 0)
	if err != nil {
		return fmt.Errorf("pidfd_getfd: %w", errOrUnsupported(err))
	}
	return unix.Close(fd)
}

// errOrUnsupported maps ENOSYS (a kernel without the call) to ErrNotSupported.
func errOrUnsupported(err error) error {
	if errors.Is(err, unix.ENOSYS) {
		return ebpf.ErrNotSupported
	}
	return err
}
