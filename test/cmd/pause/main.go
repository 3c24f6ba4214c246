// Command pause is the sandbox process of a pod in the node tests' images: it
// holds the pod's namespaces open, reaps children handed to it (it is PID 1 of
// the pod when the runtime shares a PID namespace) and exits on SIGTERM or
// SIGINT. It stands in for the registry's pause image so the runtime needs no
// registry.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for sig := range sigs {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		reap()
	}
}

// reap collects every exited child without blocking.
func reap() {
	for {
		var ws syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
		if pid <= 0 || err != nil {
			return
		}
	}
}
