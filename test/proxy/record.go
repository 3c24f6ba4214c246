package proxy

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// Direction says which listener accepted a connection.
type Direction string

const (
	// Outbound connections were made by the pod and captured on their way out.
	Outbound Direction = "outbound"
	// Inbound connections came to the pod from outside and were captured on arrival.
	Inbound Direction = "inbound"
)

// DstSource says how the proxy learned a connection's original destination.
type DstSource string

const (
	// SourceGetsockopt means SO_ORIGINAL_DST / IP6T_SO_ORIGINAL_DST answered.
	SourceGetsockopt DstSource = "getsockopt"
	// SourceLocalAddr means getsockopt failed on an inbound connection and the
	// accepted socket's local address was taken instead (right when the capture
	// keeps the destination, as bpf_sk_assign or TPROXY do).
	SourceLocalAddr DstSource = "local-addr"
	// SourceNone means no destination is known (only an error or echo mode).
	SourceNone DstSource = ""
	// SourceForwarded means the proxy was told where to send everything
	// (Config.ForwardTo); no original destination was looked up.
	SourceForwarded DstSource = "forwarded"
)

// Record describes one proxied connection, written when the connection ends.
type Record struct {
	// Time is when the connection was accepted.
	Time time.Time `json:"time"`
	// Pod is the uid of the pod whose listener accepted the connection, for a
	// node proxy (StartNode); empty for a proxy started with Start.
	Pod       string    `json:"pod,omitempty"`
	Direction Direction `json:"direction"`
	// Client is the accepted connection's remote address.
	Client netip.AddrPort `json:"client"`
	// OriginalDst is where the client meant to connect.
	OriginalDst netip.AddrPort `json:"original_dst"`
	DstSource   DstSource      `json:"dst_source"`
	// Local is the accepted connection's local address (the listener's address
	// after a REDIRECT, the original destination after bpf_sk_assign).
	Local netip.AddrPort `json:"local"`
	// BytesToDst were copied from the client onward; BytesToClient back.
	BytesToDst    int64 `json:"bytes_to_dst"`
	BytesToClient int64 `json:"bytes_to_client"`
	// Duration is from accept until both directions finished.
	Duration time.Duration `json:"duration_ns"`
	// Error is the first failure, empty when the connection was proxied cleanly.
	Error string `json:"error,omitempty"`
}

// recorder keeps records in memory and, when it has a file, appends each as one JSON
// line with a single write(2) on an O_APPEND descriptor, so readers in other processes
// never see two records interleaved.
type recorder struct {
	mu      sync.Mutex
	records []Record
	file    *os.File
}

func newRecorder(path string) (*recorder, error) {
	r := &recorder{}
	if path == "" {
		return r, nil
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open record file: %w", err)
	}
	r.file = f
	return r, nil
}

func (r *recorder) add(rec Record) error {
	var line []byte
	if r.file != nil {
		b, err := json.Marshal(rec)
		if err != nil {
			return fmt.Errorf("encode record: %w", err)
		}
		line = append(b, '\n')
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.records = append(r.records, rec)
	if r.file == nil {
		return nil
	}
	if _, err := r.file.Write(line); err != nil {
		return fmt.Errorf("append record to %s: %w", r.file.Name(), err)
	}
	return nil
}

func (r *recorder) snapshot() []Record {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Record(nil), r.records...)
}

func (r *recorder) close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.file == nil {
		return nil
	}
	err := r.file.Close()
	r.file = nil
	if err != nil {
		return fmt.Errorf("close record file: %w", err)
	}
	return nil
}

// ReadRecords reads a record file written by a proxy, possibly while it is
// still being written (fixtures.ReadJSONL).
func ReadRecords(path string) ([]Record, error) { return fixtures.ReadJSONL[Record](path) }

// WaitForRecords rereads the record file at path until done returns true for its
// records, and returns them (fixtures.WaitJSONL).
func WaitForRecords(ctx context.Context, path string, done func([]Record) bool) ([]Record, error) {
	return fixtures.WaitJSONL(ctx, path, done)
}

// MustReadRecords is ReadRecords failing tb on an error.
func MustReadRecords(tb testing.TB, path string) []Record {
	tb.Helper()
	return fixtures.MustReadJSONL[Record](tb, path)
}

// awaitLimit bounds AwaitRecords: a proxy writes a record when a connection
// ends, well within it even on a loaded machine.
const awaitLimit = 30 * time.Second

// AwaitRecords waits, within ctx and at most 30 seconds, until the record file
// at path holds n records or more, and returns them; it fails tb if they do
// not come.
func AwaitRecords(ctx context.Context, tb testing.TB, path string, n int) []Record {
	tb.Helper()
	ctx, cancel := context.WithTimeout(ctx, awaitLimit)
	defer cancel()
	recs, err := WaitForRecords(ctx, path, func(r []Record) bool { return len(r) >= n })
	if err != nil {
		tb.Fatalf("want %d proxy records, have %d: %v", n, len(recs), err)
	}
	return recs
}
