package bench

import (
	"context"
	"fmt"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// benchNet is the network name of every conflist on a benchmark's node. The
// variants' lists differ in their plugins but share the name, because host-local
// keeps its allocations per network name: lists with different names would hand
// out the same addresses twice on one bridge.
const benchNet = "benchnet"

// pods makes short-lived pods on a node by the hundred: the harness's Pod keeps
// every pod until the benchmark ends and DELs each in cleanup, which is right
// for tests and too slow for a thousand pods. Here a pod is removed as soon as
// the benchmark is done with it, and whatever is left at the end is removed
// without DEL (the node's namespace, the agent's state and the pinned data path
// go with the benchmark's other cleanups).
type pods struct {
	node *harness.Node
	mu   sync.Mutex
	live map[string]*pod // by netns path
}

// pod is a network namespace with the identity a runtime hands to CNI.
type pod struct {
	rt       *libcni.RuntimeConf
	NetNS    string
	Name     string
	Attached []*libcni.NetworkConfigList
}

func newPods(tb testing.TB, node *harness.Node) *pods {
	ps := &pods{node: node, live: map[string]*pod{}}
	tb.Cleanup(func() {
		ps.mu.Lock()
		defer ps.mu.Unlock()
		for path := range ps.live {
			if err := netns.Remove(path); err != nil {
				tb.Errorf("remove pod netns: %v", err)
			}
		}
		ps.live = nil
	})
	return ps
}

// create makes a pod namespace with loopback up, named with the harness's
// per-process prefix so its leak check covers it.
func (ps *pods) create(namespace, name string) (*pod, error) {
	path := filepath.Join(harness.NetnsDir, harness.NetnsPrefix()+"b-"+fixtures.RandomHex(5))
	if err := fixtures.CreateNetns(path); err != nil {
		return nil, fmt.Errorf("pod: %w", err)
	}
	uid, cid := fixtures.RandomHex(16), fixtures.RandomHex(32)
	p := &pod{
		NetNS: path,
		Name:  name,
		rt: &libcni.RuntimeConf{
			ContainerID: cid,
			NetNS:       path,
			IfName:      "eth0",
			Args: [][2]string{
				{"IgnoreUnknown", "1"},
				{"K8S_POD_NAMESPACE", namespace},
				{"K8S_POD_NAME", name},
				{"K8S_POD_INFRA_CONTAINER_ID", cid},
				{"K8S_POD_UID", fmt.Sprintf("%s-%s-%s-%s-%s", uid[0:8], uid[8:12], uid[12:16], uid[16:20], uid[20:32])},
			},
		},
	}
	ps.mu.Lock()
	ps.live[path] = p
	ps.mu.Unlock()
	return p, nil
}

// add runs CNI ADD of list for p through libcni in the node netns, as a runtime
// does, and returns how long the ADD took.
func (ps *pods) add(ctx context.Context, p *pod, list *libcni.NetworkConfigList) (time.Duration, error) {
	took, err := ps.timedAdd(p, list.Name, func() error {
		_, err := ps.node.CNI.AddNetworkList(ctx, list, p.rt)
		return err
	})
	if err != nil {
		return 0, err
	}
	p.Attached = append(p.Attached, list)
	return took, nil
}

// addConf runs ADD of a single plugin config (see meshOnly) for p.
func (ps *pods) addConf(ctx context.Context, p *pod, conf *libcni.PluginConfig) (time.Duration, error) {
	return ps.timedAdd(p, conf.Network.Name, func() error {
		_, err := ps.node.CNI.AddNetwork(ctx, conf, p.rt)
		return err
	})
}

// timedAdd runs add, the ADD of network name for p, in the node netns and
// times it: the time spent in the netns switch is not the plugin's.
func (ps *pods) timedAdd(p *pod, name string, add func() error) (time.Duration, error) {
	var took time.Duration
	err := ps.node.Do(func() error {
		start := time.Now()
		err := add()
		took = time.Since(start)
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("CNI ADD %s for pod %s: %w", name, p.Name, err)
	}
	return took, nil
}

// remove DELs p from every network it was added to and removes its namespace.
func (ps *pods) remove(ctx context.Context, p *pod) error {
	for _, list := range p.Attached {
		if err := ps.node.Do(func() error { return ps.node.CNI.DelNetworkList(ctx, list, p.rt) }); err != nil {
			return fmt.Errorf("CNI DEL %s for pod %s: %w", list.Name, p.Name, err)
		}
	}
	p.Attached = nil
	return ps.drop(p)
}

// drop removes p's namespace without DEL.
func (ps *pods) drop(p *pod) error {
	ps.mu.Lock()
	delete(ps.live, p.NetNS)
	ps.mu.Unlock()
	if err := netns.Remove(p.NetNS); err != nil {
		return fmt.Errorf("remove pod netns: %w", err)
	}
	return nil
}
