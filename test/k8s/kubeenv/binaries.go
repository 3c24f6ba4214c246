package kubeenv

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/mesh-cni/mesh-cni/test/harness"
)

// EnvBinDir names the environment variable holding a directory with prebuilt
// kube-apiserver and etcd binaries. When it is unset, EnsureBinaries runs
// hack/build-kube.sh, which builds them from the Go module proxy into its cache
// (outside the repository) or finds them there.
const EnvBinDir = "MESH_CNI_KUBE_BIN_DIR"

// Binaries are the kube-apiserver and etcd executables.
type Binaries struct {
	Dir string
}

// APIServer is the kube-apiserver binary's path.
func (b Binaries) APIServer() string { return filepath.Join(b.Dir, "kube-apiserver") }

// Etcd is the etcd binary's path.
func (b Binaries) Etcd() string { return filepath.Join(b.Dir, "etcd") }

func (b Binaries) check() error {
	return CheckExecutables(b.APIServer(), b.Etcd())
}

// CheckExecutables returns an error naming each of paths that is missing or
// not executable.
func CheckExecutables(paths ...string) error {
	var errs []error
	for _, p := range paths {
		st, err := os.Stat(p)
		switch {
		case err != nil:
			errs = append(errs, err)
		case st.Mode().Perm()&0o111 == 0:
			errs = append(errs, fmt.Errorf("%s is not executable", p))
		}
	}
	return errors.Join(errs...)
}

// EnsureBinaries returns the binaries from $MESH_CNI_KUBE_BIN_DIR, or builds
// (or finds cached) ones with hack/build-kube.sh and sets the variable, so
// later calls and child test processes find them at once. Call it from
// TestMain, before m.Run: a cold build then does not count against the test
// timeout.
func EnsureBinaries(ctx context.Context) (Binaries, error) {
	if dir := os.Getenv(EnvBinDir); dir != "" {
		b := Binaries{Dir: dir}
		if err := b.check(); err != nil {
			return b, fmt.Errorf("$%s=%s: %w", EnvBinDir, dir, err)
		}
		return b, nil
	}
	dir, err := harness.CachedBuild(ctx, "build-kube.sh")
	if err != nil {
		return Binaries{}, err
	}
	b := Binaries{Dir: dir}
	if err := b.check(); err != nil {
		return b, fmt.Errorf("hack/build-kube.sh printed %q: %w", b.Dir, err)
	}
	if err := os.Setenv(EnvBinDir, b.Dir); err != nil {
		return b, err
	}
	return b, nil
}

// FromEnv returns the binaries EnsureBinaries found, for tests.
func FromEnv() (Binaries, error) {
	dir := os.Getenv(EnvBinDir)
	if dir == "" {
		return Binaries{}, fmt.Errorf("$%s is not set: call kubeenv.EnsureBinaries from TestMain", EnvBinDir)
	}
	b := Binaries{Dir: dir}
	return b, b.check()
}
