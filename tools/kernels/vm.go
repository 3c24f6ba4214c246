package kernels

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"syscall"
	"time"
)

// vm is one QEMU run: one boot of a kernel for one suite.
type vm struct {
	name, suite      string
	image, initramfs string
	results          string // shared read-write with the guest
	console          string // the serial console and QEMU's own messages
	memoryMiB, cpus  int
}

// run boots the VM and waits for it to power off, or kills it when ctx ends.
//
// The host's KVM is not usable for this (nested: -cpu host aborts and
// -enable-kvm stalls in the kernel's decompressor), so the CPU is emulated by
// TCG, one host thread per guest CPU; the kernel reaches init in about five
// seconds. The host's whole tree is shared read-only over 9p: the guest runs
// the host's binaries, the test binaries and tools such as ip and ss from it,
// so nothing but a small initramfs has to be built per kernel.
func (v vm) run(ctx context.Context) error {
	log, err := os.Create(v.console)
	if err != nil {
		return err
	}
	defer log.Close()
	args := []string{
		"-name", v.name,
		"-nodefaults", "-no-user-config", "-display", "none", "-monitor", "none",
		"-serial", "stdio", "-no-reboot", "-nic", "none",
		"-accel", "tcg,thread=multi", "-cpu", "max",
		"-m", fmt.Sprint(v.memoryMiB), "-smp", fmt.Sprint(v.cpus),
		"-kernel", v.image, "-initrd", v.initramfs,
		// panic=-1 reboots at once on a kernel panic, which -no-reboot turns
		// into QEMU exiting. A CPU stuck in the kernel for a minute, or a task
		// blocked for two, panics it: a hung kernel ends its suite then, not at
		// the suite's timeout. random.trust_cpu seeds the entropy from the
		// emulated RDRAND at once instead of waiting for it.
		// lsm= adds the BPF LSM (where the kernel has it) for the data path's
		// packet-socket hook.
		"-append", "console=ttyS0 panic=-1 watchdog_thresh=30 softlockup_panic=1 hung_task_panic=1 random.trust_cpu=on " +
			"lsm=lockdown,capability,landlock,yama,bpf " + suiteParam + v.suite,
		"-virtfs", "local,path=/,mount_tag=" + hostTag + ",security_model=none,readonly=on,multidevs=remap",
		"-virtfs", "local,path=" + v.results + ",mount_tag=" + resultsTag + ",security_model=none,multidevs=remap",
	}
	cmd := exec.Command("qemu-system-x86_64", args...)
	cmd.Stdin = nil
	cmd.Stdout, cmd.Stderr = log, log
	// Its own process group, killed whole; and killed by the kernel if this
	// program dies without cleaning up. Pdeathsig fires when the thread that
	// started QEMU exits, so that thread stays locked until QEMU is gone.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	done := make(chan error, 1)
	started := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		done <- cmd.Wait()
	}()
	if err := <-started; err != nil {
		return fmt.Errorf("start qemu: %w", err)
	}
	select {
	case err := <-done:
		if err != nil {
			return fmt.Errorf("qemu: %w", err)
		}
		return nil
	case <-ctx.Done():
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		select {
		case <-done:
		case <-time.After(10 * time.Second):
		}
		return fmt.Errorf("qemu killed: %w", context.Cause(ctx))
	}
}
