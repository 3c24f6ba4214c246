package benchreport

import (
	"bytes"
	"fmt"
	"math"
	"path/filepath"
	"slices"
	"strings"

	"github.com/mesh-cni/mesh-cni/test/bench/results"
)

// status of a target.
type status int

const (
	notMeasured status = iota
	met
	missed
)

func (s status) String() string {
	switch s {
	case met:
		return "✅ met"
	case missed:
		return "❌ missed"
	default:
		return "— not measured"
	}
}

func check(ok bool) status {
	if ok {
		return met
	}
	return missed
}

// target is one goal, checked against this run's numbers.
type target struct {
	goal     string
	measured string
	status   status
	// limits says what holds the number where it is (shown when missed).
	limits string
	// perConn: limits rest on the eBPF programs' run time per connection,
	// which the report states once, after the list.
	perConn bool
}

// data looks up results by benchmark and metric name.
type data struct {
	byName map[string]*results.Result
	dir    string // the results directory, where the profiles are
}

func (d data) metric(result, metric string) *results.Metric {
	if r := d.byName[result]; r != nil {
		return r.Metric(metric)
	}
	return nil
}

func (d data) series(result, metric, variant string, x float64) *results.Series {
	if m := d.metric(result, metric); m != nil {
		return m.Find(variant, x)
	}
	return nil
}

func samplesOf(s *results.Series) []float64 {
	if s == nil {
		return nil
	}
	return s.Samples
}

func med(s *results.Series) float64 { return results.Median(samplesOf(s)) }

func p99(s *results.Series) float64 { return results.Quantile(samplesOf(s), 0.99) }

func maxOf(s *results.Series) float64 {
	if s == nil || len(s.Samples) == 0 {
		return math.NaN()
	}
	return slices.Max(s.Samples)
}

func ok(v ...float64) bool {
	for _, x := range v {
		if math.IsNaN(x) {
			return false
		}
	}
	return true
}

func writeTargets(w *bytes.Buffer, rs []*results.Result, dir string) {
	d := data{byName: map[string]*results.Result{}, dir: dir}
	for _, r := range rs {
		d.byName[r.Name] = r
	}
	core := []target{
		addOverhead(d), concurrentTail(d), gateRelease(d),
		enrollRelease(d), enrollVsIPTables(d),
		connRateVsLimit(d), connRateVsInPod(d, "iptables", "iptables REDIRECT"),
		connRateVsInPod(d, "istio-cni", "istio-cni's in-pod rules"), requestVsIstio(d), throughputVsLimit(d),
		enrollScaling(d), agentMemory(d), restartReady(d),
	}
	all := core
	// A section's own targets are in the table, but what bounds them is said
	// once, in their section.
	var elsewhere []string
	for _, name := range sectionOrder {
		fn := sectionTargets(name)
		if fn == nil {
			continue
		}
		ts := fn(d)
		all = append(all, ts...)
		if r := d.byName[name]; r != nil && slices.ContainsFunc(ts, func(t target) bool { return t.status == missed && t.limits != "" }) {
			elsewhere = append(elsewhere, fmt.Sprintf("- **%s** — in [its section](#%s), below its own targets.\n", r.Title, anchor(r.Title)))
		}
	}
	fmt.Fprintf(w, "## Targets\n\n")
	fmt.Fprintf(w, "Each target checked against this run; ratios are between variants measured side by side in the same run. "+
		"The thresholds are the targets' own; every other number below comes from this run's samples.\n\n")
	writeTargetTable(w, all)
	bounds := boundsOf(core)
	if len(bounds)+len(elsewhere) == 0 {
		return
	}
	fmt.Fprintf(w, "### What bounds the missed targets\n\n")
	fmt.Fprintf(w, "Each benchmark's load while it ran, which inflates absolute times, is in the table at the top.\n\n")
	fmt.Fprintf(w, "%s%s\n", strings.Join(bounds, ""), strings.Join(elsewhere, ""))
	if s := bpfPerConn(d); s != "" && slices.ContainsFunc(core, func(t target) bool { return t.status == missed && t.perConn }) {
		fmt.Fprintf(w, "### The eBPF programs' run time per connection\n\n%s\n\n", s)
	}
	if s := join(pluginShare(d), agentEnrollCPU(d)); s != "" {
		fmt.Fprintf(w, "### Where a pod's ADD spends its time\n\n%s\n\n", s)
	}
}

// writeTargetTable writes one row per target.
func writeTargetTable(w *bytes.Buffer, ts []target) {
	fmt.Fprintf(w, "| target | measured | result |\n|---|---|---|\n")
	for _, t := range ts {
		fmt.Fprintf(w, "| %s | %s | %s |\n", t.goal, t.measured, t.status)
	}
	fmt.Fprintln(w)
}

// boundsOf is a list item per missed target that says what bounds it.
func boundsOf(ts []target) []string {
	var out []string
	for _, t := range ts {
		if t.status == missed && t.limits != "" {
			out = append(out, fmt.Sprintf("- **%s** — %s\n", t.goal, t.limits))
		}
	}
	return out
}

// Functions in the agent's profile whose CPU time the report breaks out.
const (
	fnServiceAdd  = "github.com/mesh-cni/mesh-cni/internal/agent.(*Service).Add"
	fnEnroll      = "github.com/mesh-cni/mesh-cni/internal/redirect.(*Datapath).Enroll"
	fnLookupLoad  = "github.com/mesh-cni/mesh-cni/internal/redirect.(*lookupTemplate).load"
	fnAttachNetNs = "github.com/cilium/ebpf/link.AttachNetNs"
	fnCollect     = "github.com/mesh-cni/mesh-cni/internal/redirect.(*Datapath).collectExisting"
	fnRelease     = "github.com/mesh-cni/mesh-cni/internal/redirect.(*Datapath).Release"
	fnStorePut    = "github.com/mesh-cni/mesh-cni/internal/podstore.(*Store).Put"
	fnNetnsDo     = "github.com/mesh-cni/mesh-cni/internal/netns.DoFd.func1"
	// The plugin's gate client's reconnect back-off (pkg/gate/gateclient
	// BackoffMax and BackoffJitter), constants the report cites.
	reconnectCapMs     = 50
	reconnectJitterPct = 20
)

// profileOf returns the named profile, of whichever benchmark wrote it
// (profile names are unique across them).
func (d data) profileOf(name string) (results.Profile, bool) {
	for _, r := range d.byName {
		for _, p := range r.Profiles {
			if p.Name == name {
				return p, true
			}
		}
	}
	return results.Profile{}, false
}

// fnCPU is the CPU time per operation (ms) the named profile spent in fn and
// everything it called, and that as a share (%) of the whole profile.
func fnCPU(d data, prof, fn string) (perOp, share float64) {
	p, found := d.profileOf(prof)
	if !found || p.Operations <= 0 {
		return math.NaN(), math.NaN()
	}
	cum, total, found, err := cumCPU(filepath.Join(d.dir, p.File), fn)
	if err != nil || total == 0 || !found {
		return math.NaN(), math.NaN()
	}
	return float64(cum) / 1e6 / float64(p.Operations), 100 * float64(cum) / float64(total)
}

// single is a one-sample series' value.
func single(s *results.Series) float64 {
	if s == nil || len(s.Samples) != 1 {
		return math.NaN()
	}
	return s.Samples[0]
}

// sentence returns format applied to args when every argument is known: no
// float that is not a number, no number num could not format ("—").
func sentence(format string, args ...any) string {
	for _, a := range args {
		switch v := a.(type) {
		case float64:
			if !ok(v) {
				return ""
			}
		case string:
			if v == num(math.NaN()) {
				return ""
			}
		}
	}
	return fmt.Sprintf(format, args...)
}

func join(parts ...string) string {
	var out []string
	for _, p := range parts {
		if p != "" {
			out = append(out, p)
		}
	}
	return strings.Join(out, " ")
}

// pluginShare describes the plugin's own share of an ADD from the plugin
// benchmark: its start against the no-op plugin's, and its whole ADD step.
func pluginShare(d data) string {
	v := func(metric, variant string) float64 { return med(d.series("plugin", metric, variant, 0)) }
	sz := func(variant string) float64 { return single(d.series("plugin", "binary-size", variant, 0)) }
	return join(
		sentence("The plugin's ADD step alone (exec → exit, the bridge's result as prevResult) takes a median %s ms against an agent without a data path and %s ms against the eBPF agent, where the no-op `tuning` takes %s ms (CPU time of the process: %s, %s and %s ms).",
			num(v("plugin-add", "mesh-gate")), num(v("plugin-add", "mesh")), num(v("plugin-add", "tuning")),
			num(v("plugin-add-cpu", "mesh-gate")), num(v("plugin-add-cpu", "mesh")), num(v("plugin-add-cpu", "tuning"))),
		sentence("Of that, merely starting it (CNI VERSION) takes %s ms against %s ms for `tuning` (CPU %s vs %s ms); the binary is %s MiB against %s MiB, and the Go runtime reports %s ms of package initialization per start against %s ms (%s vs %s packages with init work).",
			num(v("exec-version", "mesh-cni")), num(v("exec-version", "tuning")),
			num(v("exec-version-cpu", "mesh-cni")), num(v("exec-version-cpu", "tuning")),
			num(sz("mesh-cni")), num(sz("tuning")),
			num(v("init-total", "mesh-cni")), num(v("init-total", "tuning")),
			num(v("init-packages", "mesh-cni")), num(v("init-packages", "tuning"))),
	)
}

// profileTotal is the named profile's whole CPU per operation (ms).
func profileTotal(d data, prof string) float64 {
	p, found := d.profileOf(prof)
	if !found || p.Operations <= 0 {
		return math.NaN()
	}
	_, total, _, err := cumCPU(filepath.Join(d.dir, p.File), "")
	if err != nil || total == 0 {
		return math.NaN()
	}
	return float64(total) / 1e6 / float64(p.Operations)
}

// agentEnrollCPU describes where the agent's CPU per ADD goes, from its profile.
func agentEnrollCPU(d data) string {
	add, _ := fnCPU(d, "agent-add", fnServiceAdd)
	load, loadShare := fnCPU(d, "agent-add", fnLookupLoad)
	if !ok(add) {
		return ""
	}
	s := fmt.Sprintf("By the agent's CPU profile, answering one gate Add costs %s ms of CPU", num(add))
	if ok(load) {
		s += fmt.Sprintf(", of which loading the pod's sk_lookup program (`internal/redirect` `lookupTemplate.load`: the BPF_PROG_LOAD system call, i.e. the kernel's verifier and JIT, "+
			"which the profiler counts as the thread's CPU time) is %s ms (%.0f%% of the Add; %.0f%% of all the agent's CPU in the profiled run, start-up and DELs included)", num(load), 100*load/add, loadShare)
	}
	var parts []string
	for _, p := range []struct{ fn, what string }{
		{fnAttachNetNs, "attaching it to the netns"},
		{fnCollect, "taking over listeners opened before enrollment"},
		{fnStorePut, "writing the pod's record"},
	} {
		if v, _ := fnCPU(d, "agent-add", p.fn); ok(v) {
			parts = append(parts, fmt.Sprintf("%s %s ms", p.what, num(v)))
		}
	}
	if len(parts) > 0 {
		s += "; " + strings.Join(parts, ", ")
	}
	s += "."
	if v, _ := fnCPU(d, "agent-add", fnNetnsDo); ok(v) {
		s += fmt.Sprintf(" Visits to a pod's namespace run on a goroutine of their own (`internal/netns.DoFd`: reading the netns cookie, looking for a proxy that already listens), %s ms per ADD, not counted in the Add above.", num(v))
	}
	if rel, _ := fnCPU(d, "agent-add", fnRelease); ok(rel) {
		s += fmt.Sprintf(" A Release is %s ms per ADD's worth of DELs.", num(rel))
	}
	if all := profileTotal(d, "agent-add"); ok(all) {
		s += fmt.Sprintf(" In all the agent used %s ms of CPU per ADD in the profiled run (its gRPC serving, DELs, reconciles and start-up included).", num(all))
	}
	if v := single(d.series("profile", "bpf-verified-insns", "sk_lookup", 0)); ok(v) {
		s += fmt.Sprintf(" The verifier processes %s instructions for each pod's sk_lookup program, which is loaded anew for every pod because its netns cookie is built into it.", num(v))
	}
	if v := single(d.series("profile", "bpf-verified-insns", "sk_lookup_main", 0)); ok(v) {
		s += fmt.Sprintf(" The shared program it tail-calls (%s instructions verified) is loaded once, with the data path.", num(v))
	}
	return s
}

func addOverhead(d data) target {
	t, m := d.target("ADD overhead over the no-op chained plugin ≤ 1.5 ms (median, one pod at a time)", "chain-add", "add-sequential")
	if m == nil {
		return t
	}
	noop, mesh, gate := m.Find("noop", 0), m.Find("mesh", 0), m.Find("mesh-gate", 0)
	n, ms, g := med(noop), med(mesh), med(gate)
	if !ok(n, ms) {
		return t
	}
	// Two estimates of the overhead: the difference of the medians, and the
	// median of the per-iteration differences (the variants ran back to back,
	// so the load of the moment cancels). Under load they can disagree by
	// more than the target; the larger one decides.
	diff := ms - n
	worst := diff
	t.measured = fmt.Sprintf("+%s ms median ADD: %s ms [bridge, tuning] → %s ms [bridge, mesh-cni]", num(diff), num(n), num(ms))
	if pd, found := results.PairedDiff(mesh, noop); found {
		t.measured += fmt.Sprintf("; paired median difference +%s ms", num(pd))
		worst = math.Max(diff, pd)
	}
	t.status = check(worst <= 1.5)
	limits := fmt.Sprintf("+%s ms against 1.5 ms (the larger of the two estimates).", num(worst))
	if ok(g) {
		limits += fmt.Sprintf(" Split by the gate-only agent: the plugin's own share (`mesh-gate − noop`) is %s ms, the eBPF enrollment (`mesh − mesh-gate`) %s ms", num(g-n), num(ms-g))
		pg, okg := results.PairedDiff(gate, noop)
		pe, oke := results.PairedDiff(mesh, gate)
		if okg && oke {
			limits += fmt.Sprintf(" (paired medians over the iterations: %s ms and %s ms)", num(pg), num(pe))
		}
		limits += "."
	}
	if e, gg := med(d.series("chain-add", "agent-side", "mesh", 0)), med(d.series("chain-add", "agent-side", "mesh-gate", 0)); ok(e, gg) {
		limits += fmt.Sprintf(" By the agents' own logs a gate Add is answered in a median %s ms with the eBPF data path and %s ms without.", num(e), num(gg))
	}
	t.limits = join(limits, "The plugin's share and the agent's are broken down below.")
	return t
}

func concurrentTail(d data) target {
	t, m := d.target("16 concurrent ADDs: p99 ≤ 1.3× the no-op chain's", "chain-add", "add-concurrent-16")
	if m == nil {
		return t
	}
	n, ms, g := p99(m.Find("noop", 0)), p99(m.Find("mesh", 0)), p99(m.Find("mesh-gate", 0))
	if !ok(n, ms) {
		return t
	}
	t.measured = fmt.Sprintf("%.2f× (p99 %s ms [bridge, tuning] → %s ms [bridge, mesh-cni])", ms/n, num(n), num(ms))
	t.status = check(ms/n <= 1.3)
	limits := fmt.Sprintf("%.2f× against 1.3×.", ms/n)
	if ok(g) {
		limits += fmt.Sprintf(" With the gate-only agent the p99 is %.2f× the no-op chain's: that much is the plugins themselves, the rest the enrollments.", g/n)
	}
	cpus := 0
	if r := d.byName["chain-add"]; r != nil {
		cpus = r.Env.CPUs
	}
	add, _ := fnCPU(d, "agent-add", fnServiceAdd)
	pm, pt := med(d.series("plugin", "plugin-add-cpu", "mesh", 0)), med(d.series("plugin", "plugin-add-cpu", "tuning", 0))
	if cpus > 0 && ok(add, pm, pt) {
		extra := 16 * (add + pm - pt)
		limits += fmt.Sprintf(" Sixteen ADDs at once are 48 processes (bridge, host-local and the chained plugin for each pod) on %d CPUs. "+
			"Against the no-op chain, mesh-cni adds per pod %s ms of CPU in its own process (plugin-add CPU, mesh-cni with the eBPF agent − tuning) and %s ms in the agent (profile), "+
			"so a burst of 16 needs %s ms more CPU, at least %s ms more on %d CPUs before the last pod is done, whatever runs in parallel.",
			cpus, num(pm-pt), num(add), num(extra), num(extra/float64(cpus)), cpus)
	}
	t.limits = join(limits, "The agent's CPU per enrollment is broken down below.")
	return t
}

func gateRelease(d data) target {
	t := target{goal: "gate release: 16 waiting pods all admitted ≤ 100 ms after the agent is ready (worst round)"}
	s := d.series("chain-add", "gate-release", "release-last", 0)
	worst := maxOf(s)
	if !ok(worst) {
		return t
	}
	t.measured = fmt.Sprintf("last of 16 ADDs done %s ms after ready (median of %d rounds), %s ms in the worst round", num(med(s)), len(s.Samples), num(worst))
	t.status = check(worst <= 100)
	limits := fmt.Sprintf("worst round %s ms against 100 ms. The agent serves its socket from early in its start, while it loads the data path; the 16 waiting plugins find it on their next reconnect attempt "+
		"(their back-off is capped at %d ms with ±%d%% jitter, constants of the plugin's gate client), most of them before the agent is ready. "+
		"At ready every connected plugin's Add proceeds at once: 16 enrollments in the agent, then 16 answers and 16 plugin exits, all on the machine's CPUs.", num(worst), reconnectCapMs, reconnectJitterPct)
	if each := d.series("chain-add", "gate-release-per-pod", "release-each", 0); each != nil {
		limits += fmt.Sprintf(" Across rounds, the first pod of a round is done a median %s ms after ready.", num(firstPerRound(each, 16)))
	}
	cpus := 0
	if r := d.byName["chain-add"]; r != nil {
		cpus = r.Env.CPUs
	}
	if add, _ := fnCPU(d, "agent-add", fnServiceAdd); cpus > 0 && ok(add) {
		limits += fmt.Sprintf(" The 16 enrollments need %s ms of agent CPU (%s ms each, profile), at least %s ms on %d CPUs.", num(16*add), num(add), num(16*add/float64(cpus)), cpus)
	}
	t.limits = join(limits, "The agent's CPU per enrollment is broken down below.")
	return t
}

// firstPerRound is the median over rounds of the earliest sample of each
// round of n samples.
func firstPerRound(s *results.Series, n int) float64 {
	var firsts []float64
	for i := 0; i+n <= len(s.Samples); i += n {
		firsts = append(firsts, slices.Min(s.Samples[i:i+n]))
	}
	return results.Median(firsts)
}

// target starts a target's check on a metric, nil when the run has none.
func (d data) target(goal, result, metric string) (target, *results.Metric) {
	return target{goal: goal}, d.metric(result, metric)
}

// partial marks t as measured only up to top pods: the targets are set at
// 1000, which this run did not reach.
func partial(t target, top float64) target {
	t.measured += " — only up to " + numX(top) + " pods in this run"
	return t
}

// scaled starts a target on a metric of the scaling benchmark: m is nil when
// the run has none; top is its largest number of pods and full whether that is
// the 1000 the targets are set at.
func (d data) scaled(goal, metric string) (t target, m *results.Metric, top float64, full bool) {
	t, m = d.target(goal, "scale", metric)
	if m != nil {
		top, full = topLevel(m)
	}
	return t, m, top, full
}

// topLevel is the largest X of a scaling metric and whether it is 1000.
func topLevel(m *results.Metric) (float64, bool) {
	xs := m.Xs()
	if len(xs) == 0 {
		return math.NaN(), false
	}
	return xs[len(xs)-1], xs[len(xs)-1] >= 1000
}

func enrollRelease(d data) target {
	t, m, top, full := d.scaled("per-pod enroll+release ≤ 1 ms at 1000 pods", "enroll-per-pod")
	if m == nil {
		return t
	}
	er := med(m.Find("enroll-release", top))
	if !ok(er) {
		return t
	}
	add, del := med(d.series("scale", "enroll-release-split", "enroll", top)), med(d.series("scale", "enroll-release-split", "release", top))
	t.measured = fmt.Sprintf("%s ms median at %s pods (Add %s ms + Del %s ms; p99 %s ms)", num(er), numX(top), num(add), num(del), num(p99(m.Find("enroll-release", top))))
	if !full {
		return partial(t, top)
	}
	t.status = check(er <= 1)
	limits := fmt.Sprintf("%s ms against 1 ms; the gate's Add is %s ms of it and Del %s ms, each with one round trip on a kept connection.", num(er), num(add), num(del))
	a, _ := fnCPU(d, "agent-add", fnServiceAdd)
	v, _ := fnCPU(d, "agent-add", fnNetnsDo)
	r, _ := fnCPU(d, "agent-add", fnRelease)
	if ok(a, v, r) {
		limits += fmt.Sprintf(" The agent's own CPU for them is far less (profile: %s ms for the Add, %s ms visiting the pod's namespace, %s ms for the Release, %s ms in all): the rest of the wall time is the round trips and waiting for a CPU.",
			num(a), num(v), num(r), num(a+v+r))
	}
	t.limits = join(limits, "The agent's CPU per enrollment is broken down below.")
	return t
}

func enrollVsIPTables(d data) target {
	t, m, top, full := d.scaled("… ≥ 4× faster than the in-pod iptables way (same run)", "enroll-per-pod")
	if m == nil {
		return t
	}
	er, ipt := m.Find("enroll-release", top), m.Find("iptables", top)
	if !ok(med(er), med(ipt)) {
		return t
	}
	r := med(ipt) / med(er)
	t.measured = fmt.Sprintf("%.2f× (median iptables install+remove %s ms vs enroll+release %s ms at %s pods", r, num(med(ipt)), num(med(er)), numX(top))
	if pr, found := results.PairedRatio(ipt, er); found {
		t.measured += fmt.Sprintf("; paired %.2f×", pr)
	}
	t.measured += ")"
	if !full {
		return partial(t, top)
	}
	t.status = check(r >= 4)
	t.limits = fmt.Sprintf("%.2f× against 4×. The iptables way is four short processes (iptables-restore and ip6tables-restore, to install and to remove), %s ms in all; the agent's CPU per enrollment is broken down below.", r, num(med(ipt)))
	return t
}

// captureRatio is the paired ratio a/b of a capture metric, preferring the full
// chain and saying which configuration it came from.
func captureRatio(d data, metric, a, b string) (float64, string) {
	for _, cfg := range []string{"chain", "capture"} {
		m := d.metric("capture", metric+"-"+cfg)
		if m == nil {
			continue
		}
		if r, ok := results.PairedRatio(m.Find(a, 0), m.Find(b, 0)); ok {
			return r, cfg
		}
	}
	return math.NaN(), ""
}

// captureTarget checks the paired ratio of eBPF's capture metric to
// baseline's against the least it should be, saying which configuration it
// came from; r is NaN when the run has no such pair.
func captureTarget(d data, goal, metric, baseline string, least float64) (t target, r float64, cfg string) {
	t.goal = goal
	r, cfg = captureRatio(d, metric, "ebpf", baseline)
	if ok(r) {
		t.measured = fmt.Sprintf("%.3f× (paired median, %s%s)", r, configNote(cfg), otherConfig(d, metric, "ebpf", baseline, cfg))
		t.status = check(r >= least)
	}
	return t, r, cfg
}

func configNote(cfg string) string {
	if cfg == "chain" {
		return "full chain"
	}
	return "capture-only configuration (client proxy answers; no full-chain `limit` in this run)"
}

// otherConfig adds the capture-only configuration's ratio when the target used
// the full chain.
func otherConfig(d data, metric, a, b, cfg string) string {
	if cfg != "chain" {
		return ""
	}
	m := d.metric("capture", metric+"-capture")
	if m == nil {
		return ""
	}
	if r, found := results.PairedRatio(m.Find(a, 0), m.Find(b, 0)); found {
		return fmt.Sprintf("; capture only: %.3f×", r)
	}
	return ""
}

// bpfPerConn sums the eBPF programs' run time per connection from the profile.
func bpfPerConn(d data) string {
	m := d.metric("profile", "bpf-ns-per-conn")
	runs := d.metric("profile", "bpf-runs-per-conn")
	if m == nil {
		return ""
	}
	var total float64
	var parts []string
	for _, s := range m.Series {
		if len(s.Samples) == 0 {
			continue
		}
		total += s.Samples[0]
		part := fmt.Sprintf("%s %s µs", s.Variant, num(s.Samples[0]/1000))
		if runs != nil {
			if r := single(runs.Find(s.Variant, 0)); ok(r) {
				part += fmt.Sprintf(" in %s runs", num(r))
			}
		}
		parts = append(parts, part)
	}
	s := fmt.Sprintf("In the profile's connection phase the eBPF programs ran %s µs per proxied connection in all (%s; kernel BPF statistics, both pods and both proxies' sockets, "+
		"measured with the statistics on, which add two clock reads to every run); none runs per packet of an established connection.", num(total/1000), strings.Join(parts, ", "))
	if c := med(d.series("capture", "conn-cycle-chain", "limit", 0)); ok(c) && c > 0 {
		s += fmt.Sprintf(" That is %.1f%% of the `limit`'s median connection cycle in the full chain (%s µs).", 100*total/1000/c, num(c))
	}
	return s
}

func connRateVsLimit(d data) target {
	t, r, cfg := captureTarget(d, "eBPF capture: conn/s ≥ 0.98× the no-capture limit", "conn-rate", "limit", 0.98)
	if !ok(r) {
		return t
	}
	limits := fmt.Sprintf("%.3f× against 0.98×, %.1f%% fewer connections per second than the limit. The capture's work per connection: the connect rewrite, the original destination recorded at establishment and answered to the proxy's getsockopt, getpeername restored, and the server pod's sk_lookup assigning the proxy's listener.", r, 100*(1-r))
	limits += " The eBPF programs' own run time per connection is given below the list."
	t.perConn = true
	if m := d.metric("capture", "conn-rate-"+cfg); m != nil {
		if wins, n := results.PairedWins(m.Find("ebpf", 0), m.Find("limit", 0), true); n > 0 {
			limits += fmt.Sprintf(" eBPF beat the limit in %d of %d rounds, so the shortfall is more than noise, and the programs' own run time is only part of it. "+
				"Not in that run time: what the kernel does around the programs (the socket storage connect4 creates, freed with each socket; sk_lookup's listener assignment), "+
				"and the system calls a captured connection needs and the limit's proxies, addressed explicitly, do not make (each proxy's getsockopt(SO_ORIGINAL_DST), "+
				"which any capture needs, iptables included); this run does not measure those apart.", wins, n)
		}
	}
	t.limits = limits
	return t
}

// connRateVsInPod checks conn/s against an in-pod rules baseline: iptables,
// the reconstruction of Istio's rules that test/capture can vary, or
// istio-cni, Istio's own rules written by its code.
func connRateVsInPod(d data, baseline, label string) target {
	t, r, cfg := captureTarget(d, "eBPF capture: conn/s ≥ 1.2× "+label, "conn-rate", baseline, 1.2)
	if !ok(r) {
		return t
	}
	if m := d.metric("capture", "conn-cycle-"+cfg); m != nil {
		if pe, pi := p99(m.Find("ebpf", 0)), p99(m.Find(baseline, 0)); ok(pe, pi) {
			t.measured += fmt.Sprintf("; connection p99 %s µs vs %s µs", num(pe), num(pi))
		}
	}
	limits := fmt.Sprintf("%.3f× against 1.2×. Both captures put the same two proxies in the path, which dominate a connection's cost; a capture cannot be faster than the `limit`", r)
	if rl, _ := captureRatio(d, "conn-rate", baseline, "limit"); ok(rl) {
		limits += fmt.Sprintf(", and %s already reaches %.3f× of it (paired), so even a capture that cost nothing would be %.3f× %s here", baseline, rl, 1/rl, baseline)
	}
	t.limits = limits + ". The eBPF programs' own run time per connection is given below the list."
	t.perConn = true
	return t
}

// requestVsIstio checks the kept-connection request latency against
// istio-cni's rules: a capture acts only at connection setup, so what a
// request costs is the proxies' hops, which only taking a hop out of TCP
// (splicing the pod-local one) would lower.
func requestVsIstio(d data) target {
	t, m := d.target("request/response p50 ≤ 0.70× istio-cni's in-pod rules (full chain)", "capture", "rr-chain")
	if m == nil {
		return t
	}
	e, i := m.Find("ebpf", 0), m.Find("istio-cni", 0)
	r, found := results.PairedRatio(e, i)
	if !found || !ok(r) {
		return t
	}
	t.measured = fmt.Sprintf("%.3f× (paired median; p50 %s µs vs %s µs)", r, num(med(e)), num(med(i)))
	if c := d.metric("capture", "rr-cpu-chain"); c != nil {
		if ce, ci := med(c.Find("ebpf", 0)), med(c.Find("istio-cni", 0)); ok(ce, ci) {
			t.measured += fmt.Sprintf("; machine CPU per request %s µs vs %s µs", num(ce), num(ci))
		}
	}
	t.status = check(r <= 0.70)
	limits := fmt.Sprintf("%.3f× against 0.70×. On a kept connection no capture program runs: eBPF and istio-cni's rules send each request through the same three TCP hops (application to its proxy and proxy to application inside the pods, proxy to proxy between them) of the same two proxies", r)
	if l := m.Find("limit", 0); l != nil {
		if rl, found := results.PairedRatio(i, l); found && ok(rl) {
			limits += fmt.Sprintf(" (istio-cni is %.3f× the `limit` here)", rl)
		}
	}
	t.limits = limits + ". Only taking the pod-local hops between an application and its proxy out of TCP would lower it."
	return t
}

func throughputVsLimit(d data) target {
	t, r, _ := captureTarget(d, "eBPF capture: throughput ≥ 0.98× the no-capture limit", "throughput", "limit", 0.98)
	if !ok(r) {
		return t
	}
	t.limits = fmt.Sprintf("%.3f× against 0.98×. Once a connection is established no capture program runs on its packets; the bulk rate is set by the proxies copying and by the CPUs the other load leaves, which varies from round to round.", r)
	return t
}

func enrollScaling(d data) target {
	t, m, top, full := d.scaled("per-pod enroll+release at 1000 pods within 1.5× of at 10", "enroll-per-pod")
	if m == nil {
		return t
	}
	at10, atTop := med(m.Find("enroll-release", 10)), med(m.Find("enroll-release", top))
	if !ok(at10, atTop) {
		return t
	}
	t.measured = fmt.Sprintf("%.2f× (median %s ms at 10 pods, %s ms at %s)", atTop/at10, num(at10), num(atTop), numX(top))
	if !full {
		return partial(t, top)
	}
	t.status = check(atTop/at10 <= 1.5)
	t.limits = fmt.Sprintf("%.2f× against 1.5×: the enrollment's cost grows with the number of pods enrolled.", atTop/at10)
	return t
}

func agentMemory(d data) target {
	t, m, top, full := d.scaled("agent RSS < 64 MiB at 1000 pods", "agent-memory")
	if m == nil {
		return t
	}
	rss := math.Max(med(m.Find("rss", top)), med(m.Find("rss-restarted", top)))
	if !ok(rss) {
		return t
	}
	t.measured = fmt.Sprintf("%s MiB VmRSS at %s pods (peak VmHWM %s MiB)", num(rss), numX(top), num(med(m.Find("hwm", top))))
	if mm := d.metric("scale", "bpf-map-memory"); mm != nil {
		t.measured += fmt.Sprintf("; BPF maps %s MiB memlock, in the kernel", num(med(mm.Find("memlock", top))))
	}
	if !full {
		return partial(t, top)
	}
	t.status = check(rss < 64)
	t.limits = fmt.Sprintf("%s MiB against 64 MiB.", num(rss))
	return t
}

func restartReady(d data) target {
	t, m, top, full := d.scaled("agent restart-to-ready with 1000 pods < 2 s", "restart-ready")
	if m == nil {
		return t
	}
	s := m.Find("restart", top)
	worst := maxOf(s)
	if !ok(worst) {
		return t
	}
	t.measured = fmt.Sprintf("%s ms median, %s ms worst of %d, at %s pods", num(med(s)), num(worst), len(s.Samples), numX(top))
	if !full {
		return partial(t, top)
	}
	t.status = check(worst < 2000)
	t.limits = fmt.Sprintf("%s ms against 2000 ms: a restart adopts the pinned data path and reconciles every enrolled pod (its namespace, its sk_lookup link) before it is ready.", num(worst))
	return t
}
