package helm

import (
	"encoding/json"
	"fmt"
	"os"
)

// DashboardFile is the chart's Grafana dashboard, relative to the chart's
// directory (mesh-cni/): what metrics.dashboard.enabled ships as a ConfigMap.
const DashboardFile = "files/grafana-dashboard.json"

// dashboardPanel is what DashboardQueries reads of a Grafana panel: its
// title, its queries and, for a collapsed row, the panels inside it.
type dashboardPanel struct {
	Title   string `json:"title"`
	Type    string `json:"type"`
	Targets []struct {
		RefID string `json:"refId"`
		Expr  string `json:"expr"`
	} `json:"targets"`
	Panels []dashboardPanel `json:"panels"`
}

// DashboardQueries returns the PromQL expression of every query of every
// panel of the Grafana dashboard at path, in the dashboard's order: what a
// test runs against a Prometheus scraping the agent, each expected to return
// data. A panel other than a row without a query, or a query without an
// expression, is an error: the dashboard would show nothing there.
func DashboardQueries(path string) ([]string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("dashboard: %w", err)
	}
	var d struct {
		Panels []dashboardPanel `json:"panels"`
	}
	if err := json.Unmarshal(data, &d); err != nil {
		return nil, fmt.Errorf("dashboard %s: %w", path, err)
	}
	var out []string
	var walk func([]dashboardPanel) error
	walk = func(panels []dashboardPanel) error {
		for _, p := range panels {
			if p.Type == "row" {
				if err := walk(p.Panels); err != nil {
					return err
				}
				continue
			}
			if len(p.Targets) == 0 {
				return fmt.Errorf("dashboard %s: panel %q has no query", path, p.Title)
			}
			for _, t := range p.Targets {
				if t.Expr == "" {
					return fmt.Errorf("dashboard %s: panel %q query %s has no expression", path, p.Title, t.RefID)
				}
				out = append(out, t.Expr)
			}
		}
		return nil
	}
	if err := walk(d.Panels); err != nil {
		return nil, err
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("dashboard %s has no queries", path)
	}
	return out, nil
}
