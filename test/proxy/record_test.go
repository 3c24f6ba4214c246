package proxy

import (
	"net/netip"
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
