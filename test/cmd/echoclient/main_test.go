package main

import (
	"bytes"
	"context"
	"io"
	"net"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

func echoListener(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	fixtures.ServeEcho(t, ln)
	return ln.Addr().String()
}

func TestRecordsEachConnection(t *testing.T) {
	addr := echoListener(t)
	rec := filepath.Join(t.TempDir(), "client.jsonl")
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), []string{"-connect", addr, "-n", "3", "-record", rec}, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s%s", code, stdout.String(), stderr.String())
	}
	recs := fixtures.MustReadJSONL[Connection](t, rec)
	if len(recs) != 3 {
		t.Fatalf("%d records, want 3:\n%s", len(recs), stdout.String())
	}
	for _, c := range recs {
		if c.Error != "" || c.Local == "" || c.Time.IsZero() {
			t.Errorf("record %+v: want a successful round trip with its local address", c)
		}
	}
}

// -n 0 runs until stopped; stopping is not a failure and leaves no error record.
func TestUntilStopped(t *testing.T) {
	addr := echoListener(t)
	rec := filepath.Join(t.TempDir(), "client.jsonl")
	ctx := fixtures.Context(t, 300*time.Millisecond)
	var stdout, stderr bytes.Buffer
	if code := run(ctx, []string{"-connect", addr, "-n", "0", "-interval", "10ms", "-record", rec}, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s%s", code, stdout.String(), stderr.String())
	}
	recs := fixtures.MustReadJSONL[Connection](t, rec)
	if len(recs) < 2 {
		t.Fatalf("%d records in 300ms at 10ms intervals", len(recs))
	}
	for _, c := range recs {
		if c.Error != "" {
			t.Errorf("record %+v: stopping must not be recorded as a failure", c)
		}
	}
}

// -hold makes every round trip on one connection, and dials again only after
// one failed.
func TestHoldKeepsOneConnection(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 4)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted <- c
			go func() {
				defer c.Close()
				_, _ = io.Copy(c, c)
			}()
		}
	}()
	rec := filepath.Join(t.TempDir(), "client.jsonl")
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), []string{"-connect", ln.Addr().String(), "-n", "3", "-hold", "-record", rec}, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s%s", code, stdout.String(), stderr.String())
	}
	recs := fixtures.MustReadJSONL[Connection](t, rec)
	if len(recs) != 3 || len(accepted) != 1 {
		t.Fatalf("%d records over %d connections, want 3 over 1", len(recs), len(accepted))
	}
	for _, c := range recs {
		if c.Error != "" || c.Local != recs[0].Local {
			t.Errorf("record %+v: want a round trip from %s", c, recs[0].Local)
		}
	}

	<-accepted
	// The server drops the connection: that round trip fails, the next dials
	// again.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	rec = filepath.Join(t.TempDir(), "again.jsonl")
	done := make(chan int, 1)
	go func() {
		done <- run(ctx, []string{"-connect", ln.Addr().String(), "-n", "0", "-interval", "20ms", "-hold", "-record", rec}, io.Discard, io.Discard)
	}()
	first := <-accepted
	waitCtx := fixtures.Context(t, 30*time.Second)
	if _, err := fixtures.WaitJSONL(waitCtx, rec, func(cs []Connection) bool { return len(cs) > 0 }); err != nil {
		t.Fatalf("a round trip before the drop: %v", err)
	}
	first.(*net.TCPConn).SetLinger(0)
	first.Close()
	<-accepted
	// A round trip on the new connection: the last record is a success, after
	// the failure.
	if _, err := fixtures.WaitJSONL(waitCtx, rec, func(cs []Connection) bool {
		return len(cs) > 0 && cs[len(cs)-1].Error == "" && slices.ContainsFunc(cs, func(c Connection) bool { return c.Error != "" })
	}); err != nil {
		t.Fatalf("a round trip after the drop: %v", err)
	}
	cancel()
	<-done
	var locals []string
	failed := 0
	for _, c := range fixtures.MustReadJSONL[Connection](t, rec) {
		if c.Error != "" {
			failed++
		} else if len(locals) == 0 || locals[len(locals)-1] != c.Local {
			locals = append(locals, c.Local)
		}
	}
	if failed != 1 || len(locals) != 2 {
		t.Errorf("after the server dropped the connection: %d failures, round trips from %q; want 1, then a new connection", failed, locals)
	}
}

func TestRejectsBadFlags(t *testing.T) {
	for _, args := range [][]string{{}, {"-connect", "x:1", "-n", "-1"}, {"-connect", "x:1", "-interval", "-1s"}} {
		var stdout, stderr bytes.Buffer
		if code := run(context.Background(), args, &stdout, &stderr); code != 2 {
			t.Errorf("run(%q) = %d, want 2", args, code)
		}
	}
}
