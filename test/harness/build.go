package harness

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"testing"
)

// EnvBinDir names the environment variable holding the directory with prebuilt
// binaries. When it is set, Main builds nothing and uses the binaries found there;
// when it is not, Main builds into a temporary directory and sets it for the tests.
const EnvBinDir = "MESH_CNI_BIN_DIR"

// ReferencePlugins returns the reference CNI plugins that make up a node's primary
// network in the tests (every Primary's plugin, host-local, loopback) and the
// meta plugins chained after mesh-cni (portmap, bandwidth, tuning), by binary name
// -> import path. They are built at the version pinned in go.mod (as `tool`
// entries); the Makefile's build target builds the same list.
func ReferencePlugins() map[string]string {
	const base = "github.com/containernetworking/plugins/plugins/"
	return map[string]string{
		"bridge":     base + "main/bridge",
		"ptp":        base + "main/ptp",
		"ipvlan":     base + "main/ipvlan",
		"macvlan":    base + "main/macvlan",
		"host-local": base + "ipam/host-local",
		"loopback":   base + "main/loopback",
		"portmap":    base + "meta/portmap",
		"bandwidth":  base + "meta/bandwidth",
		"tuning":     base + "meta/tuning",
	}
}

// ProductBinaries returns mesh-cni's own binaries, the reference proxy used by the
// end-to-end tests and the ztunnel double, by binary name -> import path.
func ProductBinaries() map[string]string {
	return map[string]string{
		"mesh-cni":   "github.com/mesh-cni/mesh-cni/cmd/mesh-cni",
		"mesh-agent": "github.com/mesh-cni/mesh-cni/cmd/mesh-agent",
		"refproxy":   "github.com/mesh-cni/mesh-cni/test/cmd/refproxy",
		"ztunnel":    "github.com/mesh-cni/mesh-cni/test/cmd/ztunnel",
	}
}

// AllBinaries are ReferencePlugins and ProductBinaries together: what a suite
// that runs mesh-cni's own binaries on a node builds.
func AllBinaries() map[string]string {
	all := ReferencePlugins()
	maps.Copy(all, ProductBinaries())
	return all
}

// ReferencePluginNames are the binary names of ReferencePlugins, sorted: the plugins a
// node's CNI bin dir holds by default.
func ReferencePluginNames() []string {
	return sortedKeys(ReferencePlugins())
}

// Build compiles each package into dir/<name> with `go build`, run from the module
// root so the versions pinned in go.mod apply. Packages whose import path ends in
// their binary name are built by one go invocation, which shares the work.
func Build(ctx context.Context, dir string, pkgs map[string]string) error {
	if len(pkgs) == 0 {
		return nil
	}
	root, err := ModuleRoot(ctx)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("create bin dir: %w", err)
	}
	var together []string
	for _, name := range sortedKeys(pkgs) {
		if name == "" || strings.ContainsRune(name, '/') {
			return fmt.Errorf("binary name %q: must be a plain file name", name)
		}
		pkg := pkgs[name]
		if path.Base(pkg) == name {
			together = append(together, pkg)
			continue
		}
		if err := goBuild(ctx, root, filepath.Join(dir, name), pkg); err != nil {
			return err
		}
	}
	if len(together) > 0 {
		// A trailing separator makes go build write every main package into the
		// directory under its base name.
		if err := goBuild(ctx, root, dir+string(os.PathSeparator), together...); err != nil {
			return err
		}
	}
	return nil
}

func goBuild(ctx context.Context, root, out string, pkgs ...string) error {
	args := append([]string{"build", "-o", out}, pkgs...)
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = root
	var output bytes.Buffer
	cmd.Stdout = &output
	cmd.Stderr = &output
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("go %s (in %s): %w\n%s", strings.Join(args, " "), root, err, output.String())
	}
	return nil
}

// ModuleRoot returns the directory holding go.mod for the current working directory,
// as `go env GOMOD` reports it.
func ModuleRoot(ctx context.Context) (string, error) {
	out, err := exec.CommandContext(ctx, "go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %w", err)
	}
	gomod := strings.TrimSpace(string(out))
	if gomod == "" || gomod == os.DevNull {
		return "", errors.New("go env GOMOD: not inside a Go module")
	}
	return filepath.Dir(gomod), nil
}

// Binaries is a directory of built (or prebuilt) executables.
type Binaries struct {
	Dir string
}

// Bins returns the binaries Main prepared for this test binary (or $MESH_CNI_BIN_DIR).
func Bins(tb testing.TB) *Binaries {
	tb.Helper()
	dir := os.Getenv(EnvBinDir)
	if dir == "" {
		tb.Fatalf("$%s is not set: call harness.Main from TestMain, or build the binaries and point %s at them", EnvBinDir, EnvBinDir)
	}
	return &Binaries{Dir: dir}
}

// Path returns where the binary called name is (whether or not it exists).
func (b *Binaries) Path(name string) string {
	return filepath.Join(b.Dir, name)
}

// Check reports an error naming every binary in names that is missing or not
// executable.
func (b *Binaries) Check(names ...string) error {
	var errs []error
	for _, name := range names {
		st, err := os.Stat(b.Path(name))
		switch {
		case err != nil:
			errs = append(errs, fmt.Errorf("binary %q: %w", name, err))
		case !st.Mode().IsRegular() || st.Mode().Perm()&0o111 == 0:
			errs = append(errs, fmt.Errorf("binary %q at %s is not an executable file (mode %v)", name, b.Path(name), st.Mode()))
		}
	}
	return errors.Join(errs...)
}

// Require fails the test unless every binary in names is present.
func (b *Binaries) Require(tb testing.TB, names ...string) {
	tb.Helper()
	if err := b.Check(names...); err != nil {
		tb.Fatalf("binaries in %s: %v (built by harness.Main's Options.Packages, or by `make build` into $%s)", b.Dir, err, EnvBinDir)
	}
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
