// Command echoclient is the client of the node tests' images. Started with
// -idle it only waits for SIGTERM (the container stays up for exec); run with
// -connect it makes -n connections to an echo server (-n 0: until SIGTERM,
// -interval apart), one round trip each, and prints one line per connection:
// "ok LOCAL" or "error: ...". With -record it also appends one JSON line per
// connection to a file, for a test that counts them while the client runs. It
// exits 0 only when every round trip succeeded (with -n 0: on SIGTERM). With
// -hold every round trip goes over one connection, dialed again only after a
// round trip failed: a test sees from the records' local address whether one
// connection lasted through what it did.
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/mesh-cni/mesh-cni/test/cmd/internal/cmdmain"
)

func main() { cmdmain.Run(run) }

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("echoclient", flag.ContinueOnError)
	fs.SetOutput(stderr)
	idle := fs.Bool("idle", false, "do nothing until SIGTERM")
	addr := fs.String("connect", "", "HOST:PORT of the echo server")
	n := fs.Int("n", 1, "number of connections (0: until SIGTERM)")
	interval := fs.Duration("interval", 0, "pause between connections")
	timeout := fs.Duration("timeout", 10*time.Second, "deadline of each connection")
	record := fs.String("record", "", "append a JSON line per connection to this file")
	hold := fs.Bool("hold", false, "make every round trip on one kept connection (dialed again after a failure)")
	if code, done := cmdmain.Parse(fs, args); done {
		return code
	}
	if *idle {
		<-ctx.Done()
		return 0
	}
	if *addr == "" || *n < 0 || *interval < 0 {
		fmt.Fprintln(stderr, "echoclient: -connect HOST:PORT is required (or -idle), -n and -interval must not be negative")
		return 2
	}
	rec, err := cmdmain.OpenRecord(*record)
	if err != nil {
		fmt.Fprintf(stderr, "echoclient: %v\n", err)
		return 1
	}
	defer rec.Close()
	failed := 0
	var kept net.Conn
	defer func() {
		if kept != nil {
			kept.Close()
		}
	}()
	for i := 0; *n == 0 || i < *n; i++ {
		if i > 0 && *interval > 0 {
			select {
			case <-ctx.Done():
			case <-time.After(*interval):
			}
		}
		if ctx.Err() != nil {
			if *n == 0 {
				break
			}
			failed++
			continue
		}
		start := time.Now()
		msg := fmt.Appendf(nil, "echoclient %d\n", i)
		var (
			local string
			err   error
		)
		if *hold {
			local, err = keptRoundTrip(ctx, &kept, *addr, *timeout, msg)
		} else {
			local, err = roundTrip(ctx, *addr, *timeout, msg)
		}
		if err != nil && stopped(ctx) && *n == 0 {
			break // stopped mid-connection: not a failure of the path
		}
		c := Connection{Time: start.UTC(), Local: local}
		if err != nil {
			failed++
			c.Error = err.Error()
			fmt.Fprintf(stdout, "error: %v\n", err)
		} else {
			fmt.Fprintf(stdout, "ok %s\n", local)
		}
		if err := rec.Write(c); err != nil {
			fmt.Fprintf(stderr, "echoclient: record: %v\n", err)
		}
	}
	if failed > 0 && *n > 0 {
		return 1
	}
	return 0
}

// stopped reports whether ctx has ended. A deadline counts from its instant:
// a dial bounded by it fails with an i/o timeout just before the context's
// own timer marks it done.
func stopped(ctx context.Context) bool {
	if ctx.Err() != nil {
		return true
	}
	dl, ok := ctx.Deadline()
	return ok && !time.Now().Before(dl)
}

// Connection is one line of the record file: a round trip's start, the local
// address it was made from, and its error ("" when the echo came back whole).
type Connection struct {
	Time  time.Time `json:"time"`
	Local string    `json:"local,omitempty"`
	Error string    `json:"error,omitempty"`
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
	return echo(ctx, c, msg)
}

// keptRoundTrip is a round trip on *kept, dialed first when nil; a failure
// closes it (the next one dials again).
func keptRoundTrip(ctx context.Context, kept *net.Conn, addr string, timeout time.Duration, msg []byte) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if *kept == nil {
		var d net.Dialer
		c, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			return "", err
		}
		*kept = c
	}
	local, err := echo(ctx, *kept, msg)
	if err != nil {
		(*kept).Close()
		*kept = nil
	}
	return local, err
}

// echo writes msg on c, reads it back and returns c's local address, within
// ctx's deadline.
func echo(ctx context.Context, c net.Conn, msg []byte) (string, error) {
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
