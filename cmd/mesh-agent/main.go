// Command mesh-agent is the mesh-cni node agent: it serves the gate the mesh-cni
// plugin waits on and programs eBPF redirection for enrolled pods.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/mesh-cni/mesh-cni/internal/agentcli"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := agentcli.Main(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
