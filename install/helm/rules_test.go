package helm

import (
	"os/exec"
	"path/filepath"
	"testing"
)

// The alerts shipped with the chart fire on what they say and not before:
// promtool (Debian's prometheus package) evaluates each against the series of
// files/prometheus-rules_test.yaml, and checks the rule file's syntax.
func TestAlertRules(t *testing.T) {
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatalf("promtool is needed to test the alert rules (apt-get install prometheus): %v", err)
	}
	dir := filepath.Join(chartDir, "files")
	for _, args := range [][]string{
		{"check", "rules", "prometheus-rules.yaml"},
		{"test", "rules", "prometheus-rules_test.yaml"},
	} {
		cmd := exec.CommandContext(t.Context(), promtool, args...)
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Errorf("promtool %v: %v\n%s", args, err, out)
		}
	}
}
