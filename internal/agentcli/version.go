package agentcli

import (
	"crypto/sha256"
	"fmt"
	"runtime"
	"runtime/debug"

	"github.com/mesh-cni/mesh-cni/internal/redirect"
)

// versionLine says what this build is: the module's version (a release tag when
// built with go install at one, "(devel)" from a checkout), the Go release, and a
// digest of the eBPF object it carries, which names the data path exactly (a
// reproducible build of the same sources gives the same).
func versionLine() string {
	version := "(unknown)"
	if bi, ok := debug.ReadBuildInfo(); ok {
		version = bi.Main.Version
	}
	sum := sha256.Sum256(redirect.Object())
	return fmt.Sprintf("mesh-agent %s %s data path %x", version, runtime.Version(), sum[:8])
}
