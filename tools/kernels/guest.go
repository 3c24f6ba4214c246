package kernels

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// planFile is where the initramfs carries the plan to the guest.
const planFile = "/plan.json"

// plan is everything the guest's init is told: which modules to load, where
// the host's tree shows the kernel's modules, where to write results, and what
// to run.
type plan struct {
	Kernel  string
	Release string
	// Modules are initramfs paths, in load order.
	Modules []string
	// ModulesDir, ResultsDir and Busybox are host paths; the guest sees the
	// host's tree at the same paths.
	ModulesDir string
	ResultsDir string
	Busybox    string
	Env        []string
	// Warm are files read once before the suite starts (the test binary,
	// the product binaries and plugins): the first read of a binary over 9p
	// is slow under emulation, and must not eat into a test's 30 s wait for
	// an agent to be ready.
	Warm   []string
	Suites []guestSuite
}

type guestSuite struct {
	Name    string
	Binary  string
	Dir     string
	Args    []string
	Timeout time.Duration
}

// suiteExit is what the guest records of one suite's test binary.
type suiteExit struct {
	ExitCode int
	Error    string `json:",omitempty"`
	Seconds  float64
}

// guestReport is what the guest records of itself.
type guestReport struct {
	Release string
	// Modules are the loaded modules at the end (lsmod), loaded at boot or on
	// demand by the tests.
	Modules []string
}

// 9p and QEMU's -virtfs mount tags.
const (
	hostTag    = "host"
	resultsTag = "results"
)

// suiteParam on the kernel command line names the suite a boot runs: one
// suite per boot, so a kernel that crashes in one suite still gets the others
// run, each on a fresh kernel.
const suiteParam = "mesh.suite="

// Guest is the VM's init (pid 1): it loads the boot modules, mounts the host's
// tree read-only with a tmpfs overlay on top so tests can write anywhere, gives
// it fresh /proc, /sys, /dev, cgroup2, /tmp and /run, makes the kernel load
// further modules on demand from the kernel's own tree, changes root into it,
// runs the suite the command line names with its output to the results share,
// and records what it saw. The caller powers the VM off afterwards, whatever
// happened; an error has been printed to the console.
func Guest(ctx context.Context) error {
	p, err := readPlan()
	if err != nil {
		return err
	}
	cmdline, err := os.ReadFile("/proc/cmdline")
	if err != nil {
		return err
	}
	var s *guestSuite
	for _, arg := range strings.Fields(string(cmdline)) {
		if name, ok := strings.CutPrefix(arg, suiteParam); ok {
			for i := range p.Suites {
				if p.Suites[i].Name == name {
					s = &p.Suites[i]
				}
			}
		}
	}
	if s == nil {
		return fmt.Errorf("the command line %q names no suite of the plan", strings.TrimSpace(string(cmdline)))
	}
	if err := guestSetup(p); err != nil {
		return err
	}
	warm(p.Warm)
	runGuestSuite(ctx, p, *s)
	return guestFinish(p, s.Name)
}

func readPlan() (*plan, error) {
	if err := mountAll([]mount{
		{"proc", "/proc", "proc", 0, ""},
		{"sysfs", "/sys", "sysfs", 0, ""},
		{"devtmpfs", "/dev", "devtmpfs", 0, ""},
	}); err != nil {
		return nil, err
	}
	return readJSON[plan](planFile)
}

type mount struct {
	source, target, fstype string
	flags                  uintptr
	data                   string
}

func mountAll(ms []mount) error {
	for _, m := range ms {
		if err := os.MkdirAll(m.target, 0o755); err != nil {
			return err
		}
		if err := unix.Mount(m.source, m.target, m.fstype, m.flags, m.data); err != nil {
			return fmt.Errorf("mount %s (%s) on %s: %w", m.source, m.fstype, m.target, err)
		}
	}
	return nil
}

const newRoot = "/newroot"

// guestOpenFiles is the open-file limit the suites run with, as systemd gives
// a node's services.
const guestOpenFiles = 524288

func guestSetup(p *plan) error {
	var uts unix.Utsname
	if err := unix.Uname(&uts); err != nil {
		return err
	}
	if got := unix.ByteSliceToString(uts.Release[:]); got != p.Release {
		return fmt.Errorf("booted kernel %s, the plan is for %s", got, p.Release)
	}
	for _, m := range p.Modules {
		if err := loadModule(m); err != nil {
			return err
		}
	}
	// 256 KiB messages: reading the test binaries over 9p is most of the boot.
	nine := "trans=virtio,version=9p2000.L,msize=262144"
	if err := mountAll([]mount{
		{hostTag, "/lower", "9p", unix.MS_RDONLY, nine + ",cache=loose"},
		{"tmpfs", "/upper", "tmpfs", 0, "mode=0755"},
	}); err != nil {
		return err
	}
	for _, d := range []string{"/upper/upper", "/upper/work"} {
		if err := os.Mkdir(d, 0o755); err != nil {
			return err
		}
	}
	r := func(p string) string { return filepath.Join(newRoot, p) }
	if err := mountAll([]mount{
		{"overlay", newRoot, "overlay", 0, "lowerdir=/lower,upperdir=/upper/upper,workdir=/upper/work"},
		{"proc", r("/proc"), "proc", 0, ""},
		{"sysfs", r("/sys"), "sysfs", 0, ""},
		{"securityfs", r("/sys/kernel/security"), "securityfs", 0, ""},
		{"cgroup2", r("/sys/fs/cgroup"), "cgroup2", 0, ""},
		{"bpf", r("/sys/fs/bpf"), "bpf", 0, ""},
		{"devtmpfs", r("/dev"), "devtmpfs", 0, ""},
		{"devpts", r("/dev/pts"), "devpts", 0, "ptmxmode=0666"},
		{"tmpfs", r("/dev/shm"), "tmpfs", 0, ""},
		{"tmpfs", r("/tmp"), "tmpfs", 0, "mode=1777"},
		{"tmpfs", r("/run"), "tmpfs", 0, "mode=0755"},
		{resultsTag, r(p.ResultsDir), "9p", 0, nine},
	}); err != nil {
		return err
	}
	// Modules on demand: the kernel runs its modprobe helper (resolved in pid
	// 1's root, which is about to be the new one) for a missing driver, e.g.
	// veth when a test adds a veth pair. busybox's modprobe reads the
	// modules.dep and modules.alias written on the host.
	modules := r(filepath.Join("/lib/modules", p.Release))
	if err := os.MkdirAll(filepath.Dir(modules), 0o755); err != nil {
		return err
	}
	if err := os.Symlink(p.ModulesDir, modules); err != nil {
		return err
	}
	helper := "/run/mesh-kernels/modprobe"
	if err := os.MkdirAll(r(filepath.Dir(helper)), 0o755); err != nil {
		return err
	}
	if err := os.Symlink(p.Busybox, r(helper)); err != nil {
		return err
	}
	if err := os.WriteFile("/proc/sys/kernel/modprobe", []byte(helper), 0o644); err != nil {
		return err
	}
	// Into the new root as switch_root does (the initramfs cannot be pivoted
	// away): moved over /, then entered. A chroot into the directory instead
	// would leave every process chrooted, and the kernel refuses a chrooted
	// process a user namespace (EPERM), which the tests make unprivileged.
	if err := os.Chdir(newRoot); err != nil {
		return err
	}
	if err := unix.Mount(newRoot, "/", "", unix.MS_MOVE, ""); err != nil {
		return fmt.Errorf("move %s over /: %w", newRoot, err)
	}
	if err := unix.Chroot("."); err != nil {
		return fmt.Errorf("enter the new root: %w", err)
	}
	if err := os.Chdir("/"); err != nil {
		return err
	}
	// The kernel starts pid 1 with a hard limit of 4096 open files, which
	// the suites inherit; a node's init gives its services far more (systemd:
	// 524288), and TestListenerFlood holds 16,800 listeners open.
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &unix.Rlimit{Cur: guestOpenFiles, Max: guestOpenFiles}); err != nil {
		return fmt.Errorf("raise the open-file limit: %w", err)
	}
	lo, err := netlinksafe.LinkByName("lo")
	if err == nil {
		err = netlink.LinkSetUp(lo)
	}
	if err != nil {
		return fmt.Errorf("loopback up: %w", err)
	}
	return nil
}

// warm reads each file to the end, which leaves it in the page cache; a
// file that cannot be read is the test's to report.
func warm(paths []string) {
	start := time.Now()
	var n int64
	for _, path := range paths {
		f, err := os.Open(path)
		if err != nil {
			continue
		}
		m, _ := io.Copy(io.Discard, f)
		f.Close()
		n += m
	}
	fmt.Printf("guest: read %d MiB of binaries in %.1fs\n", n>>20, time.Since(start).Seconds())
}

// loadModule loads a module file; a compressed one is handed to the kernel as
// it is (MODULE_INIT_COMPRESSED_FILE), the way Debian's kernels that compress
// their modules are built to take them.
func loadModule(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	flags := 0
	if !strings.HasSuffix(path, ".ko") {
		flags = unix.MODULE_INIT_COMPRESSED_FILE
	}
	if err := unix.FinitModule(int(f.Fd()), "", flags); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("load module %s: %w", path, err)
	}
	return nil
}

// runGuestSuite runs one suite's test binary; its output goes to <name>.log and
// how it ended to <name>.json in the results. A failure is the suite's result,
// not the guest's.
func runGuestSuite(ctx context.Context, p *plan, s guestSuite) {
	fmt.Printf("guest: suite %s: %s %s\n", s.Name, s.Binary, strings.Join(s.Args, " "))
	start := time.Now()
	exit := suiteExit{ExitCode: -1}
	err := func() error {
		log, err := os.Create(filepath.Join(p.ResultsDir, s.Name+".log"))
		if err != nil {
			return err
		}
		defer log.Close()
		// A minute past the test binary's own timeout, which prints the
		// goroutines of a hung test before it exits.
		ctx, cancel := context.WithTimeout(ctx, s.Timeout+time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, s.Binary, s.Args...)
		cmd.Dir, cmd.Env, cmd.Stdout, cmd.Stderr = s.Dir, p.Env, log, log
		cmd.WaitDelay = 10 * time.Second
		err = cmd.Run()
		exit.ExitCode = cmd.ProcessState.ExitCode()
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return nil
		}
		return err
	}()
	if err != nil {
		exit.Error = err.Error()
	}
	exit.Seconds = time.Since(start).Seconds()
	fmt.Printf("guest: suite %s: exit %d after %.0fs %s\n", s.Name, exit.ExitCode, exit.Seconds, exit.Error)
	if err := writeJSON(filepath.Join(p.ResultsDir, s.Name+".json"), exit); err != nil {
		fmt.Printf("guest: %v\n", err)
	}
}

// GuestFailed reports an error that stopped the guest before its suite ran;
// the console has it, and the host reads it there.
func GuestFailed(err error) {
	fmt.Printf("guest: FAILED: %v\n", err)
}

// guestFinish writes <suite>.guest.json and the kernel log to the results.
func guestFinish(p *plan, suite string) error {
	rep := guestReport{}
	var uts unix.Utsname
	if unix.Uname(&uts) == nil {
		rep.Release = unix.ByteSliceToString(uts.Release[:])
	}
	if mods, err := os.ReadFile("/proc/modules"); err == nil {
		for _, line := range strings.Split(strings.TrimSpace(string(mods)), "\n") {
			if name, _, ok := strings.Cut(line, " "); ok {
				rep.Modules = append(rep.Modules, name)
			}
		}
	}
	if n, err := unix.Klogctl(unix.SYSLOG_ACTION_SIZE_BUFFER, nil); err == nil && n > 0 {
		buf := make([]byte, n)
		if n, err := unix.Klogctl(unix.SYSLOG_ACTION_READ_ALL, buf); err == nil {
			_ = os.WriteFile(filepath.Join(p.ResultsDir, suite+".dmesg.txt"), buf[:n], 0o644)
		}
	}
	return writeJSON(filepath.Join(p.ResultsDir, suite+".guest.json"), rep)
}

// PowerOff ends the VM: QEMU exits when the guest powers off.
func PowerOff() {
	unix.Sync()
	if err := unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF); err != nil {
		fmt.Printf("guest: power off: %v\n", err)
	}
	// Returning from pid 1 panics the kernel, which (panic=-1, -no-reboot)
	// ends QEMU too.
}

func writeJSON(path string, v any) error {
	data, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, data, 0o644)
}
