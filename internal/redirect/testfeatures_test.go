package redirect

import (
	"errors"
	"os"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// The kernel features this package's tests need beyond what every supported
// kernel has, for fixtures.RequireFeature: a test skips for want of one only
// on a kernel older than the feature, or one that says it has it switched off.

// bpfLSMFeature is the BPF LSM, which --deny-packet-sockets attaches to
// socket_create. A kernel can have it and not run it: bpf missing from the
// LSMs it booted with, or a policy that refuses every BPF LSM program (this
// project's own test machine refuses even one that returns 0).
func bpfLSMFeature() fixtures.Feature {
	return fixtures.Feature{
		Name:  "BPF LSM programs",
		Since: fixtures.KernelVersion{Major: 5, Minor: 7},
		Off: func(error) string {
			if active, err := BPFLSMActive(); err == nil && !active {
				return "bpf is not among its active LSMs (/sys/kernel/security/lsm, the lsm= boot parameter)"
			}
			spec := &ebpf.ProgramSpec{Type: ebpf.LSM, AttachType: ebpf.AttachLSMMac, AttachTo: "socket_create",
				License: "GPL", Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 0), asm.Return()}}
			prog, err := ebpf.NewProgram(spec)
			if err == nil {
				prog.Close()
			}
			if errors.Is(err, unix.EPERM) {
				return "it refuses even a BPF LSM program that returns 0 to root (EPERM)"
			}
			return ""
		},
	}
}

// mptcpFeature is MPTCP in the network namespace of p, where a listener asked
// for it; net.mptcp.enabled is a per-namespace switch.
func mptcpFeature(p *pod) fixtures.Feature {
	return fixtures.Feature{
		Name:  "MPTCP",
		Since: fixtures.KernelVersion{Major: 5, Minor: 6},
		Off: func(error) string {
			var how string
			_ = netns.Do(p.path, func() error {
				b, err := os.ReadFile("/proc/sys/net/mptcp/enabled")
				switch {
				case errors.Is(err, os.ErrNotExist):
					how = "no net.mptcp sysctls: built without CONFIG_MPTCP"
				case err == nil && strings.TrimSpace(string(b)) == "0":
					how = "net.mptcp.enabled is 0"
				}
				return nil
			})
			return how
		},
	}
}

// tcxFeature is TCX links, which the release before socket lookup attached
// its inbound capture with: a node never ran that release on an older kernel.
func tcxFeature() fixtures.Feature {
	return fixtures.Feature{Name: "TCX links", Since: fixtures.KernelVersion{Major: 6, Minor: 6}}
}

// userNamespacesFeature is the user namespaces an unprivileged process makes
// for itself, which distributions can switch off by sysctl.
func userNamespacesFeature() fixtures.Feature {
	return fixtures.Feature{
		Name:  "unprivileged user namespaces",
		Since: fixtures.KernelVersion{Major: 3, Minor: 8},
		Off: func(error) string {
			for _, s := range []struct{ file, off string }{
				{"/proc/sys/kernel/unprivileged_userns_clone", "0"},
				{"/proc/sys/user/max_user_namespaces", "0"},
				{"/proc/sys/kernel/apparmor_restrict_unprivileged_userns", "1"},
			} {
				if b, err := os.ReadFile(s.file); err == nil && strings.TrimSpace(string(b)) == s.off {
					return strings.ReplaceAll(strings.TrimPrefix(s.file, "/proc/sys/"), "/", ".") + " is " + s.off
				}
			}
			return ""
		},
	}
}
