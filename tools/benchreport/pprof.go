package benchreport

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/google/pprof/profile"

	"github.com/mesh-cni/mesh-cni/test/bench/results"
)

// topN is how many functions a profile's table lists.
const topN = 15

// machinePrefix starts the names of machine profiles (perf, every CPU), as
// opposed to one Go process's.
const machinePrefix = "machine-"

// funcCost is one function's share of a CPU profile.
type funcCost struct {
	name        string
	flat, cum   int64 // in the profile's value unit (CPU nanoseconds)
	flatP, cumP float64
}

// topFunctions returns the functions with the most cumulative CPU time (the
// time in them and everything they called), the total, and the profile's
// duration in seconds.
func topFunctions(path string, n int) ([]funcCost, int64, float64, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, 0, 0, fmt.Errorf("open profile: %w", err)
	}
	defer f.Close()
	prof, err := profile.Parse(f)
	if err != nil {
		return nil, 0, 0, fmt.Errorf("parse profile %s: %w", path, err)
	}
	// The CPU time column: "cpu/nanoseconds" in Go's CPU profiles, else the last.
	vi := len(prof.SampleType) - 1
	for i, st := range prof.SampleType {
		if st.Type == "cpu" {
			vi = i
		}
	}
	if vi < 0 {
		return nil, 0, 0, fmt.Errorf("profile %s has no sample types", path)
	}
	flat, cum := map[string]int64{}, map[string]int64{}
	var total int64
	for _, s := range prof.Sample {
		if vi >= len(s.Value) {
			continue
		}
		v := s.Value[vi]
		total += v
		seen := map[string]bool{}
		leaf := true
		for _, loc := range s.Location {
			// Inlined frames come first in a location's lines; the leaf is
			// the first line of the first location.
			for _, line := range loc.Line {
				if line.Function == nil {
					continue
				}
				name := line.Function.Name
				if leaf {
					flat[name] += v
					leaf = false
				}
				if !seen[name] {
					seen[name] = true
					cum[name] += v
				}
			}
		}
	}
	var out []funcCost
	for name, c := range cum {
		out = append(out, funcCost{name: name, flat: flat[name], cum: c})
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].cum != out[j].cum {
			return out[i].cum > out[j].cum
		}
		return out[i].name < out[j].name
	})
	if total > 0 {
		for i := range out {
			out[i].flatP = 100 * float64(out[i].flat) / float64(total)
			out[i].cumP = 100 * float64(out[i].cum) / float64(total)
		}
	}
	dur := float64(prof.DurationNanos) / 1e9
	if len(out) > n {
		out = out[:n]
	}
	return out, total, dur, nil
}

// interesting drops the runtime's and the standard library's scheduling frames
// that top every cumulative list (main, goexit, ...) without saying anything,
// and the kernel's system call entry, under every system call of a machine
// profile.
func interesting(name string) bool {
	for _, boring := range []string{"runtime.goexit", "runtime.goexit.abi0", "runtime.main", "main.main", "runtime.mcall", "runtime.systemstack",
		"entry_SYSCALL_64_after_hwframe", "do_syscall_64", "x64_sys_call"} {
		if name == boring {
			return false
		}
	}
	return true
}

// writeProfilesGuide explains the profile tables of every section, once.
func writeProfilesGuide(w *bytes.Buffer, rs []*results.Result) {
	any, machine := false, false
	for _, r := range rs {
		for _, p := range r.Profiles {
			any = true
			machine = machine || strings.HasPrefix(p.Name, machinePrefix)
		}
	}
	if !any {
		return
	}
	fmt.Fprintf(w, "The sections' **CPU profiles** list the functions with the most CPU time, including what they call (cum), and in themselves (flat), "+
		"as shares of the profile's samples. The profiles are in `%s/profiles/`; open one with the command given.\n\n", results.DefaultOut)
	if machine {
		fmt.Fprintf(w, "Machine profiles (`%s…`) are perf's cpu-clock samples of every CPU, with each process's name as the root of its stacks. "+
			"Without hardware counters (as in a VM) a sample due while interrupts were off is taken where they are turned on again, "+
			"so `_raw_spin_unlock_irqrestore` and `finish_task_switch` stand for work done just before them.\n\n", machinePrefix)
	}
}

// writeProfiles writes a table per profile of r; writeProfilesGuide says how
// to read them.
func writeProfiles(w *bytes.Buffer, r *results.Result, dir string) {
	fmt.Fprintf(w, "### CPU profiles\n\n")
	for _, p := range r.Profiles {
		path := filepath.Join(dir, p.File)
		top, total, dur, err := topFunctions(path, topN+5)
		if err != nil {
			fmt.Fprintf(w, "**%s**: %v\n\n", p.Title, err)
			continue
		}
		perOp := ""
		if p.Operations > 0 {
			perOp = fmt.Sprintf(" (%s ms per %s)", num(float64(total)/1e6/float64(p.Operations)), p.Operation)
		}
		fmt.Fprintf(w, "**%s** — %.0f ms of CPU%s in %.1f s; `%s`\n\n", p.Title, float64(total)/1e6, perOp, dur, p.Command)
		if total == 0 {
			fmt.Fprintf(w, "No samples.\n\n")
			continue
		}
		fmt.Fprintf(w, "| function | cum | flat |\n|---|--:|--:|\n")
		shown := 0
		for _, f := range top {
			if !interesting(f.name) || shown == topN {
				continue
			}
			shown++
			fmt.Fprintf(w, "| `%s` | %.1f%% | %.1f%% |\n", shortName(f.name), f.cumP, f.flatP)
		}
		fmt.Fprintln(w)
	}
}

// shortName trims the module path off a function name.
func shortName(name string) string {
	return strings.TrimPrefix(name, "github.com/mesh-cni/mesh-cni/")
}

// cumCPU is the CPU time (ns) of the samples of the profile at path whose
// stack contains a function named name (each sample counted once), and the
// profile's total; found reports whether any sample has it.
func cumCPU(path, name string) (cum, total int64, found bool, err error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, 0, false, fmt.Errorf("open profile: %w", err)
	}
	defer f.Close()
	prof, err := profile.Parse(f)
	if err != nil {
		return 0, 0, false, fmt.Errorf("parse profile %s: %w", path, err)
	}
	vi := len(prof.SampleType) - 1
	for i, st := range prof.SampleType {
		if st.Type == "cpu" {
			vi = i
		}
	}
	if vi < 0 {
		return 0, 0, false, fmt.Errorf("profile %s has no sample types", path)
	}
	for _, s := range prof.Sample {
		if vi >= len(s.Value) {
			continue
		}
		total += s.Value[vi]
		if stackHas(s, name) {
			cum += s.Value[vi]
			found = true
		}
	}
	return cum, total, found, nil
}

func stackHas(s *profile.Sample, name string) bool {
	for _, loc := range s.Location {
		for _, line := range loc.Line {
			if line.Function != nil && line.Function.Name == name {
				return true
			}
		}
	}
	return false
}
