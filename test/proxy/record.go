package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"sync"
	"time"
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

// ReadRecords reads a record file written by a proxy, possibly while it is still
// being written. A missing file holds no records yet. A last line without its
// newline is a record still being written and is left for the next read; any other
// line that does not decode is an error.
func ReadRecords(path string) ([]Record, error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read records: %w", err)
	}
	var records []Record
	for lineNo := 1; ; lineNo++ {
		i := bytes.IndexByte(data, '\n')
		if i < 0 {
			break
		}
		line := data[:i]
		data = data[i+1:]
		if len(bytes.TrimSpace(line)) == 0 {
			continue
		}
		var rec Record
		if err := json.Unmarshal(line, &rec); err != nil {
			return nil, fmt.Errorf("record file %s line %d: %w", path, lineNo, err)
		}
		records = append(records, rec)
	}
	return records, nil
}

// pollInterval is how often WaitForRecords rereads the file.
const pollInterval = 20 * time.Millisecond

// WaitForRecords rereads the record file at path until done returns true for its
// records, and returns them. It gives up with ctx, returning the last records read
// together with the context's error.
func WaitForRecords(ctx context.Context, path string, done func([]Record) bool) ([]Record, error) {
	ticker := time.NewTicker(pollInterval)
	defer ticker.Stop()
	for {
		records, err := ReadRecords(path)
		if err != nil {
			return records, err
		}
		if done(records) {
			return records, nil
		}
		select {
		case <-ctx.Done():
			return records, fmt.Errorf("waiting for records in %s (have %d): %w", path, len(records), ctx.Err())
		case <-ticker.C:
		}
	}
}
