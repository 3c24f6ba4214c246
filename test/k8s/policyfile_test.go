package k8s

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// TestAgentPolicyFile: the standalone source end to end, with no cluster: the
// real agent with --enrollment=file and the real chain. An edit enrolls and
// releases running pods without a restart; an invalid edit is rejected with a
// clear log and the last good policy stays in force.
func TestAgentPolicyFile(t *testing.T) {
	t.Parallel()
	ctx := fixtures.Context(t, 5*time.Minute)
	policyDir := t.TempDir()
	policy := filepath.Join(policyDir, "enrollment.yaml")
	write := func(content string) {
		t.Helper()
		// Atomically, as a careful operator or a ConfigMap does.
		tmp := filepath.Join(policyDir, ".enrollment.yaml.tmp")
		if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, policy); err != nil {
			t.Fatal(err)
		}
	}
	write("namespaces: [shop]\nexclude: [{namespace: shop, name: db}]\n")

	a := prepareAgent(t, "--enrollment", "file", "--policy-file", policy)
	a.start(ctx)

	node := harness.NewNode(t, harness.NodeOptions{Plugins: append(harness.ReferencePluginNames(), "mesh-cni")})
	list := node.Conflist(t, "meshnet", a.meshEntry())
	web := node.NewPod(t, "shop", "web")
	db := node.NewPod(t, "shop", "db")
	api := node.NewPod(t, "pay", "api")
	for _, p := range []*harness.Pod{web, db, api} {
		add(ctx, t, node, list, p)
	}
	if !a.enrolled(web) || a.enrolled(db) || a.enrolled(api) {
		t.Fatalf("first policy: enrolled web=%v db=%v api=%v, want true false false", a.enrolled(web), a.enrolled(db), a.enrolled(api))
	}

	// An edit is in force without a restart: pay joins, shop leaves.
	write("namespaces: [pay]\n")
	waitEnrolled(t, a, api, true, "namespace added to the policy file")
	waitEnrolled(t, a, web, false, "namespace removed from the policy file")

	// An invalid edit is rejected with a clear log; the last good policy stays.
	write("namespaces: [shop\n")
	line, err := a.Proc.WaitForLine(ctx, "invalid enrollment policy edit ignored")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(line, policy) || !strings.Contains(line, "last good policy stays in force") {
		t.Fatalf("rejection log does not name the file and the consequence: %s", line)
	}
	if !a.enrolled(api) || a.enrolled(web) {
		t.Fatal("an invalid edit changed the enrollments")
	}
	// A pod added now is decided by the last good policy.
	late := node.NewPod(t, "pay", "late")
	add(ctx, t, node, list, late)
	if !a.enrolled(late) {
		t.Fatal("a pod added after an invalid edit was not decided by the last good policy")
	}

	// Fixing the file puts the fix in force.
	write("namespaces: [shop, pay]\nexclude: [{namespace: pay, name: late}]\n")
	waitEnrolled(t, a, web, true, "fixed policy file")
	waitEnrolled(t, a, late, false, "fixed policy file excludes a pod")
}
