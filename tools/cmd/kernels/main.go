// Command kernels runs the kernel matrix (package tools/kernels): each kernel of
// tools/kernels/matrix.txt booted in a QEMU VM on this machine, the data-path and
// end-to-end suites run inside it, one summary line per kernel. It exits 1 when
// any result differs from the matrix, in either direction, or a required kernel
// could not run. As root, after `make build`:
//
//	go run ./tools/cmd/kernels                  # what `make test-kernels` runs
//	go run ./tools/cmd/kernels -kernels 6.1      # one row
//
// It is a command under test/cmd, next to the other programs the tests run,
// because the same binary, built static, is also the VM's init: started as pid
// 1 it runs the guest side of the matrix instead.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/debug"
	"syscall"

	"github.com/mesh-cni/mesh-cni/tools/kernels"
)

func main() {
	if os.Getpid() == 1 {
		guest()
		return
	}
	os.Exit(host())
}

// guest never returns to the kernel: pid 1 exiting panics it. Whatever
// happened, the VM powers off.
func guest() {
	defer kernels.PowerOff()
	defer func() {
		if v := recover(); v != nil {
			kernels.GuestFailed(fmt.Errorf("panic: %v\n%s", v, debug.Stack()))
		}
	}()
	if err := kernels.Guest(context.Background()); err != nil {
		kernels.GuestFailed(err)
	}
}

func host() int {
	cwd, err := os.Getwd()
	if err != nil {
		fmt.Fprintf(os.Stderr, "kernels: %v\n", err)
		return 1
	}
	cache := flag.String("cache", "/var/cache/mesh-cni/kernels", "apt state, unpacked kernels and each run's build (outside the repository)")
	out := flag.String("out", "bin/kernels", "results, one directory per kernel: console.log, <suite>.log, tests.txt")
	bin := flag.String("bin", os.Getenv("MESH_CNI_BIN_DIR"), "prebuilt binaries from `make build` (default $MESH_CNI_BIN_DIR, else bin)")
	filter := flag.String("kernels", "", "regexp matching whole kernel names of the matrix (6.1, 6.1|6.12); empty runs them all")
	flag.Parse()
	if flag.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "kernels: unexpected arguments %q\n", flag.Args())
		return 2
	}
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "kernels: needs root (the guest runs the tests as root over a share of this machine's tree)")
		return 2
	}
	if *bin == "" {
		*bin = "bin"
	}
	abs := func(p string) string {
		if filepath.IsAbs(p) {
			return p
		}
		return filepath.Join(cwd, p)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	root, err := kernels.ModuleRoot(ctx, cwd)
	if err != nil {
		fmt.Fprintf(os.Stderr, "kernels: %v\n", err)
		return 1
	}
	results, err := kernels.Run(ctx, kernels.Options{
		Root: root, Cache: abs(*cache), Out: abs(*out), BinDir: abs(*bin), Filter: *filter, Log: os.Stdout,
	})
	if err != nil {
		fmt.Fprintf(os.Stderr, "kernels: %v\n", err)
		return 1
	}
	return kernels.Summarize(os.Stdout, results)
}
