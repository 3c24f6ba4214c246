package kernels

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

func TestMatrixParses(t *testing.T) {
	t.Parallel()
	m, err := LoadMatrix()
	if err != nil {
		t.Fatal(err)
	}
	var required []string
	for _, k := range m.Kernels {
		if k.Required {
			required = append(required, k.Name)
		}
		if len(k.Expect) != len(Suites) {
			t.Errorf("%s: %d expectations, want one per suite", k.Name, len(k.Expect))
		}
	}
	// Debian 12's own kernel is the system the README's quick start names.
	if !slices.Contains(required, "6.1") {
		t.Errorf("required kernels %v, want 6.1 among them", required)
	}
}

func TestMatrixErrors(t *testing.T) {
	t.Parallel()
	header := "kernel need archive suites packages datapath gate traffic\n"
	row := func(fields string) string { return header + fields + "\n" }
	for _, c := range []struct{ name, text, want string }{
		{"no header", "# only a comment\n", "no header"},
		{"wrong suites", "kernel need archive suites packages datapath traffic\n", "suite columns"},
		{"short row", row("6.1 required debian bookworm linux-image-6.1.0-*-amd64 pass pass"), "line 2: 7 columns"},
		{"bad need", row("6.1 maybe debian bookworm linux-image-6.1.0-*-amd64 pass pass pass"), `need "maybe"`},
		{"bad archive", row("6.1 required fedora f40 kernel-* pass pass pass"), `archive "fedora"`},
		{"no star", row("6.1 required debian bookworm linux-image-6.1.0-57-amd64 pass pass pass"), "exactly one *"},
		{"bad outcome", row("6.1 required debian bookworm linux-image-6.1.0-*-amd64 pass maybe pass"), `gate: "maybe"`},
		{"twice", row("6.1 required debian bookworm linux-image-6.1.0-*-amd64 pass pass pass") +
			"6.1 optional debian bookworm linux-image-6.1.0-*-amd64 pass pass pass\n", "listed twice"},
		{"none required", row("6.1 optional debian bookworm linux-image-6.1.0-*-amd64 pass pass pass"), "no required kernel"},
	} {
		_, err := ParseMatrix(c.text, Suites)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: error %v, want one containing %q", c.name, err, c.want)
		}
	}
}

func TestSkipsParse(t *testing.T) {
	t.Parallel()
	matrix := "kernel need archive suites packages datapath gate traffic\n" +
		"6.1 required debian bookworm linux-image-6.1.0-*-amd64 pass pass pass\n" +
		"6.12 optional debian bookworm linux-image-6.12.*+deb12-amd64 pass pass pass\n"
	load := func(skips string) (*Matrix, error) {
		m, err := ParseMatrix(matrix, Suites)
		if err != nil {
			t.Fatal(err)
		}
		return m, m.ParseSkips(skips, Suites)
	}
	m, err := load("# why\n* datapath TestHelper a helper\n6.12 gate TestOld needs widgets, in 7.0\n")
	if err != nil {
		t.Fatal(err)
	}
	if got := m.Kernels[0].Skips; len(got) != 1 || got["datapath"]["TestHelper"] != "a helper" {
		t.Errorf("6.1's skips %v", got)
	}
	if got := m.Kernels[1].Skips; len(got) != 2 || got["gate"]["TestOld"] != "needs widgets, in 7.0" {
		t.Errorf("6.12's skips %v", got)
	}
	for _, c := range []struct{ name, text, want string }{
		{"no why", "6.1 datapath TestA\n", "line 1: 3 fields"},
		{"unknown kernel", "5.4 datapath TestA why\n", `kernel "5.4"`},
		{"unknown suite", "6.1 fast TestA why\n", `suite "fast"`},
		{"not a test", "6.1 datapath TestA/sub why\n", `"TestA/sub"`},
		{"twice", "* datapath TestA why\n\n6.12 datapath TestA why\n", "line 3: datapath TestA is listed twice for kernel 6.12"},
	} {
		if _, err := load(c.text); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: error %v, want one containing %q", c.name, err, c.want)
		}
	}
	if err := checkSkips(m.Kernels, map[string][]string{"datapath": {"TestHelper"}, "gate": {"TestNew"}}); err == nil || !strings.Contains(err.Error(), "TestOld") {
		t.Errorf("a skip of a test the suite does not run: %v", err)
	}
}

// TestSkipsNameTests holds every test skips.txt expects to skip to one its
// suite's package has, so a renamed test does not leave its line behind (the
// run checks it against the test binaries too).
func TestSkipsNameTests(t *testing.T) {
	t.Parallel()
	m, err := LoadMatrix()
	if err != nil {
		t.Fatal(err)
	}
	root, err := ModuleRoot(t.Context(), ".")
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range m.Kernels {
		for _, s := range Suites {
			for test := range k.Skips[s.Name] {
				if len(s.Tests) > 0 && !slices.Contains(s.Tests, test) {
					t.Errorf("%s: %s is expected to skip in %s, which does not run it", k.Name, test, s.Name)
					continue
				}
				files, err := filepath.Glob(filepath.Join(root, s.Package, "*_test.go"))
				if err != nil {
					t.Fatal(err)
				}
				found := false
				for _, f := range files {
					b, err := os.ReadFile(f)
					if err != nil {
						t.Fatal(err)
					}
					found = found || bytes.Contains(b, []byte("\nfunc "+test+"(t *testing.T)"))
				}
				if !found {
					t.Errorf("%s: %s is expected to skip in %s, and %s has no such test", k.Name, test, s.Name, s.Package)
				}
			}
		}
	}
}

func TestPatternPicksTheBuild(t *testing.T) {
	t.Parallel()
	re := pattern("linux-image-6.1.0-*-amd64-unsigned")
	for name, want := range map[string]string{
		"linux-image-6.1.0-57-amd64-unsigned":       "57",
		"linux-image-6.1.0-57-cloud-amd64-unsigned": "",
		"linux-image-6.1.0-57-rt-amd64-unsigned":    "",
		"linux-image-6.1.0-57-amd64-unsigned-dbg":   "",
	} {
		got := ""
		if m := re.FindStringSubmatch(name); m != nil {
			got = m[1]
		}
		if got != want {
			t.Errorf("%s: build %q, want %q", name, got, want)
		}
	}
	for _, want := range [][]string{
		{"9", "10", "57"},
		{"6.12.9+deb12", "6.12.117+deb12"},
		{"7.2.13+deb14", "7.10.1+deb14", "7.10.1+deb15"},
	} {
		builds := slices.Clone(want)
		slices.Reverse(builds)
		slices.SortFunc(builds, naturalCompare)
		if !slices.Equal(builds, want) {
			t.Errorf("sorted %v, want %v", builds, want)
		}
	}
}

func TestParseTestLog(t *testing.T) {
	t.Parallel()
	out := []byte(`=== RUN   TestA
=== PAUSE TestA
=== RUN   TestB
=== RUN   TestB/sub
    b_test.go:9: the subtest's own words
    --- FAIL: TestB/sub (0.00s)
--- FAIL: TestB (0.01s)
=== RUN   TestC
=== PAUSE TestC
=== CONT  TestA
    a_test.go:3: first
=== NAME  TestC
    c_test.go:7: needs widgets, in Linux 9.9 and later
        and a second line
=== NAME  TestA
    a_test.go:4: last
    logger.go:146: INFO a cleanup logged
--- PASS: TestA (1.20s)
--- SKIP: TestC (0.00s)
panic: test timed out after 10m0s
`)
	got := parseTestLog(out)
	want := map[string]testVerdict{
		"TestA": {"PASS", "a_test.go:4: last"},
		"TestB": {"FAIL", ""},
		"TestC": {"SKIP", "c_test.go:7: needs widgets, in Linux 9.9 and later"},
	}
	if len(got) != len(want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s: %q, want %q", k, got[k], v)
		}
	}
}

func TestSuiteOutcome(t *testing.T) {
	t.Parallel()
	s := Suite{Name: "x"}
	expectB := map[string]string{"TestB": "TestB needs widgets"}
	for _, c := range []struct {
		name, log         string
		skips             map[string]string
		exit              int
		want              Outcome
		missing           int
		unexpected, stale []string
	}{
		{"all pass", "--- PASS: TestA (0.1s)\n--- PASS: TestB (0.1s)\n", nil, 0, Pass, 0, nil, nil},
		{"one fails", "--- PASS: TestA (0.1s)\n--- FAIL: TestB (0.1s)\n", nil, 1, Fail, 0, nil, nil},
		{"a skip is not a pass", "--- PASS: TestA (0.1s)\n--- SKIP: TestB (0.1s)\n", nil, 0, Fail, 0, []string{"TestB"}, nil},
		{"a skip the kernel is expected to make", "--- PASS: TestA (0.1s)\n--- SKIP: TestB (0.1s)\n", expectB, 0, Pass, 0, nil, nil},
		{"a skip of another test than expected", "--- SKIP: TestA (0.1s)\n--- SKIP: TestB (0.1s)\n", expectB, 0, Fail, 0, []string{"TestA"}, nil},
		{"an expected skip that passed", "--- PASS: TestA (0.1s)\n--- PASS: TestB (0.1s)\n", expectB, 0, Pass, 0, nil, []string{"TestB"}},
		{"an expected skip that failed", "--- PASS: TestA (0.1s)\n--- FAIL: TestB (0.1s)\n", expectB, 1, Fail, 0, nil, nil},
		{"crashed midway", "--- PASS: TestA (0.1s)\npanic: boom\n", nil, 2, Fail, 1, nil, nil},
		{"passes but exits non-zero (a leak)", "--- PASS: TestA (0.1s)\n--- PASS: TestB (0.1s)\n", nil, 1, Fail, 0, nil, nil},
	} {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, "x.log"), []byte(c.log), 0o644); err != nil {
			t.Fatal(err)
		}
		exit, _ := json.Marshal(suiteExit{ExitCode: c.exit})
		if err := os.WriteFile(filepath.Join(dir, "x.json"), exit, 0o644); err != nil {
			t.Fatal(err)
		}
		r, err := readSuiteResult(dir, s, []string{"TestA", "TestB"}, c.skips, nil)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if r.Outcome != c.want || r.Missing != c.missing {
			t.Errorf("%s: %s with %d missing, want %s with %d", c.name, r.Outcome, r.Missing, c.want, c.missing)
		}
		if !slices.Equal(r.UnexpectedSkips, c.unexpected) || !slices.Equal(r.StaleSkips, c.stale) {
			t.Errorf("%s: unexpected skips %v, stale %v; want %v, %v", c.name, r.UnexpectedSkips, r.StaleSkips, c.unexpected, c.stale)
		}
		for _, u := range c.unexpected {
			if !strings.Contains(r.Note, u+" skipped") {
				t.Errorf("%s: note %q does not name %s", c.name, r.Note, u)
			}
		}
	}
	// A suite the guest never started is an error of the run, not a result.
	if r, err := readSuiteResult(t.TempDir(), s, []string{"TestA"}, nil, nil); r.Outcome != Fail || err == nil {
		t.Errorf("no log: %+v, %v; want a failure and an error", r, err)
	}
	// One the kernel died in is the suite's failure, with what the kernel said.
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "x.log"), []byte("--- PASS: TestA (0.1s)\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	console := "[   44.7] watchdog: BUG: soft lockup - CPU#0 stuck for 61s! [x.test:140]\n[   45.0] Kernel panic - not syncing: softlockup: hung tasks\n"
	if err := os.WriteFile(filepath.Join(dir, "x.console.log"), []byte(console), 0o644); err != nil {
		t.Fatal(err)
	}
	r, err := readSuiteResult(dir, s, []string{"TestA", "TestB"}, nil, nil)
	if err != nil || r.Outcome != Fail || r.Missing != 1 || !strings.Contains(r.Note, "soft lockup") {
		t.Errorf("kernel died: %+v, %v; want a failure naming the soft lockup", r, err)
	}
}

func TestDeviationsBothWays(t *testing.T) {
	t.Parallel()
	k := Kernel{Name: "6.1", Required: true, Expect: map[string]Outcome{"datapath": Fail, "gate": Pass}}
	r := &KernelResult{Kernel: k, Suites: []SuiteResult{{Suite: "datapath", Outcome: Fail}, {Suite: "gate", Outcome: Pass}}}
	if d := r.Deviations(); len(d) != 0 {
		t.Errorf("as expected, got deviations %v", d)
	}
	r.Suites[0].Outcome = Pass // fixed without the matrix being updated
	r.Suites[1].Outcome = Fail // a regression
	if d := r.Deviations(); len(d) != 2 {
		t.Errorf("an unexpected pass and an unexpected failure, got %v", d)
	}
	var out bytes.Buffer
	if code := Summarize(&out, []*KernelResult{r}); code != 1 || !strings.Contains(out.String(), "1 unexpected (6.1)") {
		t.Errorf("exit %d, %q", code, out.String())
	}
	// An expected skip that passed is a deviation too, whatever the suite did.
	k.Skips = map[string]map[string]string{"gate": {"TestG": "needs widgets"}}
	stale := &KernelResult{Kernel: k, Suites: []SuiteResult{{Suite: "datapath", Outcome: Fail}, {Suite: "gate", Outcome: Pass, StaleSkips: []string{"TestG"}}}}
	if d := stale.Deviations(); len(d) != 1 || !strings.Contains(d[0], "TestG passed") || !strings.Contains(d[0], "needs widgets") {
		t.Errorf("an expected skip that passed: deviations %v", d)
	}
	if line := stale.Line(); !strings.Contains(line, "1 EXPECTED TO SKIP PASSED") {
		t.Errorf("line %q does not say an expected skip passed", line)
	}
	gone := &KernelResult{Kernel: k, Unavailable: true}
	if d := gone.Deviations(); len(d) != 1 {
		t.Errorf("a required kernel unavailable must deviate, got %v", d)
	}
	gone.Kernel.Required = false
	if code := Summarize(&out, []*KernelResult{gone}); code != 0 {
		t.Errorf("an optional kernel unavailable: exit %d, want 0", code)
	}
}

func TestLoadOrder(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	dep := `kernel/fs/9p/9p.ko.xz: kernel/net/9p/9pnet.ko.xz kernel/fs/netfs/netfs.ko.xz
kernel/net/9p/9pnet_virtio.ko.xz: kernel/net/9p/9pnet.ko.xz
kernel/net/9p/9pnet.ko.xz:
kernel/fs/netfs/netfs.ko.xz:
kernel/fs/overlayfs/overlay.ko.xz:
`
	if err := os.WriteFile(filepath.Join(dir, "modules.dep"), []byte(dep), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "modules.builtin"), []byte("kernel/drivers/virtio/virtio_pci.ko\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	ix, err := readModuleIndex(dir)
	if err != nil {
		t.Fatal(err)
	}
	order, err := ix.loadOrder(bootModules)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"9pnet", "9pnet_virtio", "netfs", "9p", "overlay"}; !slices.Equal(order, want) {
		t.Errorf("order %v, want %v", order, want)
	}
	if _, err := ix.loadOrder([]string{"veth"}); err == nil || !strings.Contains(err.Error(), "veth") {
		t.Errorf("a missing module: %v", err)
	}
}

// TestCPIO reads the archive back the way the kernel does: 110-byte headers,
// names and data each padded to four bytes.
func TestCPIO(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	w := newCPIO(&buf)
	w.dir("dev", 0o755)
	w.node("dev/console", unixCharDev|0o600, 5, 1)
	w.file("init", 0o755, []byte("hello"))
	if err := w.close(); err != nil {
		t.Fatal(err)
	}
	data := buf.Bytes()
	var names []string
	for len(data) > 0 {
		if len(data) < 110 || string(data[:6]) != "070701" {
			t.Fatalf("bad header at %d bytes from the end", len(data))
		}
		hex := func(i int) int {
			v, err := strconv.ParseUint(string(data[6+8*i:14+8*i]), 16, 32)
			if err != nil {
				t.Fatal(err)
			}
			return int(v)
		}
		size, namesize := hex(6), hex(11)
		name := string(data[110 : 110+namesize-1])
		names = append(names, name)
		if name == "init" && string(data[align4(110+namesize):align4(110+namesize)+size]) != "hello" {
			t.Error("init's data is not where the header says")
		}
		if name == "dev/console" && (hex(9) != 5 || hex(10) != 1) {
			t.Errorf("dev/console is %d:%d, want 5:1", hex(9), hex(10))
		}
		data = data[align4(align4(110+namesize)+size):]
	}
	if want := []string{"dev", "dev/console", "init", "TRAILER!!!"}; !slices.Equal(names, want) {
		t.Errorf("entries %v, want %v", names, want)
	}
}

func align4(n int) int { return (n + 3) &^ 3 }

func TestCheckShared(t *testing.T) {
	if err := checkShared("/work/mesh-cni", "/work/mesh-cni/bin"); err != nil {
		t.Errorf("a checkout in /work: %v", err)
	}
	for _, d := range []string{"/tmp/mesh-cni", "/run/user/0/src", "/tmp"} {
		if err := checkShared("/work/mesh-cni", d); err == nil || !strings.Contains(err.Error(), d) {
			t.Errorf("checkShared(%q) = %v, want an error naming it", d, err)
		}
	}
	if err := checkShared("/tmpfoo/mesh-cni"); err != nil {
		t.Errorf("/tmpfoo is not /tmp: %v", err)
	}
}
