package harness_test

import (
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// BenchmarkBridgeAdd measures one ADD+DEL of a pod through [bridge] via libcni.
func BenchmarkBridgeAdd(b *testing.B) {
	fixtures.RequireRoot(b, rootReason)
	ctx := fixtures.Context(b, 10*time.Minute)
	node := harness.NewNode(b, harness.NodeOptions{})
	list := node.Conflist(b, "benchnet")
	pod := node.NewPod(b, "default", "bench")
	for b.Loop() {
		if _, err := node.Add(ctx, pod, list); err != nil {
			b.Fatal(err)
		}
		if err := node.Del(ctx, pod, list); err != nil {
			b.Fatal(err)
		}
	}
}
