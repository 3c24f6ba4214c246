// Package nodetaint removes the taints of one key from a node through the API
// server, the way the agent lifts its startup taint: with a JSON patch that
// first tests the taints it read, so a change another client makes to the
// node's taints in between fails the patch instead of being overwritten.
package nodetaint

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
)

// DefaultTimeout bounds each API call when Remover.Timeout is zero.
const DefaultTimeout = 10 * time.Second

// FieldManager names the agent's writes in the node's managedFields.
const FieldManager = "mesh-agent"

// ValidateKey checks that key can be a taint's key (a qualified name: an
// optional DNS subdomain prefix and a slash, then a name).
func ValidateKey(key string) error {
	if errs := validation.IsQualifiedName(key); len(errs) > 0 {
		return fmt.Errorf("%q is not a taint key: %v", key, errs)
	}
	return nil
}

// Remover removes every taint with Key, whatever its value and effect, from
// the node Node.
type Remover struct {
	Nodes corev1client.NodeInterface
	Node  string
	Key   string
	// Timeout bounds each API call; zero means DefaultTimeout.
	Timeout time.Duration
}

func (r Remover) timeout() time.Duration {
	if r.Timeout > 0 {
		return r.Timeout
	}
	return DefaultTimeout
}

// get reads the node; fresh reads past the API server's watch cache.
func (r Remover) get(ctx context.Context, fresh bool) (*corev1.Node, error) {
	ctx, cancel := context.WithTimeout(ctx, r.timeout())
	defer cancel()
	opts := metav1.GetOptions{}
	if !fresh {
		// Served from the API server's cache: a periodic check of
		// every node costs etcd nothing.
		opts.ResourceVersion = "0"
	}
	n, err := r.Nodes.Get(ctx, r.Node, opts)
	if err != nil {
		return nil, fmt.Errorf("read node %s: %w", r.Node, err)
	}
	return n, nil
}

// Present reports how many taints with the key the node carries, as the API
// server's cache has it.
func (r Remover) Present(ctx context.Context) (int, error) {
	n, err := r.get(ctx, false)
	if err != nil {
		return 0, err
	}
	return count(n.Spec.Taints, r.Key), nil
}

// Remove removes the key's taints and returns how many the node carried.
// fresh reads the node past the API server's cache (after a failed attempt,
// whose read may have been stale). When the node carries none, nothing is
// written. An error after a successful read still returns the count read:
// the taints are then on the node.
func (r Remover) Remove(ctx context.Context, fresh bool) (int, error) {
	n, err := r.get(ctx, fresh)
	if err != nil {
		return 0, err
	}
	patch, found, err := Patch(n.Spec.Taints, r.Key)
	if err != nil || found == 0 {
		return found, err
	}
	pctx, cancel := context.WithTimeout(ctx, r.timeout())
	defer cancel()
	if _, err := r.Nodes.Patch(pctx, r.Node, types.JSONPatchType, patch, metav1.PatchOptions{FieldManager: FieldManager}); err != nil {
		return found, fmt.Errorf("remove taint %s from node %s: %w", r.Key, r.Node, err)
	}
	return found, nil
}

func count(taints []corev1.Taint, key string) int {
	n := 0
	for _, t := range taints {
		if t.Key == key {
			n++
		}
	}
	return n
}

// jsonPatchOp is one RFC 6902 operation.
type jsonPatchOp struct {
	Op    string `json:"op"`
	Path  string `json:"path"`
	Value any    `json:"value,omitempty"`
}

// Patch is the JSON patch that removes the key's taints from a node whose
// taints are old, and how many it removes; zero means there is nothing to
// patch (and no patch). The patch tests the whole old list first: a node
// whose taints are no longer exactly old is left unchanged and the API server
// refuses the patch.
func Patch(old []corev1.Taint, key string) ([]byte, int, error) {
	if key == "" {
		return nil, 0, errors.New("empty taint key")
	}
	var keep []corev1.Taint
	for _, t := range old {
		if t.Key != key {
			keep = append(keep, t)
		}
	}
	removed := len(old) - len(keep)
	if removed == 0 {
		return nil, 0, nil
	}
	ops := []jsonPatchOp{{Op: "test", Path: "/spec/taints", Value: old}}
	if len(keep) == 0 {
		ops = append(ops, jsonPatchOp{Op: "remove", Path: "/spec/taints"})
	} else {
		ops = append(ops, jsonPatchOp{Op: "replace", Path: "/spec/taints", Value: keep})
	}
	data, err := json.Marshal(ops)
	if err != nil {
		return nil, 0, fmt.Errorf("encode taint patch: %w", err)
	}
	return data, removed, nil
}
