package agent

import (
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// descRecorder is a Registerer that keeps the fully qualified name of every
// metric its collectors describe, labelled or not, used or not.
type descRecorder struct{ names []string }

var descName = regexp.MustCompile(`fqName: "([^"]+)"`)

func (r *descRecorder) Register(c prometheus.Collector) error {
	ch := make(chan *prometheus.Desc)
	go func() { c.Describe(ch); close(ch) }()
	for d := range ch {
		if m := descName.FindStringSubmatch(d.String()); m != nil {
			r.names = append(r.names, m[1])
		}
	}
	return nil
}

func (r *descRecorder) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		_ = r.Register(c)
	}
}

func (r *descRecorder) Unregister(prometheus.Collector) bool { return false }

// TestEveryMetricDocumented holds docs/monitoring.md's metric table to what
// the agent exports, both ways: every meshcni_ metric has a row, and every
// row names a metric that exists.
func TestEveryMetricDocumented(t *testing.T) {
	rec := &descRecorder{}
	m := newMetrics(rec, func() int { return 0 }, func() bool { return true }, func() CounterReader { return nil })
	// and those only some flags register
	m.trackStartupTaint()
	var exported []string
	for _, n := range rec.names {
		if strings.HasPrefix(n, "meshcni_") {
			exported = append(exported, n)
		}
	}
	if len(exported) == 0 {
		t.Fatal("the agent describes no meshcni_ metric")
	}
	data, err := os.ReadFile("../../docs/monitoring.md")
	if err != nil {
		t.Fatal(err)
	}
	var documented []string
	for _, line := range strings.Split(string(data), "\n") {
		if !strings.HasPrefix(line, "| `meshcni_") {
			continue
		}
		cell := strings.SplitN(line, "|", 3)[1]
		for _, m := range regexp.MustCompile("`(meshcni_[a-z_]+)").FindAllStringSubmatch(cell, -1) {
			documented = append(documented, m[1])
		}
	}
	for _, n := range exported {
		if !slices.Contains(documented, n) {
			t.Errorf("docs/monitoring.md has no row for %s", n)
		}
	}
	for _, n := range documented {
		if !slices.Contains(exported, n) {
			t.Errorf("docs/monitoring.md documents %s, which the agent does not export", n)
		}
	}
}
