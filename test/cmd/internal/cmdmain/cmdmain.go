// Package cmdmain starts the test commands the same way: their run function
// gets a context that SIGTERM or SIGINT cancels, the arguments and the standard
// streams, and what it returns is the exit status.
package cmdmain

import (
	"context"
	"io"
	"os"
	"os/signal"
	"syscall"
)

// Run calls run and exits with its status.
func Run(run func(ctx context.Context, args []string, stdout, stderr io.Writer) int) {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
