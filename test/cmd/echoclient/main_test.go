package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func echoListener(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_, _ = io.Copy(c, c)
			}()
		}
	}()
	return ln.Addr().String()
}

func readRecords(t *testing.T, path string) []Connection {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []Connection
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var c Connection
		if err := json.Unmarshal(sc.Bytes(), &c); err != nil {
			t.Fatalf("record line %q: %v", sc.Text(), err)
		}
		out = append(out, c)
	}
	return out
}

func TestRecordsEachConnection(t *testing.T) {
	addr := echoListener(t)
	rec := filepath.Join(t.TempDir(), "client.jsonl")
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), []string{"-connect", addr, "-n", "3", "-record", rec}, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s%s", code, stdout.String(), stderr.String())
	}
	recs := readRecords(t, rec)
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
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	var stdout, stderr bytes.Buffer
	if code := run(ctx, []string{"-connect", addr, "-n", "0", "-interval", "10ms", "-record", rec}, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s%s", code, stdout.String(), stderr.String())
	}
	recs := readRecords(t, rec)
	if len(recs) < 2 {
		t.Fatalf("%d records in 300ms at 10ms intervals", len(recs))
	}
	for _, c := range recs {
		if c.Error != "" {
			t.Errorf("record %+v: stopping must not be recorded as a failure", c)
		}
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
