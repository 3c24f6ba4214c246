package benchreport

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/pprof/profile"

	"github.com/mesh-cni/mesh-cni/test/bench/results"
)

// writeStacks writes a CPU profile of the given stacks (leaf first), 1 ms each.
func writeStacks(t *testing.T, path string, stacks ...[]string) {
	t.Helper()
	p := &profile.Profile{SampleType: []*profile.ValueType{{Type: "samples", Unit: "count"}, {Type: "cpu", Unit: "nanoseconds"}}}
	locs := map[string]*profile.Location{}
	for _, st := range stacks {
		s := &profile.Sample{Value: []int64{1, 1e6}}
		for _, name := range st {
			l, found := locs[name]
			if !found {
				fn := &profile.Function{ID: uint64(len(p.Function) + 1), Name: name}
				p.Function = append(p.Function, fn)
				l = &profile.Location{ID: uint64(len(p.Location) + 1), Line: []profile.Line{{Function: fn}}}
				p.Location = append(p.Location, l)
				locs[name] = l
			}
			s.Location = append(s.Location, l)
		}
		p.Sample = append(p.Sample, s)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := p.Write(f); err != nil {
		t.Fatal(err)
	}
}

// The splice's missed throughput target cites the machine profiles: CPU per
// MiB of both variants and the shares of the functions that differ.
func TestSpliceProfileNote(t *testing.T) {
	dir := t.TempDir()
	send := []string{"copy", kfnBPFSend, "process app"}
	recv := []string{kfnBPFRecv, "process proxy"}
	trace := []string{kfnTraceRun, "process proxy"}
	plainSend := []string{kfnTCPSend, "process app"}
	// Splice: 5 ms over 2 MiB (2 spliced sends, 1 plain, 1 read, 1
	// trace); without: 2 ms over 2 MiB (1 plain send, 1 trace).
	writeStacks(t, filepath.Join(dir, "profiles", "s.pprof"), send, send, plainSend, recv, trace)
	writeStacks(t, filepath.Join(dir, "profiles", "p.pprof"), plainSend, trace)
	d := data{dir: dir, byName: map[string]*results.Result{"capture": {Name: "capture",
		Metrics: []results.Metric{{Name: "throughput-chain", Unit: "MiB/s", HigherIsBetter: true, Baseline: "limit-read", Series: []results.Series{
			series("limit-read", 0, 1000, 1000), series("ebpf-read", 0, 1000, 1000), series("splice", 0, 900, 900)}}},
		Profiles: []results.Profile{
			{Name: "machine-throughput-splice", File: "profiles/s.pprof", Operations: 2, Operation: "MiB"},
			{Name: "machine-throughput-ebpf-read", File: "profiles/p.pprof", Operations: 2, Operation: "MiB"},
		}}}}
	note := spliceProfileNote(d, "throughput")
	for _, want := range []string{
		"2.50 ms of CPU per MiB with the splice, 1.00 ms without it (2.50×)",
		"go through `tcp_bpf_sendmsg` (40.0% of the CPU) and every other write through `tcp_sendmsg` (20.0%)",
		"proxies' reads of them through `tcp_bpf_recvmsg` (20.0%)",
		"every write goes through `tcp_sendmsg` (50.0%)",
		"takes 20.0% with the splice and 50.0% without",
	} {
		if !strings.Contains(note, want) {
			t.Errorf("note lacks %q:\n%s", want, note)
		}
	}
	var got target
	for _, tg := range spliceTargets(d) {
		if strings.HasPrefix(tg.goal, "splice: throughput") {
			got = tg
		}
	}
	if got.status != missed || !strings.Contains(got.limits, "ms of CPU per MiB") {
		t.Fatalf("throughput target %+v", got)
	}
	if spliceProfileNote(data{dir: dir, byName: map[string]*results.Result{}}, "throughput") != "" {
		t.Fatal("a note without profiles")
	}
}
