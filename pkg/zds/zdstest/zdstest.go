// Package zdstest holds what the tests of a ZDS server and of the node
// proxies it serves share: the agent's side of a snapshot.
package zdstest

import (
	"context"
	"slices"
	"sync"

	"github.com/mesh-cni/mesh-cni/pkg/zds"
)

// Pods is an agent's list of enrolled pods, in the order they were added: the
// zds.Snapshotter a test's server reads its snapshots from.
type Pods struct {
	mu   sync.Mutex
	list []zds.Pod
}

// NewPods is a list holding pods.
func NewPods(pods ...zds.Pod) *Pods { return &Pods{list: slices.Clone(pods)} }

// EnrolledPods returns a copy of the list.
func (p *Pods) EnrolledPods(context.Context) ([]zds.Pod, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.list), nil
}

// Add appends pod, as the agent enrolls it.
func (p *Pods) Add(pod zds.Pod) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.list = append(p.list, pod)
}

// Del removes the pod of uid, as the agent releases it.
func (p *Pods) Del(uid string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.list = slices.DeleteFunc(p.list, func(pod zds.Pod) bool { return pod.UID == uid })
}
