// Command echoserver is the server of the node tests' images: it echoes every
// TCP connection it accepts and, with -record, appends one JSON line per
// accepted connection (the client's address as the server saw it) to a file.
// A client address that is not a proxy's means the connection bypassed the
// mesh. It prints "ready" once listening and exits on SIGTERM or SIGINT.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"github.com/mesh-cni/mesh-cni/test/cmd/internal/cmdmain"
)

func main() { cmdmain.Run(run) }

// Accepted is one line of the record file.
type Accepted struct {
	Time   time.Time `json:"time"`
	Client string    `json:"client"`
	Local  string    `json:"local"`
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("echoserver", flag.ContinueOnError)
	fs.SetOutput(stderr)
	listen := fs.String("listen", ":8080", "TCP address to listen on")
	record := fs.String("record", "", "append a JSON line per accepted connection to this file")
	if code, done := cmdmain.Parse(fs, args); done {
		return code
	}
	rec, err := cmdmain.OpenRecord(*record)
	if err != nil {
		fmt.Fprintf(stderr, "echoserver: %v\n", err)
		return 1
	}
	defer rec.Close()
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", *listen)
	if err != nil {
		fmt.Fprintf(stderr, "echoserver: %v\n", err)
		return 1
	}
	fmt.Fprintln(stdout, "ready")
	var wg sync.WaitGroup
	go func() {
		<-ctx.Done()
		ln.Close()
	}()
	for {
		c, err := ln.Accept()
		if err != nil {
			break
		}
		if err := rec.Write(Accepted{Time: time.Now().UTC(), Client: c.RemoteAddr().String(), Local: c.LocalAddr().String()}); err != nil {
			fmt.Fprintf(stderr, "echoserver: record: %v\n", err)
		}
		wg.Go(func() {
			defer c.Close()
			_, _ = io.Copy(c, c)
		})
	}
	wg.Wait()
	return 0
}
