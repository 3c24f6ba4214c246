package bench

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/pprof/profile"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// perfRate is the sampling frequency of a machine profile, per CPU: odd, so
// that it does not beat with the kernel's tick.
const perfRate = 997

// errNoPerf says the machine has no perf(1): a benchmark then goes without its
// machine profiles and says so.
var errNoPerf = errors.New("perf(1) is not installed (Debian: linux-perf)")

// machineProfile runs fn while perf(1) samples every CPU of the machine
// (user space and kernel, with call chains), and writes what it sampled to
// file as a pprof CPU profile, the format the report reads for the Go
// profiles. Go's profiler sees one process; what bounds a data path is also
// in the kernel and in softirq, on any CPU. The event is cpu-clock, which a
// VM without hardware counters has too.
func machineProfile(ctx context.Context, file string, fn func() error) error {
	perf, err := exec.LookPath("perf")
	if err != nil {
		return errNoPerf
	}
	data := file + ".perf"
	defer os.Remove(data)
	var stderr bytes.Buffer
	rec := exec.CommandContext(ctx, perf, "record", "-q", "-e", "cpu-clock", "-F", strconv.Itoa(perfRate), "-a", "-g", "-o", data)
	rec.Stderr = &stderr
	if err := rec.Start(); err != nil {
		return fmt.Errorf("perf record: %w", err)
	}
	stopped := false
	defer func() {
		if !stopped {
			_ = rec.Process.Kill()
			_ = rec.Wait()
		}
	}()
	// perf record has its events open once it wrote the file's header.
	if !fixtures.Eventually(ctx, 10*time.Second, 20*time.Millisecond, func() bool {
		st, err := os.Stat(data)
		return err == nil && st.Size() > 0
	}) {
		return fmt.Errorf("perf record did not start within 10s (%s)", strings.TrimSpace(stderr.String()))
	}
	start := time.Now()
	ferr := fn()
	took := time.Since(start)
	// SIGINT: perf record writes its samples out and exits.
	_ = rec.Process.Signal(syscall.SIGINT)
	werr := rec.Wait()
	stopped = true
	if ferr != nil {
		return ferr
	}
	// It exits by the signal once its file is complete.
	var exit *exec.ExitError
	if errors.As(werr, &exit) {
		if ws, ok := exit.Sys().(syscall.WaitStatus); ok && ws.Signaled() && ws.Signal() == syscall.SIGINT {
			werr = nil
		}
	}
	if werr != nil {
		return fmt.Errorf("perf record: %w (%s)", werr, strings.TrimSpace(stderr.String()))
	}
	script := exec.CommandContext(ctx, perf, "script", "-i", data, "-F", "comm,period,ip,sym")
	out, err := script.Output()
	if err != nil {
		return fmt.Errorf("perf script: %w", err)
	}
	prof, err := perfScriptProfile(bytes.NewReader(out), took)
	if err != nil {
		return err
	}
	f, err := os.Create(file)
	if err != nil {
		return err
	}
	if err := prof.Write(f); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", file, err)
	}
	return f.Close()
}

// perfScriptProfile reads `perf script -F comm,period,ip,sym` (a header line
// "comm period" per sample, then its call chain, leaf first, one
// "address symbol" line per frame, a blank line after it) into a pprof
// profile of CPU nanoseconds (cpu-clock's period is in nanoseconds). Each
// stack gets its process's name as its root frame ("process refproxy"), so the
// profile also splits the CPU by process. Samples of an idle CPU (do_idle
// with no interrupt on top of it) are left out: the profile is of busy time.
func perfScriptProfile(r io.Reader, duration time.Duration) (*profile.Profile, error) {
	p := &profile.Profile{
		SampleType:    []*profile.ValueType{{Type: "samples", Unit: "count"}, {Type: "cpu", Unit: "nanoseconds"}},
		PeriodType:    &profile.ValueType{Type: "cpu", Unit: "nanoseconds"},
		Period:        int64(time.Second / perfRate),
		DurationNanos: duration.Nanoseconds(),
		TimeNanos:     time.Now().Add(-duration).UnixNano(),
	}
	locs := map[string]*profile.Location{}
	loc := func(name string) *profile.Location {
		if l, ok := locs[name]; ok {
			return l
		}
		fn := &profile.Function{ID: uint64(len(p.Function) + 1), Name: name, SystemName: name}
		p.Function = append(p.Function, fn)
		l := &profile.Location{ID: uint64(len(p.Location) + 1), Line: []profile.Line{{Function: fn}}}
		p.Location = append(p.Location, l)
		locs[name] = l
		return l
	}
	var (
		comm   string
		period int64
		frames []string
		inside bool
	)
	flush := func() {
		if inside && !idle(frames) {
			s := &profile.Sample{Value: []int64{1, period}}
			for _, f := range frames {
				s.Location = append(s.Location, loc(f))
			}
			s.Location = append(s.Location, loc("process "+comm))
			p.Sample = append(p.Sample, s)
		}
		inside, frames = false, frames[:0]
	}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.TrimSpace(line) == "":
			flush()
		case line[0] == ' ' || line[0] == '\t':
			if !inside {
				return nil, fmt.Errorf("perf script: a frame before any sample: %q", line)
			}
			// "ffffffff81234567 tcp_sendmsg" or "7f12 [unknown]".
			_, sym, _ := strings.Cut(strings.TrimSpace(line), " ")
			if sym = strings.TrimSpace(sym); sym == "" {
				sym = "[unknown]"
			}
			frames = append(frames, sym)
		default:
			flush()
			// The command may hold spaces; the period is the last field.
			fields := strings.Fields(line)
			if len(fields) < 2 {
				return nil, fmt.Errorf("perf script: sample header %q has no period", line)
			}
			n, err := strconv.ParseInt(fields[len(fields)-1], 10, 64)
			if err != nil || n <= 0 {
				return nil, fmt.Errorf("perf script: sample header %q: period %q", line, fields[len(fields)-1])
			}
			comm, period, inside = strings.Join(fields[:len(fields)-1], " "), n, true
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("perf script: %w", err)
	}
	flush()
	return p, p.CheckValid()
}

// idle reports whether a call chain is an idle CPU's: in the idle loop, and
// not in an interrupt taken there (which is busy: softirq runs there).
func idle(frames []string) bool {
	inIdle := false
	for _, f := range frames {
		if strings.Contains(f, "irq") {
			return false
		}
		if f == "do_idle" {
			inIdle = true
		}
	}
	return inIdle
}

// A perf script excerpt: a write through a sockmap, softirq taken in the
// idle loop, a plain idle sample and a command with a space in its name.
const perfScriptSample = `refproxy 1003009 
	ffffffff81a1 tcp_bpf_sendmsg
	ffffffff81a2 sock_write_iter
	          4a1b2c main.main

swapper     1003009 
	ffffffff81b1 net_rx_action
	ffffffff81b2 handle_softirqs
	ffffffff81b3 irq_exit_rcu
	ffffffff81b4 pv_native_safe_halt
	ffffffff81b5 do_idle

swapper 1003009 
	ffffffff81b4 pv_native_safe_halt
	ffffffff81b5 do_idle

kworker/0:1 H 2006018 
	ffffffff81c1 [unknown]
`

func TestPerfScriptProfile(t *testing.T) {
	p, err := perfScriptProfile(strings.NewReader(perfScriptSample), time.Second)
	if err != nil {
		t.Fatal(err)
	}
	var stacks []string
	var total int64
	for _, s := range p.Sample {
		var names []string
		for _, l := range s.Location {
			names = append(names, l.Line[0].Function.Name)
		}
		stacks = append(stacks, strings.Join(names, ";"))
		total += s.Value[1]
	}
	want := []string{
		"tcp_bpf_sendmsg;sock_write_iter;main.main;process refproxy",
		"net_rx_action;handle_softirqs;irq_exit_rcu;pv_native_safe_halt;do_idle;process swapper",
		"[unknown];process kworker/0:1 H",
	}
	if strings.Join(stacks, "\n") != strings.Join(want, "\n") {
		t.Fatalf("stacks:\n%s\nwant:\n%s", strings.Join(stacks, "\n"), strings.Join(want, "\n"))
	}
	if total != 1003009*2+2006018 {
		t.Fatalf("cpu total %d", total)
	}
	for _, bad := range []string{"\tffff tcp_sendmsg\n", "refproxy\n\tffff x\n", "refproxy -1\n"} {
		if _, err := perfScriptProfile(strings.NewReader(bad), time.Second); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}

// A real perf record around some loopback traffic: the profile parses and
// holds the kernel's TCP functions.
func TestMachineProfile(t *testing.T) {
	requireRoot(t)
	file := filepath.Join(t.TempDir(), "m.pprof")
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	fixtures.Serve(t, l, func(c net.Conn) { _, _ = io.Copy(io.Discard, c) })
	err = machineProfile(context.Background(), file, func() error {
		c, err := net.Dial("tcp", l.Addr().String())
		if err != nil {
			return err
		}
		defer c.Close()
		buf := make([]byte, 64<<10)
		for end := time.Now().Add(500 * time.Millisecond); time.Now().Before(end); {
			if _, err := c.Write(buf); err != nil {
				return err
			}
		}
		return nil
	})
	if errors.Is(err, errNoPerf) {
		t.Skip(err)
	}
	if err != nil {
		t.Fatal(err)
	}
	f, err := openProfile(file)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, fn := range f.Function {
		found = found || fn.Name == "tcp_sendmsg_locked"
	}
	if len(f.Sample) == 0 || !found {
		t.Fatalf("%d samples, tcp_sendmsg_locked found: %v", len(f.Sample), found)
	}
}

func openProfile(path string) (*profile.Profile, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	return profile.ParseData(data)
}
