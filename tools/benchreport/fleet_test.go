package benchreport

import (
	"bytes"
	"strings"
	"testing"

	"github.com/mesh-cni/mesh-cni/test/bench/results"
)

// fleetResult is a fleet run at 10 and 40 agents: one write per meshed pod,
// writesOutside per pod outside the mesh, per-agent start cost growing by
// growth from 10 to 40.
func fleetResult(writesOutside, growth float64) *results.Result {
	m := func(name string, s ...results.Series) results.Metric {
		return results.Metric{Name: name, XLabel: "agents", Series: s}
	}
	return &results.Result{Name: "fleet", Metrics: []results.Metric{
		m("writes-per-pod", series("meshed", 10, 1), series("unmeshed", 10, 0), series("meshed", 40, 1), series("unmeshed", 40, writesOutside)),
		m("requests-per-pod", series("all", 10, 0.8), series("all", 40, 0.8)),
		m("agent-start-cpu", series("first-start", 10, 30), series("first-start", 40, 30*growth)),
		m("agent-start-requests", series("first-start", 10, 2), series("first-start", 40, 2), series("refused", 40, 0)),
		m("fleet-restart", series("restart", 40, 2.5)),
		m("decision-latency", series("steady", 40, 3, 4, 5), series("burst", 40, 20, 30, 40)),
	}}
}

// TestFleetTargets: a write for a pod outside the mesh, or a per-agent cost
// that grows with the fleet, misses its target, and the fleet's own section
// says so.
func TestFleetTargets(t *testing.T) {
	byStatus := func(r *results.Result) map[string]status {
		out := map[string]status{}
		for _, tg := range fleetTargets(data{byName: map[string]*results.Result{"fleet": r}}) {
			out[tg.goal] = tg.status
		}
		return out
	}
	good := byStatus(fleetResult(0, 1.1))
	bad := byStatus(fleetResult(0.5, 1.5))
	for _, tg := range []target{fleetWrites(data{}), fleetFlat(data{})} {
		if good[tg.goal] != met || bad[tg.goal] != missed {
			t.Errorf("%q: %v with the targets held, %v with them broken; want met, missed", tg.goal, good[tg.goal], bad[tg.goal])
		}
	}
	if st := good[fleetVsIstio(data{}).goal]; st != notMeasured {
		t.Errorf("the istio-cni comparison is %v with no istio-cni variant in the run", st)
	}
	var w bytes.Buffer
	writeSectionTargets(&w, fleetResult(0.5, 1), "")
	if !strings.Contains(w.String(), "❌ missed") || !strings.Contains(w.String(), "internal/enroll/report.go") {
		t.Errorf("the fleet section's targets do not show the missed write target and what bounds it:\n%s", w.String())
	}
}
