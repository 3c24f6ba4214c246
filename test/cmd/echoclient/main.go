// Command echoclient is the client of the node tests' images. Started with
// -idle it only waits for SIGTERM (the container stays up for exec); run with
// -connect it makes -n connections to an echo server, one round trip each, and
// prints one line per connection: "ok LOCAL" or "error: ...". It exits 0 only
// when every round trip succeeded.
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"syscall"
	"time"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("echoclient", flag.ContinueOnError)
	fs.SetOutput(stderr)
	idle := fs.Bool("idle", false, "do nothing until SIGTERM")
	addr := fs.String("connect", "", "HOST:PORT of the echo server")
	n := fs.Int("n", 1, "number of connections")
	timeout := fs.Duration("timeout", 10*time.Second, "deadline of each connection")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if *idle {
		<-ctx.Done()
		return 0
	}
	if *addr == "" || *n < 1 {
		fmt.Fprintln(stderr, "echoclient: -connect HOST:PORT and -n >= 1 are required (or -idle)")
		return 2
	}
	failed := 0
	for i := range *n {
		local, err := roundTrip(ctx, *addr, *timeout, fmt.Appendf(nil, "echoclient %d\n", i))
		if err != nil {
			failed++
			fmt.Fprintf(stdout, "error: %v\n", err)
			continue
		}
		fmt.Fprintf(stdout, "ok %s\n", local)
	}
	if failed > 0 {
		return 1
	}
	return 0
}

// roundTrip connects, writes msg, reads it back and returns the local address.
func roundTrip(ctx context.Context, addr string, timeout time.Duration, msg []byte) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return "", err
	}
	defer c.Close()
	if dl, ok := ctx.Deadline(); ok {
		if err := c.SetDeadline(dl); err != nil {
			return "", err
		}
	}
	if _, err := c.Write(msg); err != nil {
		return "", fmt.Errorf("write: %w", err)
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil {
		return "", fmt.Errorf("read echo: %w", err)
	}
	if !bytes.Equal(got, msg) {
		return "", errors.New("echo differs from what was sent")
	}
	return c.LocalAddr().String(), nil
}
