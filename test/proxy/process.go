package proxy

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
)

// RefproxyPackage is the import path of the refproxy command.
const RefproxyPackage = "github.com/mesh-cni/mesh-cni/test/cmd/refproxy"

// EnvBinDir names the environment variable that points at prebuilt binaries (the
// Makefile exports it after `make build`; test/harness reads the same one).
const EnvBinDir = "MESH_CNI_BIN_DIR"

// Binary returns a refproxy binary: $MESH_CNI_BIN_DIR/refproxy when that variable is
// set (it must then exist), otherwise one freshly built into dir by BuildBinary.
func Binary(ctx context.Context, dir string) (string, error) {
	if bins := os.Getenv(EnvBinDir); bins != "" {
		path := filepath.Join(bins, "refproxy")
		st, err := os.Stat(path)
		if err != nil {
			return "", fmt.Errorf("prebuilt refproxy ($%s): %w", EnvBinDir, err)
		}
		if !st.Mode().IsRegular() || st.Mode().Perm()&0o111 == 0 {
			return "", fmt.Errorf("prebuilt refproxy %s is not an executable file", path)
		}
		return path, nil
	}
	return BuildBinary(ctx, dir)
}

// BuildBinary compiles the refproxy command into dir and returns the binary's path.
// It runs the go command found on PATH (go test puts its own toolchain first) in the
// current directory, which must lie inside the mesh-cni module, as a test's does.
func BuildBinary(ctx context.Context, dir string) (string, error) {
	out := filepath.Join(dir, "refproxy")
	cmd := exec.CommandContext(ctx, "go", "build", "-o", out, RefproxyPackage)
	if msg, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build %s: %w\n%s", RefproxyPackage, err, msg)
	}
	return out, nil
}

// ProcessOptions says how to run a refproxy binary.
type ProcessOptions struct {
	// Binary is the refproxy executable (see BuildBinary).
	Binary string
	// NetNS, when set, is the network namespace to run it in, through
	// `nsenter --net=NetNS`, so the whole process lives in the pod's namespace.
	NetNS string
	// Args are refproxy's flags, e.g. -record FILE.
	Args []string
	// Stderr receives the proxy's logs; nil discards them.
	Stderr io.Writer
}

// Process is a running refproxy.
type Process struct {
	cmd     *exec.Cmd
	done    chan struct{}
	waitErr error
}

// StartProcess starts refproxy and returns once it has printed "ready", that is once
// all its listeners are bound. ctx bounds only that wait; the process runs until Stop.
func StartProcess(ctx context.Context, opts ProcessOptions) (*Process, error) {
	if opts.Binary == "" {
		return nil, errors.New("no refproxy binary given")
	}
	name, args := opts.Binary, opts.Args
	if opts.NetNS != "" {
		name, args = "nsenter", append([]string{"--net=" + opts.NetNS, opts.Binary}, opts.Args...)
	}
	cmd := exec.Command(name, args...)
	cmd.Stderr = opts.Stderr
	// A pipe of our own (not StdoutPipe) so reading it never races with Wait.
	stdout, stdoutW, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("stdout pipe: %w", err)
	}
	cmd.Stdout = stdoutW
	err = cmd.Start()
	stdoutW.Close()
	if err != nil {
		stdout.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &Process{cmd: cmd, done: make(chan struct{})}
	go func() {
		p.waitErr = cmd.Wait()
		close(p.done)
	}()

	ready := make(chan error, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		if !sc.Scan() {
			ready <- fmt.Errorf("refproxy closed stdout before ready: %v", sc.Err())
			return
		}
		if line := strings.TrimSpace(sc.Text()); line != "ready" {
			ready <- fmt.Errorf("refproxy printed %q, want \"ready\"", line)
			return
		}
		ready <- nil
		// Keep draining so a stray write never blocks the proxy.
		_, _ = io.Copy(io.Discard, stdout)
		stdout.Close()
	}()
	select {
	case err = <-ready:
	case <-ctx.Done():
		err = fmt.Errorf("waiting for refproxy to be ready: %w", ctx.Err())
	}
	if err != nil {
		_ = cmd.Process.Kill()
		<-p.done
		stdout.Close()
		return nil, errors.Join(err, exitError(p.waitErr))
	}
	return p, nil
}

// Pid returns the process id (that of the proxy itself: nsenter execs it).
func (p *Process) Pid() int {
	return p.cmd.Process.Pid
}

// Stop sends SIGTERM and waits for the process to exit, killing it if ctx ends
// first. It returns nil only if the process exited with status 0.
func (p *Process) Stop(ctx context.Context) error {
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("signal refproxy: %w", err)
	}
	select {
	case <-p.done:
		return exitError(p.waitErr)
	case <-ctx.Done():
		_ = p.cmd.Process.Kill()
		<-p.done
		return fmt.Errorf("refproxy did not exit after SIGTERM, killed: %w", ctx.Err())
	}
}

func exitError(err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("refproxy exited: %w", err)
}
