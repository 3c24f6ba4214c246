package harness_test

import (
	"context"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// BenchmarkBridgeAdd measures one ADD+DEL of a pod through [bridge] via libcni.
func BenchmarkBridgeAdd(b *testing.B) {
	fixtures.RequireRoot(b, rootReason)
	ctx, cancel := context.WithTimeout(b.Context(), 10*time.Minute)
	defer cancel()
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
