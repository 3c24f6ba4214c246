package harness

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/internal/redirect"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// pipeGrace bounds how long Wait keeps reading output after the process exited, in
// case a grandchild still holds its stdout.
const pipeGrace = 2 * time.Second

// ProcessOptions configures StartProcess.
type ProcessOptions struct {
	// Path of the executable (e.g. Bins(t).Path("mesh-agent")).
	Path string
	// Args are the arguments after the program name.
	Args []string
	// Env is added to the test's environment (later entries win); with ReplaceEnv it
	// is the whole environment.
	Env        []string
	ReplaceEnv bool
	// Dir is the working directory; default the test's. A process running as
	// another user needs one it may enter (e.g. "/").
	Dir string
	// Credential runs the process as another user/group (e.g. to be a non-root
	// peer on a socket); nil keeps root.
	Credential *syscall.Credential
	// NetNSPath starts the process inside that network namespace; "" keeps the
	// test's.
	NetNSPath string
	// Name labels the process in logs; default the executable's base name.
	Name string
	// OwnCgroup starts the process in a cgroup v2 of its own (made for it,
	// removed when it is gone), as a process of another container runs: the
	// data path tells a node proxy apart from the pods by its cgroup, and every
	// process a test starts otherwise shares the test's.
	OwnCgroup bool
	// Cgroup starts the process in this existing cgroup v2 directory (one
	// that MkCgroup made, say), as the runtime starts a pod's container in
	// the cgroup the kubelet named.
	Cgroup string
	// Launcher says Path forks the real program and waits for it without
	// passing signals on, as nsenter does when it enters a PID namespace:
	// Signal, Stop and Kill then reach the launcher's children, and the
	// launcher itself only while it has none.
	Launcher bool
}

// Process is a running child process whose stdout and stderr go to a log file (and
// memory, for WaitForLine). It is killed in the test's cleanup if still running,
// and its output is logged if the test failed.
type Process struct {
	name     string
	logPath  string
	cmd      *exec.Cmd
	out      *outputLog
	done     chan struct{}
	waitErr  error  // set before done is closed
	cgroup   string // OwnCgroup's directory
	launcher bool
}

// Cgroup is the cgroup v2 directory the process was started in with OwnCgroup.
func (p *Process) Cgroup() string { return p.cgroup }

// NewCgroup makes a cgroup v2 directory below the root for the test's processes
// (the kubelet's, say) and removes it at the end, once its processes are gone.
func NewCgroup(tb testing.TB, name string) string {
	tb.Helper()
	dir, fd := newCgroup(tb, name)
	fd.Close()
	return dir
}

// newCgroup makes a cgroup for one process below the cgroup v2 root and removes it
// in cleanup, after the process (whose cleanup is registered later, so runs
// earlier) is gone.
func newCgroup(tb testing.TB, name string) (string, *os.File) {
	tb.Helper()
	root, err := redirect.FindCgroup2()
	if err != nil {
		tb.Fatalf("process %s: %v", name, err)
	}
	dir, err := os.MkdirTemp(root, "mesh-test-"+name+"-")
	if err != nil {
		tb.Fatalf("process %s: cgroup: %v", name, err)
	}
	tb.Cleanup(func() {
		// A cgroup is removable once its last process has been reaped.
		// The test's context has ended by now: the wait is bounded by its limit.
		var err error
		if !fixtures.Eventually(context.Background(), 10*time.Second, fixtures.WaitInterval, func() bool {
			err = os.Remove(dir)
			return err == nil || errors.Is(err, os.ErrNotExist)
		}) {
			tb.Errorf("remove cgroup %s: %v", dir, err)
		}
	})
	fd, err := os.Open(dir)
	if err != nil {
		tb.Fatalf("process %s: cgroup: %v", name, err)
	}
	return dir, fd
}

// MkCgroup makes the cgroup v2 directory dir (below one of the test's, such as
// NewCgroup's) and, at cleanup, kills whatever still runs in it (cgroup.kill:
// the children of a killed process too) and removes it. Cleanups run last
// registered first, so a cgroup made inside another goes before it.
func MkCgroup(tb testing.TB, dir string) string {
	tb.Helper()
	if err := os.Mkdir(dir, 0o755); err != nil {
		tb.Fatalf("make cgroup: %v", err)
	}
	tb.Cleanup(func() {
		if err := os.WriteFile(filepath.Join(dir, "cgroup.kill"), []byte("1"), 0); err != nil && !errors.Is(err, os.ErrNotExist) {
			tb.Errorf("kill cgroup %s: %v", dir, err)
		}
		var err error
		if !fixtures.Eventually(context.Background(), 10*time.Second, fixtures.WaitInterval, func() bool {
			err = os.Remove(dir)
			return err == nil || errors.Is(err, os.ErrNotExist)
		}) {
			tb.Errorf("remove cgroup %s: %v", dir, err)
		}
	})
	return dir
}

// StartProcess starts a process; see ProcessOptions.
func StartProcess(tb testing.TB, opts ProcessOptions) *Process {
	tb.Helper()
	name := opts.Name
	if name == "" {
		name = filepath.Base(opts.Path)
	}
	logPath := filepath.Join(tb.TempDir(), name+".log")
	file, err := os.Create(logPath)
	if err != nil {
		tb.Fatalf("process %s: log file: %v", name, err)
	}
	out := newOutputLog(file)

	cmd := exec.Command(opts.Path, opts.Args...)
	cmd.Dir = opts.Dir
	if opts.ReplaceEnv {
		cmd.Env = append([]string{}, opts.Env...)
	} else if len(opts.Env) > 0 {
		cmd.Env = append(os.Environ(), opts.Env...)
	}
	cmd.Stdout = out
	cmd.Stderr = out
	cmd.WaitDelay = pipeGrace
	// No Pdeathsig: the kernel sends it when the *thread* that forked the child
	// exits, and Go ends OS threads whenever a goroutine exits while locked to
	// one (internal/netns does this on purpose), so long-lived children such as the
	// agent were killed at random mid-test. Children are killed in cleanup, and
	// Run's leak check kills and reports any that survive.
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: opts.Credential}
	var cgroup string
	if opts.OwnCgroup {
		dir, fd := newCgroup(tb, name)
		defer fd.Close()
		cgroup = dir
		cmd.SysProcAttr.UseCgroupFD, cmd.SysProcAttr.CgroupFD = true, int(fd.Fd())
	}
	if opts.Cgroup != "" {
		fd, err := os.Open(opts.Cgroup)
		if err != nil {
			file.Close()
			tb.Fatalf("process %s: cgroup: %v", name, err)
		}
		defer fd.Close()
		cmd.SysProcAttr.UseCgroupFD, cmd.SysProcAttr.CgroupFD = true, int(fd.Fd())
	}
	if opts.NetNSPath != "" {
		// The child inherits the namespace of the thread that starts it.
		err = netns.Do(opts.NetNSPath, cmd.Start)
	} else {
		err = cmd.Start()
	}
	if err != nil {
		file.Close()
		tb.Fatalf("start %s: %v", name, err)
	}
	p := &Process{name: name, logPath: logPath, cmd: cmd, out: out, done: make(chan struct{}), cgroup: cgroup, launcher: opts.Launcher}
	go func() {
		p.waitErr = cmd.Wait()
		close(p.done)
		out.notify()
	}()
	tb.Cleanup(func() {
		if err := p.Kill(); err != nil {
			tb.Errorf("cleanup: %v", err)
		}
		file.Close()
		if tb.Failed() {
			tb.Logf("output of %s (pid %d, %s):\n%s", name, p.Pid(), p.exitDesc(), p.Output())
		}
	})
	return p
}

// Pid is the process id.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// LogPath is the file holding the process's stdout and stderr.
func (p *Process) LogPath() string { return p.logPath }

// Output is everything the process wrote so far.
func (p *Process) Output() string { return p.out.String() }

// Done is closed when the process has exited and its output is complete.
func (p *Process) Done() <-chan struct{} { return p.done }

// Wait waits for the process to exit and returns its exit error (nil for status 0,
// *exec.ExitError otherwise), or the context's error.
func (p *Process) Wait(ctx context.Context) error {
	select {
	case <-p.done:
		return p.waitErr
	case <-ctx.Done():
		return fmt.Errorf("wait for %s (pid %d): %w", p.name, p.Pid(), ctx.Err())
	}
}

// Signal sends sig to the process (a no-op once it has exited); to a
// Launcher's children while it has any.
func (p *Process) Signal(sig os.Signal) error {
	if p.launcher {
		if kids := p.Children(); len(kids) > 0 {
			for _, pid := range kids {
				if err := syscall.Kill(pid, sig.(syscall.Signal)); err != nil && !errors.Is(err, syscall.ESRCH) {
					return fmt.Errorf("signal %s's child %d: %w", p.name, pid, err)
				}
			}
			return nil
		}
	}
	if err := p.cmd.Process.Signal(sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("signal %s (pid %d): %w", p.name, p.Pid(), err)
	}
	return nil
}

// Children are the pids of the process's children.
func (p *Process) Children() []int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", p.Pid(), p.Pid()))
	if err != nil {
		return nil
	}
	var pids []int
	for _, f := range strings.Fields(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil {
			pids = append(pids, pid)
		}
	}
	return pids
}

// Stop asks the process to exit with SIGTERM and waits until it does or ctx ends,
// then kills it. It returns the process's exit error (nil if it exited with status
// 0), or an error saying it had to be killed.
func (p *Process) Stop(ctx context.Context) error {
	select {
	case <-p.done:
		return p.waitErr
	default:
	}
	if err := p.Signal(syscall.SIGTERM); err != nil {
		return err
	}
	select {
	case <-p.done:
		return p.waitErr
	case <-ctx.Done():
	}
	if err := p.Kill(); err != nil {
		return err
	}
	return fmt.Errorf("%s (pid %d) did not exit after SIGTERM (%w); killed it", p.name, p.Pid(), ctx.Err())
}

// Kill sends SIGKILL and waits for the process to be gone.
func (p *Process) Kill() error {
	if err := p.Signal(syscall.SIGKILL); err != nil {
		return err
	}
	<-p.done
	return nil
}

// WaitForLine waits until the process prints a line containing substr and returns
// that line. It fails if the process exits first or ctx ends. Lines printed before
// the call count.
func (p *Process) WaitForLine(ctx context.Context, substr string) (string, error) {
	scanned := 0
	for {
		// Done first: once it is closed, the output read below is complete.
		exited := false
		select {
		case <-p.done:
			exited = true
		default:
		}
		data, changed := p.out.snapshot()
		for {
			i := bytes.IndexByte(data[scanned:], '\n')
			if i < 0 {
				break
			}
			line := string(data[scanned : scanned+i])
			scanned += i + 1
			if strings.Contains(line, substr) {
				return line, nil
			}
		}
		if exited {
			if tail := string(data[scanned:]); strings.Contains(tail, substr) {
				return tail, nil
			}
			return "", fmt.Errorf("%s (pid %d) exited (%s) before printing %q; output:\n%s", p.name, p.Pid(), p.exitDesc(), substr, data)
		}
		select {
		case <-changed:
		case <-p.done:
		case <-ctx.Done():
			return "", fmt.Errorf("wait for %q from %s (pid %d): %w; output so far:\n%s", substr, p.name, p.Pid(), ctx.Err(), p.Output())
		}
	}
}

func (p *Process) exitDesc() string {
	select {
	case <-p.done:
		if p.waitErr == nil {
			return "exit status 0"
		}
		return p.waitErr.Error()
	default:
		return "running"
	}
}

// outputLog is the process's stdout+stderr: appended to a file, kept in memory, and
// announced to waiters by closing (and replacing) a channel on every write.
type outputLog struct {
	mu      sync.Mutex
	file    *os.File
	data    []byte
	changed chan struct{}
}

func newOutputLog(file *os.File) *outputLog {
	return &outputLog{file: file, changed: make(chan struct{})}
}

func (l *outputLog) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.data = append(l.data, b...)
	// The in-memory copy is what tests read; a failing file write must not break
	// the child's output pipe.
	_, _ = l.file.Write(b)
	close(l.changed)
	l.changed = make(chan struct{})
	return len(b), nil
}

func (l *outputLog) notify() {
	l.mu.Lock()
	defer l.mu.Unlock()
	close(l.changed)
	l.changed = make(chan struct{})
}

func (l *outputLog) snapshot() ([]byte, <-chan struct{}) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.data[:len(l.data):len(l.data)], l.changed
}

func (l *outputLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return string(l.data)
}

// ProcView makes a procfs of only the given processes, each entry a link to
// the kernel's /proc entry, with the process host standing in as PID 1 (the
// host's init, which a finder of host processes compares with). What reads it
// gets the kernel's truth about these processes, and nothing else on the
// machine takes part. It is removed in tb's cleanup.
func ProcView(tb testing.TB, host int, pids ...int) string {
	tb.Helper()
	dir := tb.TempDir()
	link := func(pid int, name string) {
		if err := os.Symlink(filepath.Join("/proc", fmt.Sprint(pid)), filepath.Join(dir, name)); err != nil {
			tb.Fatal(err)
		}
	}
	link(host, "1")
	for _, pid := range pids {
		link(pid, fmt.Sprint(pid))
	}
	return dir
}
