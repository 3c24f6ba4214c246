package proxy

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func sampleRecord(i int) Record {
	return Record{
		Time:          time.Date(2026, 1, 2, 3, 4, 5, i, time.UTC),
		Direction:     Inbound,
		Client:        netip.MustParseAddrPort("[fd00::1]:40000"),
		OriginalDst:   netip.MustParseAddrPort("10.0.0.2:8080"),
		DstSource:     SourceLocalAddr,
		Local:         netip.MustParseAddrPort("10.0.0.2:15006"),
		BytesToDst:    int64(i),
		BytesToClient: 2 * int64(i),
		Duration:      time.Millisecond,
		Error:         "",
	}
}

func TestRecordFileRoundTrip(t *testing.T) {
	path := filepath.Join(t.TempDir(), "records.jsonl")
	rec, err := newRecorder(path)
	if err != nil {
		t.Fatal(err)
	}
	want := []Record{sampleRecord(1), sampleRecord(2), {Direction: Outbound, Error: "original destination: no such file"}}
	for _, r := range want {
		if err := rec.add(r); err != nil {
			t.Fatal(err)
		}
	}
	if err := rec.close(); err != nil {
		t.Fatal(err)
	}
	got, err := ReadRecords(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(want) {
		t.Fatalf("read %d records, want %d", len(got), len(want))
	}
	for i := range want {
		if !got[i].Time.Equal(want[i].Time) {
			t.Errorf("record %d time %v, want %v", i, got[i].Time, want[i].Time)
		}
		got[i].Time = want[i].Time
		if got[i] != want[i] {
			t.Errorf("record %d:\n got %+v\nwant %+v", i, got[i], want[i])
		}
	}
	if mem := rec.snapshot(); len(mem) != len(want) || mem[0] != want[0] {
		t.Errorf("in-memory records %+v", mem)
	}
}

func TestReadRecordsPartialAndBad(t *testing.T) {
	dir := t.TempDir()
	if got, err := ReadRecords(filepath.Join(dir, "missing")); err != nil || got != nil {
		t.Fatalf("missing file: %v, %v", got, err)
	}
	partial := filepath.Join(dir, "partial")
	// A complete record, a blank line, then one still being written.
	if err := os.WriteFile(partial, []byte(`{"direction":"outbound","client":"127.0.0.1:1"}`+"\n\n"+`{"direction":"inb`), 0o600); err != nil {
		t.Fatal(err)
	}
	got, err := ReadRecords(partial)
	if err != nil || len(got) != 1 || got[0].Direction != Outbound || got[0].Client != netip.MustParseAddrPort("127.0.0.1:1") {
		t.Fatalf("partial file: %+v, %v", got, err)
	}
	bad := filepath.Join(dir, "bad")
	if err := os.WriteFile(bad, []byte("{}\nnot json\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadRecords(bad); err == nil {
		t.Fatal("malformed line accepted")
	}
}

func TestWaitForRecords(t *testing.T) {
	path := filepath.Join(t.TempDir(), "records.jsonl")
	rec, err := newRecorder(path)
	if err != nil {
		t.Fatal(err)
	}
	defer rec.close()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	errc := make(chan error, 1)
	go func() {
		for i := range 3 {
			if err := rec.add(sampleRecord(i)); err != nil {
				errc <- err
				return
			}
		}
		errc <- nil
	}()
	got, err := WaitForRecords(ctx, path, func(rs []Record) bool { return len(rs) == 3 })
	if err != nil || len(got) != 3 {
		t.Fatalf("WaitForRecords = %d records, %v", len(got), err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}

	short, cancelShort := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancelShort()
	got, err = WaitForRecords(short, path, func(rs []Record) bool { return len(rs) > 3 })
	if !errors.Is(err, context.DeadlineExceeded) || len(got) != 3 {
		t.Fatalf("WaitForRecords on a condition never met = %d records, %v", len(got), err)
	}
}
