package kernels

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Options configures Run.
type Options struct {
	// Root is the module root: the packages are built from it and the tests
	// run in their directories under it, in the guest as on the host.
	Root string
	// Cache keeps apt's state and the unpacked kernels between runs, and
	// holds each run's build in a directory of its own.
	Cache string
	// Out gets one directory of results per kernel, replaced by each run.
	Out string
	// BinDir holds the prebuilt product binaries and reference plugins
	// (`make build`), handed to the tests as $MESH_CNI_BIN_DIR.
	BinDir string
	// Filter is a regexp on kernel names; "" runs the whole matrix.
	Filter string
	// Log gets progress and the summary lines.
	Log io.Writer
}

// guestMemoryMiB and guestCPUs size each VM: two emulated CPUs on this
// two-core machine, and memory for the agent, the proxies and a test binary.
const (
	guestMemoryMiB = 2048
	guestCPUs      = 2
)

// Run runs the matrix, one kernel after another, and prints one summary line
// per kernel. It returns the results; an error means the run itself could
// not be done (no kernel result can be trusted).
func Run(ctx context.Context, o Options) ([]*KernelResult, error) {
	m, err := LoadMatrix()
	if err != nil {
		return nil, err
	}
	rows, err := m.Select(o.Filter)
	if err != nil {
		return nil, err
	}
	if err := checkTools(o.BinDir); err != nil {
		return nil, err
	}
	if err := checkShared(o.Root, o.BinDir); err != nil {
		return nil, err
	}
	for _, d := range []string{o.Cache, o.Out} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, err
		}
	}
	removeStale(o.Cache, "run-", o.Log)
	removeStale(o.Out, ".", o.Log)
	// Not under /tmp: the guest has a fresh tmpfs there, and must see these.
	work, err := os.MkdirTemp(o.Cache, fmt.Sprintf("run-%d-", os.Getpid()))
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(work)
	bins, err := build(ctx, o, work)
	if err != nil {
		return nil, err
	}
	tests, err := listTests(ctx, o, bins)
	if err != nil {
		return nil, err
	}
	if err := checkSkips(rows, tests); err != nil {
		return nil, err
	}
	var results []*KernelResult
	for _, k := range rows {
		if err := ctx.Err(); err != nil {
			return results, err
		}
		r := runKernel(ctx, o, k, work, bins, tests)
		results = append(results, r)
		fmt.Fprintf(o.Log, "kernels: %s\n", r.Line())
		for _, d := range r.Deviations() {
			fmt.Fprintf(o.Log, "kernels:   %s: %s\n", r.Kernel.Name, d)
		}
		for _, s := range r.Suites {
			if s.Retried != "" {
				fmt.Fprintf(o.Log, "kernels:   %s %s: %s\n", r.Kernel.Name, s.Suite, s.Retried)
			}
			if s.Outcome == Fail && s.Note != "" {
				fmt.Fprintf(o.Log, "kernels:   %s %s: %s\n", r.Kernel.Name, s.Suite, s.Note)
			}
			if s.Outcome != r.Kernel.Expect[s.Suite] {
				fmt.Fprintf(o.Log, "kernels:   %s log: %s (console: %s)\n", s.Suite, s.Log, s.Console)
			}
		}
		if r.Dir != "" {
			fmt.Fprintf(o.Log, "kernels:   per test: %s\n", filepath.Join(r.Dir, "tests.txt"))
		}
	}
	return results, nil
}

// checkTools fails early, naming what is missing, instead of in the middle of
// a kernel.
func checkTools(binDir string) error {
	var missing []string
	for _, t := range []string{"qemu-system-x86_64", "busybox", "apt-get", "apt-cache", "dpkg-deb", "go"} {
		if _, err := exec.LookPath(t); err != nil {
			missing = append(missing, t)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("not installed: %s (make test-kernels installs them from hack/packages-kernels.txt)", strings.Join(missing, ", "))
	}
	for _, b := range []string{"mesh-agent", "mesh-cni", "refproxy", "bridge", "host-local"} {
		if _, err := os.Stat(filepath.Join(binDir, b)); err != nil {
			return fmt.Errorf("the tests' binaries are not built in %s (make build): %w", binDir, err)
		}
	}
	return nil
}

// builds are this run's binaries: the guest's init and a test binary per
// package.
type builds struct {
	init  string
	tests map[string]string // package -> test binary
}

func build(ctx context.Context, o Options, work string) (*builds, error) {
	b := &builds{init: filepath.Join(work, "init"), tests: map[string]string{}}
	goCmd := func(env []string, args ...string) error {
		cmd := exec.CommandContext(ctx, "go", args...)
		cmd.Dir = o.Root
		cmd.Env = append(os.Environ(), env...)
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("go %s: %w\n%s", strings.Join(args, " "), err, out)
		}
		return nil
	}
	// The init runs before any loader or libc is there: static.
	if err := goCmd([]string{"CGO_ENABLED=0"}, "build", "-o", b.init, "./tools/cmd/kernels"); err != nil {
		return nil, err
	}
	for _, s := range Suites {
		if _, ok := b.tests[s.Package]; ok {
			continue
		}
		bin := filepath.Join(work, strings.ReplaceAll(strings.Trim(s.Package, "./"), "/", "-")+".test")
		if err := goCmd(nil, "test", "-c", "-o", bin, s.Package); err != nil {
			return nil, err
		}
		b.tests[s.Package] = bin
	}
	return b, nil
}

// listTests is every suite's tests: the named ones, checked against what the
// binary has, or all of the binary's.
func listTests(ctx context.Context, o Options, b *builds) (map[string][]string, error) {
	out := map[string][]string{}
	for _, s := range Suites {
		cmd := exec.CommandContext(ctx, b.tests[s.Package], "-test.list", ".")
		cmd.Dir = filepath.Join(o.Root, s.Package)
		cmd.Env = append(os.Environ(), "MESH_CNI_BIN_DIR="+o.BinDir)
		list, err := cmd.Output()
		if err != nil {
			return nil, fmt.Errorf("list the tests of %s: %w", s.Package, err)
		}
		var have []string
		for _, t := range strings.Fields(string(list)) {
			if strings.HasPrefix(t, "Test") {
				have = append(have, t)
			}
		}
		if len(s.Tests) == 0 {
			for t := range s.Exclude {
				if !slices.Contains(have, t) {
					return nil, fmt.Errorf("suite %s excludes %s, which %s does not have", s.Name, t, s.Package)
				}
			}
			out[s.Name] = slices.DeleteFunc(have, func(t string) bool { _, ok := s.Exclude[t]; return ok })
			continue
		}
		for _, t := range s.Tests {
			if !slices.Contains(have, t) {
				return nil, fmt.Errorf("suite %s names %s, which %s does not have", s.Name, t, s.Package)
			}
		}
		out[s.Name] = s.Tests
	}
	return out, nil
}

// checkSkips refuses an expected skip of a test its suite does not run, which
// could never be met or gone stale.
func checkSkips(rows []Kernel, tests map[string][]string) error {
	var errs []error
	for _, k := range rows {
		for _, suite := range slices.Sorted(maps.Keys(k.Skips)) {
			for _, t := range slices.Sorted(maps.Keys(k.Skips[suite])) {
				if !slices.Contains(tests[suite], t) {
					errs = append(errs, fmt.Errorf("tools/kernels/skips.txt expects %s to skip in suite %s on %s, and the suite does not run it", t, suite, k.Name))
				}
			}
		}
	}
	return errors.Join(errs...)
}

func runKernel(ctx context.Context, o Options, k Kernel, work string, b *builds, tests map[string][]string) *KernelResult {
	start := time.Now()
	r := &KernelResult{Kernel: k}
	defer func() { r.Duration = time.Since(start) }()
	u, err := Fetch(ctx, o.Cache, k, o.Log)
	if errors.Is(err, ErrUnavailable) {
		r.Unavailable = true
		fmt.Fprintf(o.Log, "kernels: %s: %v\n", k.Name, err)
		return r
	}
	if err != nil {
		r.Err = fmt.Errorf("fetch: %w", err)
		return r
	}
	r.Unpacked = u
	// The guest writes into a directory of its own, moved into place when it
	// is done, so runs in parallel never write into the same one.
	results, err := os.MkdirTemp(o.Out, fmt.Sprintf(".%s-%d-", k.Name, os.Getpid()))
	if err != nil {
		r.Err = err
		return r
	}
	defer os.RemoveAll(results)
	if err := os.Chmod(results, 0o755); err != nil {
		r.Err = err
		return r
	}
	busybox, err := exec.LookPath("busybox")
	if err != nil {
		r.Err = err
		return r
	}
	busybox, err = filepath.EvalSymlinks(busybox)
	if err != nil {
		r.Err = err
		return r
	}
	p := plan{
		Kernel: k.Name, Release: u.Release, ModulesDir: u.Modules, ResultsDir: results, Busybox: busybox,
		Env: []string{"PATH=/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
			"HOME=/root", "LC_ALL=C", "MESH_CNI_BIN_DIR=" + o.BinDir},
	}
	for _, s := range Suites {
		// One test at a time: the tests wait 30 s for an agent to be ready,
		// and under emulation an agent loading its programs while another
		// test's agent does the same misses that on a busy machine.
		args := []string{"-test.v", "-test.count=1", "-test.parallel=1", "-test.timeout=" + s.Timeout.String()}
		if len(s.Tests) > 0 {
			args = append(args, "-test.run=^("+strings.Join(s.Tests, "|")+")$")
		}
		if len(s.Exclude) > 0 {
			args = append(args, "-test.skip=^("+strings.Join(slices.Sorted(maps.Keys(s.Exclude)), "|")+")$")
		}
		p.Suites = append(p.Suites, guestSuite{Name: s.Name, Binary: b.tests[s.Package],
			Dir: filepath.Join(o.Root, s.Package), Args: args, Timeout: s.Timeout})
	}
	bins, _ := filepath.Glob(filepath.Join(o.BinDir, "*"))
	p.Warm = append(slices.Sorted(maps.Values(b.tests)), bins...)
	initramfs := filepath.Join(work, k.Name+".cpio")
	if err := writeInitramfs(initramfs, b.init, u, p); err != nil {
		r.Err = fmt.Errorf("initramfs: %w", err)
		return r
	}
	defer os.Remove(initramfs)
	modules := map[string]bool{}
	for _, s := range Suites {
		if err := ctx.Err(); err != nil {
			r.Err = errors.Join(r.Err, err)
			break
		}
		var firstErr error
		sr := runSuite(ctx, k, s, u, initramfs, results, tests[s.Name], modules, &firstErr)
		// Under emulation on a busy machine a test can miss one of its own
		// time limits (30 s for an agent to be ready, 1 s for a held ADD),
		// and a guest kernel can oops while it boots, before the suite runs
		// (TCG patching its own text): a suite the matrix says passes gets a
		// second boot, and the line says it needed one and why. A real
		// regression fails both; an expected failure is never retried, so an
		// unexpected pass still shows.
		if sr.Outcome == Fail && k.Expect[s.Name] == Pass && ctx.Err() == nil {
			first := sr
			for _, suffix := range []string{".log", ".json", ".console.log", ".guest.json", ".dmesg.txt"} {
				_ = os.Rename(filepath.Join(results, s.Name+suffix), filepath.Join(results, s.Name+".first"+suffix))
			}
			sr = runSuite(ctx, k, s, u, initramfs, results, tests[s.Name], modules, &r.Err)
			sr.Retried = fmt.Sprintf("the first boot failed %d of %d (%s.first.log)", first.Failed+first.Missing+len(first.UnexpectedSkips), first.Total, s.Name)
			if firstErr != nil {
				sr.Retried += ": " + strings.ReplaceAll(firstErr.Error(), "\n", "; ")
			}
		} else {
			r.Err = errors.Join(r.Err, firstErr)
		}
		r.Suites = append(r.Suites, sr)
	}
	for m := range modules {
		r.Modules = append(r.Modules, m)
	}
	slices.Sort(r.Modules)

	final := filepath.Join(o.Out, k.Name)
	if err := os.RemoveAll(final); err != nil {
		r.Err = errors.Join(r.Err, err)
		return r
	}
	if err := os.Rename(results, final); err != nil {
		r.Err = errors.Join(r.Err, err)
		return r
	}
	r.Dir = final
	for i := range r.Suites {
		r.Suites[i].Log = filepath.Join(final, r.Suites[i].Suite+".log")
		r.Suites[i].Console = filepath.Join(final, r.Suites[i].Suite+".console.log")
	}
	r.Duration = time.Since(start)
	if err := r.writeTests(); err != nil {
		r.Err = errors.Join(r.Err, err)
	}
	return r
}

// runSuite boots the kernel for one suite. A suite that the kernel fails,
// crashes or hangs in is a failed suite; one the guest never got to run is an
// error of the run (errs), whatever the matrix expects.
func runSuite(ctx context.Context, k Kernel, s Suite, u *Unpacked, initramfs, results string, tests []string, modules map[string]bool, errs *error) SuiteResult {
	// The suite's own limit, the minute the guest gives the test binary past
	// it, and boot and power-off; past it the guest is wedged and QEMU is
	// killed.
	ctx, cancel := context.WithTimeout(ctx, s.Timeout+3*time.Minute)
	defer cancel()
	v := vm{name: "mesh-kernels-" + k.Name + "-" + s.Name, suite: s.Name, image: u.Image, initramfs: initramfs,
		results: results, console: filepath.Join(results, s.Name+".console.log"), memoryMiB: guestMemoryMiB, cpus: guestCPUs}
	vmErr := v.run(ctx)
	sr, err := readSuiteResult(results, s, tests, k.Skips[s.Name], vmErr)
	if err != nil {
		*errs = errors.Join(*errs, fmt.Errorf("%s: %w", s.Name, err))
	}
	if rep, err := readGuestReport(results, s.Name); err == nil {
		for _, m := range rep.Modules {
			modules[m] = true
		}
	}
	return sr
}

// removeStale removes what a run that was killed left in dir: the directories
// named prefix...-<pid>-<random> whose process is gone. A live run's are kept.
func removeStale(dir, prefix string, log io.Writer) {
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		parts := strings.Split(e.Name(), "-")
		if !e.IsDir() || !strings.HasPrefix(e.Name(), prefix) || len(parts) < 3 {
			continue
		}
		pid, err := strconv.Atoi(parts[len(parts)-2])
		if err != nil || pid <= 0 || syscall.Kill(pid, 0) != syscall.ESRCH {
			continue
		}
		p := filepath.Join(dir, e.Name())
		fmt.Fprintf(log, "kernels: removing %s, left by an earlier run that was killed\n", p)
		_ = os.RemoveAll(p)
	}
}

// ModuleRoot is the root of the Go module dir is in.
func ModuleRoot(ctx context.Context, dir string) (string, error) {
	cmd := exec.CommandContext(ctx, "go", "env", "GOMOD")
	cmd.Dir = dir
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %w", err)
	}
	gomod := strings.TrimSpace(string(out))
	if gomod == "" || gomod == os.DevNull {
		return "", fmt.Errorf("%s is not inside a Go module", dir)
	}
	return filepath.Dir(gomod), nil
}

// guestPrivate are the directories the guest mounts afresh over the host's
// tree (see guest.go): what is below them on the host is not there.
var guestPrivate = []string{"/tmp", "/run", "/dev", "/proc", "/sys"}

// checkShared refuses a checkout or binaries the guest cannot see, with the
// reason, instead of every suite failing on a missing directory.
func checkShared(dirs ...string) error {
	for _, d := range dirs {
		for _, p := range guestPrivate {
			if d == p || strings.HasPrefix(d, p+"/") {
				return fmt.Errorf("%s is below %s, which the guest mounts afresh: run from a checkout elsewhere", d, p)
			}
		}
	}
	return nil
}
