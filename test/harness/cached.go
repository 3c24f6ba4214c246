package harness

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// cachedBuildTimeout bounds one cold build of a hack/ script: istiod and
// istio-cni, the longest, take about eleven minutes on two cores with their
// downloads.
const cachedBuildTimeout = 30 * time.Minute

// CachedBuild runs one of the repository's hack/ build scripts (which build
// from the Go module proxy into a cache outside the repository, or find the
// cache filled) with args, and returns the directory it printed last.
func CachedBuild(ctx context.Context, script string, args ...string) (string, error) {
	root, err := ModuleRoot(ctx)
	if err != nil {
		return "", err
	}
	path := filepath.Join(root, "hack", script)
	ctx, cancel := context.WithTimeout(ctx, cachedBuildTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", append([]string{path}, args...)...)
	cmd.Dir = root
	var stdout, stderr bytes.Buffer
	cmd.Stdout = &stdout
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("%s %s: %w\n%s", path, strings.Join(args, " "), err, stderr.String())
	}
	lines := strings.Split(strings.TrimSpace(stdout.String()), "\n")
	dir := strings.TrimSpace(lines[len(lines)-1])
	if !filepath.IsAbs(dir) {
		return "", fmt.Errorf("%s printed %q, not a directory", path, dir)
	}
	return dir, nil
}

// EnvIstioBinDir names the environment variable holding a directory with
// hack/build-istio.sh's binaries (istiod, istio-cni, istio-inpod). When it is
// unset, IstioBinDir runs the script.
const EnvIstioBinDir = "MESH_CNI_ISTIO_BIN_DIR"

// IstioBinDir returns $MESH_CNI_ISTIO_BIN_DIR, or else the cache directory
// hack/build-istio.sh builds (minutes, cold) or finds filled.
func IstioBinDir(ctx context.Context) (string, error) {
	if dir := os.Getenv(EnvIstioBinDir); dir != "" {
		return dir, nil
	}
	dir, err := CachedBuild(ctx, "build-istio.sh")
	if err != nil {
		return "", fmt.Errorf("istiod and istio-cni: %w", err)
	}
	return dir, nil
}
