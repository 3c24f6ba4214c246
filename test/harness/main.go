package harness

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/internal/netns"
)

// NetnsDir is where the harness mounts the network namespaces it makes, the same
// place `ip netns` uses.
const NetnsDir = "/run/netns"

// buildTimeout bounds the one build per test binary; a cold build of the reference
// plugins on a small shared machine takes a minute or two.
const buildTimeout = 15 * time.Minute

// Options configures Main.
type Options struct {
	// Packages are the binaries to build, binary name -> import path, e.g.
	// ReferencePlugins() or AllBinaries().
	Packages map[string]string
}

// Main is TestMain for packages that use the harness: it calls Run and exits with
// its code.
func Main(m *testing.M, opts Options) {
	os.Exit(Run(m, opts))
}

// Run prepares the binaries (building them unless $MESH_CNI_BIN_DIR is set, in which
// case it only checks they are there), runs the tests, then fails the run if anything
// the harness made in this process was left behind: network namespaces under
// /run/netns with this process's prefix, or child processes still running. Leftovers
// are reported and removed. Run returns the exit code for os.Exit.
func Run(m *testing.M, opts Options) int {
	cleanup, err := prepareBinaries(opts.Packages)
	if err != nil {
		fmt.Fprintf(os.Stderr, "harness: %v\n", err)
		return 1
	}
	defer cleanup()

	code := m.Run()
	if err := CheckLeaks(os.Stderr); err != nil {
		fmt.Fprintf(os.Stderr, "harness: FAIL: %v\n", err)
		if code == 0 {
			code = 1
		}
	}
	return code
}

func prepareBinaries(pkgs map[string]string) (func(), error) {
	if dir := os.Getenv(EnvBinDir); dir != "" {
		bins := &Binaries{Dir: dir}
		if err := bins.Check(sortedKeys(pkgs)...); err != nil {
			return nil, fmt.Errorf("prebuilt binaries in $%s=%s: %w", EnvBinDir, dir, err)
		}
		return func() {}, nil
	}
	dir, err := os.MkdirTemp("", "mesh-cni-bin-")
	if err != nil {
		return nil, fmt.Errorf("bin dir: %w", err)
	}
	remove := func() { os.RemoveAll(dir) }
	// Readable by everyone so a test can run a binary as an unprivileged user.
	if err := os.Chmod(dir, 0o755); err != nil {
		remove()
		return nil, fmt.Errorf("bin dir: %w", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), buildTimeout)
	defer cancel()
	if err := Build(ctx, dir, pkgs); err != nil {
		remove()
		return nil, fmt.Errorf("build (or build them elsewhere and set $%s): %w", EnvBinDir, err)
	}
	// The tests find the binaries the same way whether CI or Main built them.
	if err := os.Setenv(EnvBinDir, dir); err != nil {
		remove()
		return nil, fmt.Errorf("set $%s: %w", EnvBinDir, err)
	}
	return func() {
		os.Unsetenv(EnvBinDir)
		remove()
	}, nil
}

// NetnsPrefix is the name prefix of every network namespace this process makes; the
// pid keeps concurrent test binaries from seeing each other's namespaces as leaks.
func NetnsPrefix() string {
	return fmt.Sprintf("mcni-%d-", os.Getpid())
}

// CheckLeaks reports (to w) and removes what the harness made in this process and
// nobody cleaned up: network namespace mounts and files with NetnsPrefix, and child
// processes still running. It returns an error describing the leaks, nil if none.
func CheckLeaks(w io.Writer) error {
	var errs []error
	leaked, err := LeakedNetns()
	if err != nil {
		errs = append(errs, err)
	}
	if len(leaked) > 0 {
		errs = append(errs, fmt.Errorf("leaked network namespaces: %s", strings.Join(leaked, ", ")))
		for _, p := range leaked {
			if err := netns.Remove(p); err != nil {
				fmt.Fprintf(w, "harness: remove leaked netns %s: %v\n", p, err)
			}
		}
	}
	children, err := liveChildren()
	if err != nil {
		errs = append(errs, err)
	}
	if len(children) > 0 {
		var desc []string
		for _, c := range children {
			desc = append(desc, fmt.Sprintf("%d (%s)", c.pid, c.comm))
			// Our own children, by pid, while they are unreaped: the pid cannot
			// have been reused.
			if p, err := os.FindProcess(c.pid); err == nil {
				_ = p.Kill()
			}
		}
		errs = append(errs, fmt.Errorf("child processes still running: %s", strings.Join(desc, ", ")))
	}
	return errors.Join(errs...)
}

// LeakedNetns lists this process's namespace paths still present under NetnsDir,
// either as a file or as a mount.
func LeakedNetns() ([]string, error) {
	prefix := filepath.Join(NetnsDir, NetnsPrefix())
	seen := map[string]bool{}
	entries, err := os.ReadDir(NetnsDir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("list %s: %w", NetnsDir, err)
	}
	for _, e := range entries {
		p := filepath.Join(NetnsDir, e.Name())
		if strings.HasPrefix(p, prefix) {
			seen[p] = true
		}
	}
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, fmt.Errorf("read mountinfo: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64*1024), 1024*1024)
	for sc.Scan() {
		// Field 5 is the mount point.
		fields := strings.Fields(sc.Text())
		if len(fields) > 4 && strings.HasPrefix(fields[4], prefix) {
			seen[fields[4]] = true
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read mountinfo: %w", err)
	}
	return sortedKeys(seen), nil
}

type child struct {
	pid  int
	comm string
}

// liveChildren lists this process's direct children that have not exited.
func liveChildren() ([]child, error) {
	self := os.Getpid()
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil, fmt.Errorf("list /proc: %w", err)
	}
	var out []child
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue // exited meanwhile
		}
		// comm is in parentheses and may contain spaces: parse after the last ')'.
		s := string(stat)
		end := strings.LastIndexByte(s, ')')
		start := strings.IndexByte(s, '(')
		if end < 0 || start < 0 || start > end {
			continue
		}
		rest := strings.Fields(s[end+1:])
		if len(rest) < 2 {
			continue
		}
		state, ppid := rest[0], rest[1]
		if ppid != strconv.Itoa(self) || state == "Z" || state == "X" {
			continue
		}
		out = append(out, child{pid: pid, comm: s[start+1 : end]})
	}
	return out, nil
}
