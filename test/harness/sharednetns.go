package harness

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// ShareNetnsDir makes NetnsDir a shared mount point, as `ip netns add` does the
// first time it runs on a machine (and leaves it so). A process that binds the
// directory into a mount namespace of its own, as istio-cni's node agent sees
// the host's under /host, then sees the namespaces mounted there afterwards; on
// a machine whose root mount is private it otherwise sees only empty files.
//
// Making a plain directory a mount point moves the namespaces already mounted
// in it, so that is refused while any are: call it before making namespaces
// (make test does the same with ip netns before the suite starts).
func ShareNetnsDir() error {
	if err := os.MkdirAll(NetnsDir, 0o755); err != nil {
		return err
	}
	err := unix.Mount("", NetnsDir, "none", unix.MS_SHARED|unix.MS_REC, "")
	if err == nil || !errors.Is(err, unix.EINVAL) {
		return err
	}
	// Not a mount point yet.
	entries, err := os.ReadDir(NetnsDir)
	if err != nil {
		return err
	}
	if len(entries) > 0 {
		return fmt.Errorf("%s is not a shared mount point and holds %d namespaces already: run `ip netns add x && ip netns delete x` with none mounted, or make test", NetnsDir, len(entries))
	}
	if err := unix.Mount(NetnsDir, NetnsDir, "none", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("bind %s onto itself: %w", NetnsDir, err)
	}
	if err := unix.Mount("", NetnsDir, "none", unix.MS_SHARED|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("make %s shared: %w", NetnsDir, err)
	}
	return nil
}
