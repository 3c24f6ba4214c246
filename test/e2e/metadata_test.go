package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/test/containerdhook"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// largeAnnotation is the size of TestLargeAnnotation's large annotation.
const largeAnnotation = 64 << 10

// TestLargeAnnotation: pods whose metadata exceeds the gate's bounds (a 64 KiB
// kubectl.kubernetes.io/last-applied-configuration annotation, 300 annotations)
// still start through the real hook path into the agent, and the policy's
// decision is the one their selectors call for: enrolled by label, or kept out
// by the opt-out annotation next to the large one. The hook logs what it did
// not pass on.
func TestLargeAnnotation(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	node := harness.NewNode(t, harness.NodeOptions{})
	primary := node.Conflist(t, "hooknet")
	a := newAgent(t, "--datapath=none")
	policy := filepath.Join(t.TempDir(), "policy.yaml")
	// Nothing by name: only the pod selectors (label enabled, annotation
	// disabled) decide.
	if err := os.WriteFile(policy, []byte("{}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	pluginDir := a.agentPath("containerd", "net.d")
	a.Args = append(a.Args, "--enrollment=file", "--policy-file", policy)
	a.start(ctx)
	h := containerdhook.StartHook(t, a.Socket, pluginDir)
	hook, _ := containerdhook.DialRegistered(t, pluginDir)

	big := strings.Repeat("x", largeAnnotation)
	many := map[string]string{}
	for i := range 300 {
		many[fmt.Sprintf("example.com/a%03d", i)] = "v"
	}
	for _, tc := range []struct {
		name        string
		annotations map[string]string
		enrolled    bool
	}{
		{"big", map[string]string{"kubectl.kubernetes.io/last-applied-configuration": big}, true},
		{"big-opted-out", map[string]string{"kubectl.kubernetes.io/last-applied-configuration": big, "mesh-cni.io/dataplane-mode": "disabled"}, false},
		{"many", many, true},
	} {
		p := node.NewPod(t, "shop", tc.name)
		if _, err := node.Add(ctx, p, primary); err != nil {
			t.Fatalf("primary network for %s: %v", p.Name, err)
		}
		pod := hookPod(p)
		pod.Labels = map[string]string{"mesh-cni.io/dataplane-mode": "enabled"}
		pod.Annotations = tc.annotations
		callCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
		_, err := hook.Setup(callCtx, pod, primaryResult(t, p))
		cancel()
		if err != nil {
			t.Fatalf("SetupPodNetwork %s: %v", tc.name, err)
		}
		e := enrollmentOf(ctx, a, p.ContainerID)
		if got := e != nil; got != tc.enrolled {
			t.Fatalf("pod %s enrolled = %v, want %v", tc.name, got, tc.enrolled)
		}
		if e != nil {
			if v := e.GetPod().GetAnnotations()["kubectl.kubernetes.io/last-applied-configuration"]; tc.name == "big" && len(v) > 4096 {
				t.Fatalf("the agent's record of %s holds the %d-byte annotation", tc.name, len(v))
			}
		}
	}
	if out := h.Output(); !strings.Contains(out, "not passed on as sent") || !strings.Contains(out, "65536-byte value") {
		t.Fatalf("the hook did not log what it left out:\n%s", out)
	}
}
