// Command echoserver is the server of the node tests' images: it echoes every
// TCP connection it accepts and, with -record, appends one JSON line per
// accepted connection (the client's address as the server saw it) to a file.
// A client address that is not a proxy's means the connection bypassed the
// mesh. It prints "ready" once listening and exits on SIGTERM or SIGINT.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
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
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	var rec *os.File
	if *record != "" {
		f, err := os.OpenFile(*record, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
		if err != nil {
			fmt.Fprintf(stderr, "echoserver: %v\n", err)
			return 1
		}
		defer f.Close()
		rec = f
	}
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
		if rec != nil {
			line, _ := json.Marshal(Accepted{Time: time.Now().UTC(), Client: c.RemoteAddr().String(), Local: c.LocalAddr().String()})
			// One write per line on an O_APPEND file: lines never interleave.
			if _, err := rec.Write(append(line, '\n')); err != nil {
				fmt.Fprintf(stderr, "echoserver: record: %v\n", err)
			}
		}
		wg.Go(func() {
			defer c.Close()
			_, _ = io.Copy(c, c)
		})
	}
	wg.Wait()
	return 0
}
