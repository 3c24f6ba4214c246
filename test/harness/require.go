package harness

import (
	"os"
	"testing"
)

// RequireRoot stops tb unless the test runs as root, which network
// namespaces, BPF, netfilter rules and mounts need; why says what this test
// does with it.
//
// Where root is expected, its absence fails the test instead of skipping it:
// a suite that skipped everything would pass without having tested anything.
// Root is expected in CI (CI set) and in a run started by make, which sets
// MESH_CNI_BIN_DIR and is documented to run as root. Elsewhere (a developer's
// plain go test as a user) the test is skipped, saying why.
func RequireRoot(tb testing.TB, why string) {
	tb.Helper()
	if os.Geteuid() == 0 {
		return
	}
	if rootExpected() {
		tb.Fatalf("needs root (%s), and this run (CI or make) is meant to run as root", why)
	}
	tb.Skipf("needs root: %s", why)
}

func rootExpected() bool {
	return os.Getenv("CI") != "" || os.Getenv("MESH_CNI_BIN_DIR") != ""
}
