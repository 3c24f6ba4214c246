package kernels

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"
)

// SuiteResult is one suite on one kernel.
type SuiteResult struct {
	Suite   string
	Outcome Outcome
	// Tests maps each of the suite's tests to PASS, FAIL, SKIP or "" when it
	// did not finish (the binary crashed, timed out, or never got to it).
	Tests                                   map[string]string
	Passed, Failed, Skipped, Missing, Total int
	// UnexpectedSkips are the skipped tests skips.txt does not list for this
	// kernel, each failing the suite; StaleSkips are those it lists that
	// passed instead, each a deviation of the row.
	UnexpectedSkips, StaleSkips []string
	// Note says why a suite without failed tests still failed, and what the
	// kernel said if it went wrong itself.
	Note    string
	Log     string
	Console string
	// Retried says why the suite had a second boot; the result is the
	// second boot's.
	Retried string
}

// KernelResult is one row's run.
type KernelResult struct {
	Kernel Kernel
	// Unavailable is set when an optional kernel's archive could not be
	// reached; nothing ran.
	Unavailable bool
	// Err stopped the row before or while its VM ran.
	Err      error
	Unpacked *Unpacked
	Suites   []SuiteResult
	Modules  []string
	Dir      string
	Duration time.Duration
}

// Deviations lists what differs from the matrix; none means the row is as
// expected.
func (r *KernelResult) Deviations() []string {
	if r.Unavailable {
		if r.Kernel.Required {
			return []string{"required kernel unavailable"}
		}
		return nil
	}
	if r.Err != nil {
		return strings.Split(r.Err.Error(), "\n")
	}
	var out []string
	for _, s := range r.Suites {
		if want := r.Kernel.Expect[s.Suite]; s.Outcome != want {
			out = append(out, fmt.Sprintf("%s %s, the matrix says %s", s.Suite, s.Outcome, want))
		}
		for _, t := range s.StaleSkips {
			out = append(out, fmt.Sprintf("%s: %s passed, where tools/kernels/skips.txt expects it to skip (%s): the kernel has what it needs, drop the line",
				s.Suite, t, r.Kernel.Skips[s.Suite][t]))
		}
	}
	return out
}

// Line is the row's summary line.
func (r *KernelResult) Line() string {
	name := fmt.Sprintf("%-6s", r.Kernel.Name)
	if r.Unavailable {
		return fmt.Sprintf("%s unavailable (%s %s not reachable)", name, r.Kernel.Archive, strings.Join(r.Kernel.Suites, ","))
	}
	var b strings.Builder
	b.WriteString(name)
	if u := r.Unpacked; u != nil {
		fmt.Fprintf(&b, " %s (%s)", u.Release, u.Version)
	}
	if r.Err != nil {
		fmt.Fprintf(&b, " ERROR: %s", strings.ReplaceAll(r.Err.Error(), "\n", "; "))
	}
	for _, s := range r.Suites {
		mark := "as expected"
		if s.Outcome != r.Kernel.Expect[s.Suite] {
			mark = "UNEXPECTED"
		}
		var skips []string
		if n := s.Skipped - len(s.UnexpectedSkips); n > 0 {
			skips = append(skips, fmt.Sprintf("%d skipped as expected", n))
		}
		if n := len(s.UnexpectedSkips); n > 0 {
			skips = append(skips, fmt.Sprintf("%d SKIPPED UNEXPECTEDLY", n))
		}
		if n := len(s.StaleSkips); n > 0 {
			skips = append(skips, fmt.Sprintf("%d EXPECTED TO SKIP PASSED", n))
		}
		skipped := ""
		if len(skips) > 0 {
			skipped = " (" + strings.Join(skips, ", ") + ")"
		}
		if s.Retried != "" {
			mark += " on a second boot"
		}
		fmt.Fprintf(&b, "  %s %s %d/%d%s %s", s.Suite, s.Outcome, s.Passed, s.Total, skipped, mark)
	}
	fmt.Fprintf(&b, "  %.0fs", r.Duration.Seconds())
	return b.String()
}

// In -test.v output: the verdict line of a top-level test (subtests' are
// indented), the line naming the test whose output follows, and a line a
// top-level test logged from its test file (a subtest's are indented further;
// a logger's, such as zaptest's, name the logger's file).
var (
	topLevel = regexp.MustCompile(`^--- (PASS|FAIL|SKIP): (Test[^ /]*) \(`)
	testTurn = regexp.MustCompile(`^=== (?:RUN|CONT|NAME|PAUSE) +(\S+)`)
	ownLine  = regexp.MustCompile(`^    (\S+_test\.go:\d+: .*)`)
)

// testVerdict is what a top-level test did, and the last line it logged from
// its test files (why it skipped, for a skip: cleanups may log after).
type testVerdict struct {
	Result, Said string
}

// parseTestLog reads the verdict of every top-level test in a test binary's
// -test.v output.
func parseTestLog(out []byte) map[string]testVerdict {
	got := map[string]testVerdict{}
	said := map[string]string{}
	current := ""
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(make([]byte, 0, 64*1024), 4*1024*1024)
	for sc.Scan() {
		line := sc.Text()
		if m := topLevel.FindStringSubmatch(line); m != nil {
			got[m[2]] = testVerdict{Result: m[1], Said: said[m[2]]}
			continue
		}
		if m := testTurn.FindStringSubmatch(line); m != nil {
			current = m[1]
			continue
		}
		if m := ownLine.FindStringSubmatch(line); m != nil && current != "" && !strings.Contains(current, "/") {
			said[current] = m[1]
		}
	}
	return got
}

// kernelTrouble are the console lines that say the kernel itself went wrong,
// the most telling first: the first kind that matches names the trouble.
var kernelTrouble = []*regexp.Regexp{
	regexp.MustCompile(`BUG: soft lockup`),
	regexp.MustCompile(`BUG:|Oops:`),
	regexp.MustCompile(`blocked for more than`),
	regexp.MustCompile(`Kernel panic`),
	regexp.MustCompile(`rcu: INFO: .*stall`),
	regexp.MustCompile(`WARNING: CPU`),
}

// readSuiteResult reads what one boot left for its suite: tests are the
// suite's tests, listed from its binary on the host; skips are those expected
// to skip on this kernel; vmErr is how QEMU ended. It returns an error only
// when the guest never started the suite, which no cell of the matrix can
// expect.
func readSuiteResult(dir string, s Suite, tests []string, skips map[string]string, vmErr error) (SuiteResult, error) {
	r := SuiteResult{Suite: s.Name, Outcome: Fail, Tests: map[string]string{}, Total: len(tests),
		Log: filepath.Join(dir, s.Name+".log"), Console: filepath.Join(dir, s.Name+".console.log")}
	console, _ := os.ReadFile(r.Console)
	var notes []string
	for _, re := range kernelTrouble {
		if line := firstMatch(console, re); line != "" {
			notes = append(notes, "kernel: "+line)
			break
		}
	}
	out, err := os.ReadFile(r.Log)
	if err != nil {
		r.Missing = len(tests)
		r.Note = "did not run"
		why := firstMatch(console, regexp.MustCompile(`guest: FAILED: `))
		if why == "" && vmErr != nil {
			why = vmErr.Error()
		}
		return r, fmt.Errorf("the guest did not run the suite: %s (see %s)", strings.Join(append([]string{why}, notes...), "; "), r.Console)
	}
	got := parseTestLog(out)
	for _, t := range tests {
		v := got[t]
		r.Tests[t] = v.Result
		_, expected := skips[t]
		switch v.Result {
		case "PASS":
			r.Passed++
			if expected {
				r.StaleSkips = append(r.StaleSkips, t)
			}
		case "FAIL":
			r.Failed++
		case "SKIP":
			r.Skipped++
			if !expected {
				r.UnexpectedSkips = append(r.UnexpectedSkips, t)
				notes = append(notes, fmt.Sprintf("%s skipped, which tools/kernels/skips.txt does not expect on this kernel: %s", t, v.Said))
			}
		default:
			r.Missing++
		}
	}
	var exit suiteExit
	data, err := os.ReadFile(filepath.Join(dir, s.Name+".json"))
	if err == nil {
		err = json.Unmarshal(data, &exit)
	}
	switch {
	case err != nil:
		// The guest started the suite and never recorded its end: the kernel
		// died or hung under it.
		why := "the guest did not finish the suite"
		if vmErr != nil {
			why += " (" + vmErr.Error() + ")"
		}
		notes = append([]string{why}, notes...)
	case exit.Error != "":
		notes = append([]string{exit.Error}, notes...)
	case exit.ExitCode != 0:
		notes = append([]string{fmt.Sprintf("exit %d", exit.ExitCode)}, notes...)
	}
	r.Note = strings.Join(notes, "; ")
	// A pass is every test passed or skipped as skips.txt expects, none
	// failing, unfinished or skipping otherwise (a skip is not a pass), and a
	// clean exit (the harness fails an exit that leaked).
	if r.Passed+r.Skipped-len(r.UnexpectedSkips) == r.Total && err == nil && exit.ExitCode == 0 && exit.Error == "" {
		r.Outcome = Pass
	}
	return r, nil
}

// firstMatch is the first line of out that re matches, trimmed.
func firstMatch(out []byte, re *regexp.Regexp) string {
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(make([]byte, 0, 64*1024), 4*1024*1024)
	for sc.Scan() {
		if re.MatchString(sc.Text()) {
			return strings.TrimSpace(sc.Text())
		}
	}
	return ""
}

// writeTests writes every test's verdict on this kernel to tests.txt in the
// results, the precise record behind each cell of the matrix.
func (r *KernelResult) writeTests() error {
	var b strings.Builder
	fmt.Fprintf(&b, "# %s\n", r.Line())
	for _, s := range r.Suites {
		fmt.Fprintf(&b, "\n%s: %s, %d passed, %d failed, %d skipped (%d unexpectedly), %d did not finish", s.Suite, s.Outcome, s.Passed, s.Failed, s.Skipped, len(s.UnexpectedSkips), s.Missing)
		if s.Note != "" {
			fmt.Fprintf(&b, " (%s)", s.Note)
		}
		if s.Retried != "" {
			fmt.Fprintf(&b, "; second boot: %s", s.Retried)
		}
		b.WriteString("\n")
		names := make([]string, 0, len(s.Tests))
		for t := range s.Tests {
			names = append(names, t)
		}
		slices.Sort(names)
		for _, t := range names {
			v := s.Tests[t]
			if v == "" {
				v = "DID NOT FINISH"
			}
			why, expected := r.Kernel.Skips[s.Suite][t]
			switch {
			case v == "SKIP" && expected:
				t += " (expected: " + why + ")"
			case v == "SKIP":
				t += " (UNEXPECTED: tools/kernels/skips.txt does not list it)"
			case expected:
				t += " (tools/kernels/skips.txt expects a skip: " + why + ")"
			}
			fmt.Fprintf(&b, "  %-4s %s\n", v, t)
		}
	}
	if len(r.Modules) > 0 {
		fmt.Fprintf(&b, "\nmodules loaded: %s\n", strings.Join(r.Modules, " "))
	}
	return os.WriteFile(filepath.Join(r.Dir, "tests.txt"), []byte(b.String()), 0o644)
}

// readGuestReport reads what the guest recorded of itself in a boot.
func readGuestReport(dir, suite string) (*guestReport, error) {
	return readJSON[guestReport](filepath.Join(dir, suite+".guest.json"))
}

// readJSON reads the JSON file at path, a T. A file that is not there is an
// error os.ReadFile's (fs.ErrNotExist); one that does not decode names path.
func readJSON[T any](path string) (*T, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var v T
	if err := json.Unmarshal(data, &v); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return &v, nil
}

// Summarize prints the closing line and returns the exit code: 0 when every
// row is as the matrix says, 1 otherwise.
func Summarize(w io.Writer, results []*KernelResult) int {
	var expected, unexpected, unavailable []string
	for _, r := range results {
		switch {
		case len(r.Deviations()) > 0:
			unexpected = append(unexpected, r.Kernel.Name)
		case r.Unavailable:
			unavailable = append(unavailable, r.Kernel.Name)
		default:
			expected = append(expected, r.Kernel.Name)
		}
	}
	list := func(names []string) string {
		if len(names) == 0 {
			return ""
		}
		return " (" + strings.Join(names, ", ") + ")"
	}
	fmt.Fprintf(w, "kernels: %d as the matrix says%s, %d unexpected%s, %d unavailable%s\n",
		len(expected), list(expected), len(unexpected), list(unexpected), len(unavailable), list(unavailable))
	if len(unexpected) > 0 {
		fmt.Fprintln(w, "kernels: FAIL: a result differs from tools/kernels/matrix.txt; fix the regression, or update the matrix (and docs/compatibility.md) if the change is intended")
		return 1
	}
	return 0
}
