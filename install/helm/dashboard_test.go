package helm

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// queriesFile holds the dashboard's queries, one a line, for running them
// against a live Prometheus from outside this module; MESH_UPDATE_DOCS=1
// rewrites it.
const queriesFile = "testdata/dashboard-queries.promql"

// The dashboard's queries parse as PromQL (promtool checks each as a
// recording rule's expression), name only metrics the agent exports
// (docs/monitoring.md's table, which internal/agent's TestEveryMetricDocumented
// holds to the agent's metrics), and are listed in testdata for live runs.
func TestDashboard(t *testing.T) {
	queries, err := DashboardQueries(filepath.Join(chartDir, DashboardFile))
	if err != nil {
		t.Fatal(err)
	}

	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatalf("promtool is needed to parse the dashboard's queries (apt-get install prometheus): %v", err)
	}
	var rules []map[string]string
	for i, q := range queries {
		rules = append(rules, map[string]string{"record": fmt.Sprintf("dashboard:query_%d", i), "expr": q})
	}
	file, err := yaml.Marshal(map[string]any{"groups": []any{map[string]any{"name": "dashboard", "rules": rules}}})
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "dashboard-rules.yaml")
	if err := os.WriteFile(path, file, 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.CommandContext(t.Context(), promtool, "check", "rules", path).CombinedOutput(); err != nil {
		t.Errorf("the dashboard's queries do not all parse: %v\n%s", err, out)
	}

	exported := exportedMetrics(t)
	for _, q := range queries {
		names := metricNames(q)
		if len(names) == 0 {
			t.Errorf("%s: names no metric", q)
		}
		for _, n := range names {
			if !exported(n) {
				t.Errorf("%s: %s is not a metric the agent exports (docs/monitoring.md)", q, n)
			}
		}
		if !strings.Contains(q, `{job="mesh-agent"}`) {
			t.Errorf("%s: want the agent's scrape job, job=\"mesh-agent\", as the alerts have it", q)
		}
	}

	want := "# The PromQL of every query of files/grafana-dashboard.json, one a line\n" +
		"# (install/helm's TestDashboard; MESH_UPDATE_DOCS=1 rewrites it).\n" +
		strings.Join(queries, "\n") + "\n"
	if os.Getenv("MESH_UPDATE_DOCS") == "1" {
		if err := os.WriteFile(queriesFile, []byte(want), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if got, err := os.ReadFile(queriesFile); err != nil || string(got) != want {
		t.Errorf("%s is not the dashboard's queries (MESH_UPDATE_DOCS=1 rewrites it): %v", queriesFile, err)
	}
}

// Collapsed rows hold their panels inside them; a panel with nothing to
// query is refused.
func TestDashboardQueriesReadsRows(t *testing.T) {
	dir := t.TempDir()
	write := func(d string) string {
		p := filepath.Join(dir, "d.json")
		if err := os.WriteFile(p, []byte(d), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	got, err := DashboardQueries(write(`{"panels": [
		{"type": "stat", "title": "a", "targets": [{"refId": "A", "expr": "sum(x)"}]},
		{"type": "row", "title": "r", "collapsed": true, "panels": [
			{"type": "timeseries", "title": "b", "targets": [{"refId": "A", "expr": "y"}, {"refId": "B", "expr": "z"}]}]}]}`))
	if err != nil || !slices.Equal(got, []string{"sum(x)", "y", "z"}) {
		t.Errorf("got %q, %v", got, err)
	}
	for _, d := range []string{
		`{"panels": [{"type": "stat", "title": "empty"}]}`,
		`{"panels": [{"type": "stat", "title": "blank", "targets": [{"refId": "A", "expr": ""}]}]}`,
		`{"panels": []}`,
		`{"panels": `,
	} {
		if got, err := DashboardQueries(write(d)); err == nil {
			t.Errorf("%s: %q, want an error", d, got)
		}
	}
}

// With metrics.dashboard.enabled the chart ships the dashboard file as it is,
// in a ConfigMap the Grafana sidecar finds by its label.
func TestDashboardConfigMap(t *testing.T) {
	objs := mustRender(t, map[string]any{"metrics": map[string]any{"dashboard": map[string]any{
		"enabled": true, "annotations": map[string]any{"grafana_folder": "mesh"},
	}}})
	cm, ok := objs["ConfigMap/"+namespace+"/mesh-agent-dashboard"]
	if !ok {
		t.Fatalf("no dashboard ConfigMap: %v", keys(objs))
	}
	meta := cm["metadata"].(map[string]any)
	if l := meta["labels"].(map[string]any); l["grafana_dashboard"] != "1" || l["app.kubernetes.io/name"] != "mesh-agent" {
		t.Errorf("labels %v: want grafana_dashboard: \"1\" for the sidecar", l)
	}
	if a := meta["annotations"].(map[string]any); a["grafana_folder"] != "mesh" {
		t.Errorf("annotations %v", a)
	}
	file, err := os.ReadFile(filepath.Join(chartDir, DashboardFile))
	if err != nil {
		t.Fatal(err)
	}
	data := cm["data"].(map[string]any)
	if len(data) != 1 {
		t.Fatalf("data keys %v: want the dashboard alone", data)
	}
	var got, want any
	if err := json.Unmarshal([]byte(data["mesh-cni-agents.json"].(string)), &got); err != nil {
		t.Fatalf("the ConfigMap's dashboard: %v", err)
	}
	if err := json.Unmarshal(file, &want); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Error("the ConfigMap's dashboard is not files/grafana-dashboard.json")
	}
}

// PromQL's own words: functions, aggregations and keywords, which
// metricNames does not take for metric names.
var promqlWords = map[string]bool{}

func init() {
	for _, w := range strings.Fields(`sum min max avg count stddev stdvar group topk bottomk quantile count_values limitk limit_ratio
		and or unless bool offset atan2 start end
		abs absent absent_over_time ceil changes clamp clamp_max clamp_min day_of_month day_of_week day_of_year days_in_month
		delta deriv exp floor histogram_avg histogram_count histogram_fraction histogram_quantile histogram_stddev histogram_stdvar
		histogram_sum holt_winters double_exponential_smoothing hour idelta increase irate label_join label_replace ln log2 log10
		minute month predict_linear rate resets round scalar sgn sort sort_desc sort_by_label sort_by_label_desc sqrt time timestamp vector year
		avg_over_time min_over_time max_over_time sum_over_time count_over_time quantile_over_time stddev_over_time stdvar_over_time
		last_over_time present_over_time mad_over_time
		acos acosh asin asinh atan atanh cos cosh sin sinh tan tanh deg pi rad inf nan`) {
		promqlWords[w] = true
	}
}

var (
	promqlString   = regexp.MustCompile(`"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'`)
	promqlMatchers = regexp.MustCompile(`\{[^}]*\}`)
	promqlRange    = regexp.MustCompile(`\[[^\]]*\]`)
	promqlLabels   = regexp.MustCompile(`\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)`)
	promqlIdent    = regexp.MustCompile(`[a-zA-Z_:][a-zA-Z0-9_:]*`)
)

// metricNames returns what q selects: every identifier that is not PromQL's
// own word, once strings, label matchers, ranges and label lists are gone.
// An unknown function therefore shows up as a metric, and fails the test.
func metricNames(q string) []string {
	for _, re := range []*regexp.Regexp{promqlString, promqlMatchers, promqlRange, promqlLabels} {
		q = re.ReplaceAllString(q, " ")
	}
	var out []string
	for _, id := range promqlIdent.FindAllString(q, -1) {
		if !promqlWords[strings.ToLower(id)] {
			out = append(out, id)
		}
	}
	return out
}

// exportedMetrics reports whether a name is a series the agent exports: a
// meshcni_ metric of docs/monitoring.md's table (a histogram's _bucket, _sum
// and _count), or the Go runtime's and the process' own, go_* and process_*,
// which the table's note names.
func exportedMetrics(t *testing.T) func(string) bool {
	t.Helper()
	doc, err := os.ReadFile("../../docs/monitoring.md")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(doc), "Go runtime's and process' own (`go_*`, `process_*`)") {
		t.Fatal("docs/monitoring.md no longer says the agent exports go_* and process_*")
	}
	names := map[string]bool{}
	for _, line := range strings.Split(string(doc), "\n") {
		if !strings.HasPrefix(line, "| `meshcni_") {
			continue
		}
		cells := strings.Split(line, "|")
		for _, m := range regexp.MustCompile("`(meshcni_[a-z_]+)").FindAllStringSubmatch(cells[1], -1) {
			names[m[1]] = true
			if strings.TrimSpace(cells[2]) == "histogram" {
				for _, s := range []string{"_bucket", "_sum", "_count"} {
					names[m[1]+s] = true
				}
			}
		}
	}
	if len(names) == 0 {
		t.Fatal("docs/monitoring.md lists no meshcni_ metric")
	}
	return func(n string) bool {
		return names[n] || strings.HasPrefix(n, "go_") || strings.HasPrefix(n, "process_")
	}
}

func TestMetricNames(t *testing.T) {
	for q, want := range map[string][]string{
		`sum by (le) (rate(meshcni_gate_add_duration_seconds_bucket{job="mesh-agent", verb=~"a|b"}[5m]))`: {"meshcni_gate_add_duration_seconds_bucket"},
		`count(meshcni_ready{job="x"} == 0) or on () vector(0)`:                                           {"meshcni_ready"},
		`meshcni_a / ignoring (code) group_left (verb) meshcni_b`:                                         {"meshcni_a", "meshcni_b"},
		`up{job="mesh-agent"} unless kube_pod_info`:                                                       {"up", "kube_pod_info"},
		`made_up_function(meshcni_ready)`:                                                                 {"made_up_function", "meshcni_ready"},
	} {
		if got := metricNames(q); !slices.Equal(got, want) {
			t.Errorf("metricNames(%s) = %q, want %q", q, got, want)
		}
	}
}
