package agent

import (
	"fmt"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/mesh-cni/mesh-cni/internal/redirect"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// descRecorder is a Registerer that keeps the fully qualified name of every
// metric its collectors describe, labelled or not, used or not, with its
// label names.
type descRecorder struct{ labels map[string][]string }

var (
	descName   = regexp.MustCompile(`fqName: "([^"]+)"`)
	descLabels = regexp.MustCompile(`variableLabels: \{([^}]*)\}`)
)

func (r *descRecorder) Register(c prometheus.Collector) error {
	ch := make(chan *prometheus.Desc)
	go func() { c.Describe(ch); close(ch) }()
	for d := range ch {
		m := descName.FindStringSubmatch(d.String())
		if m == nil {
			continue
		}
		var labels []string
		if l := descLabels.FindStringSubmatch(d.String()); l != nil && l[1] != "" {
			labels = strings.Split(l[1], ",")
		}
		slices.Sort(labels)
		r.labels[m[1]] = labels
	}
	return nil
}

func (r *descRecorder) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		_ = r.Register(c)
	}
}

func (r *descRecorder) Unregister(prometheus.Collector) bool { return false }

// monitoringRow is a metric of docs/monitoring.md's table: the label names
// its name cell gives in braces, and the whole row's text.
type monitoringRow struct {
	labels []string
	text   string
}

var docMetric = regexp.MustCompile("`(meshcni_[a-z_]+)(?:\\{([a-z_,]*)\\})?`")

// documentedMetrics reads docs/monitoring.md's metric table.
func documentedMetrics(t *testing.T) map[string]monitoringRow {
	t.Helper()
	data := fixtures.ReadDoc(t, "docs/monitoring.md")
	rows := map[string]monitoringRow{}
	for _, line := range strings.Split(string(data), "\n") {
		if !strings.HasPrefix(line, "| `meshcni_") {
			continue
		}
		cell := strings.SplitN(line, "|", 3)[1]
		for _, m := range docMetric.FindAllStringSubmatch(cell, -1) {
			var labels []string
			if m[2] != "" {
				labels = strings.Split(m[2], ",")
			}
			slices.Sort(labels)
			if _, dup := rows[m[1]]; dup {
				t.Errorf("docs/monitoring.md has two rows for %s", m[1])
			}
			rows[m[1]] = monitoringRow{labels: labels, text: line}
		}
	}
	return rows
}

// TestEveryMetricDocumented holds docs/monitoring.md's metric table to what
// the agent exports, both ways: every meshcni_ metric has a row, every row
// names a metric that exists, and the labels a row names are the metric's.
func TestEveryMetricDocumented(t *testing.T) {
	rec := &descRecorder{labels: map[string][]string{}}
	m := newMetrics(rec, func() int { return 0 }, func() bool { return true }, func() CounterReader { return nil })
	// and those only some flags register
	m.trackStartupTaint()
	exported := map[string][]string{}
	for n, labels := range rec.labels {
		if strings.HasPrefix(n, "meshcni_") {
			exported[n] = labels
		}
	}
	if len(exported) == 0 {
		t.Fatal("the agent describes no meshcni_ metric")
	}
	documented := documentedMetrics(t)
	for n, labels := range exported {
		row, ok := documented[n]
		switch {
		case !ok:
			t.Errorf("docs/monitoring.md has no row for %s", n)
		case !slices.Equal(row.labels, labels):
			t.Errorf("docs/monitoring.md gives %s the labels %v, the agent %v", n, row.labels, labels)
		}
	}
	for n := range documented {
		if _, ok := exported[n]; !ok {
			t.Errorf("docs/monitoring.md documents %s, which the agent does not export", n)
		}
	}
}

// countingDatapath reports counters in which every number is different, so
// each one can be found in what the agent exports.
type countingDatapath struct {
	counters redirect.Counters
}

func (f *countingDatapath) Counters() (redirect.Counters, error) { return f.counters, nil }

// numberFields sets every integer field of v, a pointer to a struct, nested
// structs included, to the next of distinct values, and returns them by the
// field's path.
func numberFields(v reflect.Value, path string, next *int, out map[float64]string) {
	switch v.Kind() {
	case reflect.Pointer:
		numberFields(v.Elem(), path, next, out)
	case reflect.Struct:
		for i := range v.NumField() {
			numberFields(v.Field(i), path+"."+v.Type().Field(i).Name, next, out)
		}
	case reflect.Uint64, reflect.Uint32, reflect.Int:
		*next += 7
		if v.CanUint() {
			v.SetUint(uint64(*next))
		} else {
			v.SetInt(int64(*next))
		}
		out[float64(*next)] = path
	}
}

// TestEveryDatapathCounterExported: every counter the data path reads from
// its BPF maps (redirect.Counters) reaches a
// meshcni_datapath_ metric, and every label value those metrics carry is one
// docs/monitoring.md's row for the metric names. A counter added to the data
// path without a metric, or a label value the docs do not give, fails here.
func TestEveryDatapathCounterExported(t *testing.T) {
	dp := &countingDatapath{}
	next := 0
	values := map[float64]string{}
	numberFields(reflect.ValueOf(&dp.counters), "Counters", &next, values)
	reg := prometheus.NewRegistry()
	newMetrics(reg, func() int { return 0 }, func() bool { return true }, func() CounterReader { return dp })
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	documented := documentedMetrics(t)
	seen := map[float64]bool{}
	undocumented := map[string]bool{}
	for _, f := range families {
		if !strings.HasPrefix(f.GetName(), "meshcni_datapath_") {
			continue
		}
		row := documented[f.GetName()]
		for _, s := range f.GetMetric() {
			v := s.GetCounter().GetValue() + s.GetGauge().GetValue()
			if _, ok := values[v]; ok {
				if seen[v] {
					t.Errorf("%s exports %s twice", f.GetName(), values[v])
				}
				seen[v] = true
			}
			for _, l := range s.GetLabel() {
				label := fmt.Sprintf("%s{%s=%q}", f.GetName(), l.GetName(), l.GetValue())
				if !strings.Contains(row.text, "`"+l.GetValue()+"`") && !undocumented[label] {
					undocumented[label] = true
					t.Errorf("%s: docs/monitoring.md's row does not give the value", label)
				}
			}
		}
	}
	for v, field := range values {
		if !seen[v] {
			t.Errorf("%s is in no meshcni_datapath_ metric", field)
		}
	}
}
