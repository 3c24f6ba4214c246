package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"os/exec"
	"syscall"
	"testing"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/mesh-cni/mesh-cni/test/harness"
)

// pluginCall is one direct invocation of the mesh-cni binary with the CNI
// environment set by hand, for inputs no well-behaved runtime would send.
type pluginCall struct {
	Command     string
	ContainerID string
	Netns       string
	IfName      string
	Args        string
	Stdin       []byte
	// StdinReader, when set, is stdin instead of Stdin (a stream too large to
	// hold in the test).
	StdinReader io.Reader
	// Credential runs the plugin as another user.
	Credential *syscall.Credential
	// Usage, when set, receives the plugin process's resource usage.
	Usage *syscall.Rusage
}

// run executes the plugin and returns its stdout, and the CNI error it printed
// when it failed.
func (c pluginCall) run(ctx context.Context, t testing.TB) ([]byte, *types.Error) {
	t.Helper()
	bin := harness.Bins(t).Path("mesh-cni")
	cmd := exec.CommandContext(ctx, bin)
	cmd.Env = []string{
		"CNI_COMMAND=" + c.Command,
		"CNI_CONTAINERID=" + c.ContainerID,
		"CNI_NETNS=" + c.Netns,
		"CNI_IFNAME=" + c.IfName,
		"CNI_ARGS=" + c.Args,
		"CNI_PATH=/nonexistent",
	}
	cmd.Stdin = bytes.NewReader(c.Stdin)
	if c.StdinReader != nil {
		cmd.Stdin = c.StdinReader
	}
	cmd.Dir = "/"
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if c.Credential != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: c.Credential}
	}
	err := cmd.Run()
	if c.Usage != nil && cmd.ProcessState != nil {
		if ru, ok := cmd.ProcessState.SysUsage().(*syscall.Rusage); ok {
			*c.Usage = *ru
		}
	}
	if err == nil {
		return stdout.Bytes(), nil
	}
	var cniErr types.Error
	if jerr := json.Unmarshal(stdout.Bytes(), &cniErr); jerr != nil || cniErr.Code == 0 {
		t.Fatalf("plugin failed without a CNI error on stdout: %v\nstdout: %s\nstderr: %s", err, stdout.String(), stderr.String())
	}
	t.Logf("plugin error (code %d): %s; %s", cniErr.Code, cniErr.Msg, cniErr.Details)
	return stdout.Bytes(), &cniErr
}
