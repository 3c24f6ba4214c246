// Package agenttest runs the agent's gate service in-process for the tests
// of the servers a container runtime calls (the KNI interposer, the
// containerd network-plugin hook): both hand each pod to the gate and ask the
// agent's readiness first, and their tests check what reached the gate.
package agenttest

import (
	"context"
	"path/filepath"
	"slices"
	"sync"
	"testing"

	"go.uber.org/zap"
	"google.golang.org/protobuf/proto"

	"github.com/mesh-cni/mesh-cni/internal/agent"
	"github.com/mesh-cni/mesh-cni/internal/podstore"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

// CondTest is the readiness condition a Gate made not ready starts without;
// a test sets it to make the agent ready.
const CondTest = "test-condition"

// Gate is an agent's gate Service over a real pod store in a test directory,
// with the RecordOnly data path and a RecordingPolicy.
type Gate struct {
	Service   *agent.Service
	Readiness *agent.Readiness
	Policy    *RecordingPolicy
	// ReadyAsked receives a value each time Ready answers "not ready": the
	// server that asked is then about to wait for the agent.
	ReadyAsked chan struct{}
}

// NewGate makes a Gate, ready at once unless notReady (then CondTest is
// unmet).
func NewGate(tb testing.TB, log *zap.Logger, notReady bool) *Gate {
	tb.Helper()
	g := &Gate{Policy: &RecordingPolicy{}, ReadyAsked: make(chan struct{}, 16)}
	if notReady {
		g.Readiness = agent.NewReadiness(CondTest)
	} else {
		g.Readiness = agent.NewReadiness()
	}
	store, problems, err := podstore.Open(filepath.Join(tb.TempDir(), "pods"))
	if err != nil || len(problems) > 0 {
		tb.Fatalf("pod store: %v %v", err, problems)
	}
	g.Service = agent.NewService(log.Named("agent"), g.Readiness, g.Policy, agent.RecordOnly{}, store)
	return g
}

// Ready is the agent's readiness as the servers' Config.Ready asks it, noting
// each "not ready" on ReadyAsked.
func (g *Gate) Ready() (bool, string) {
	ready, why := g.Readiness.Ready()
	if !ready {
		select {
		case g.ReadyAsked <- struct{}{}:
		default:
		}
	}
	return ready, why
}

// Enrollments lists what the gate has enrolled, failing tb on an error.
func (g *Gate) Enrollments(tb testing.TB) []*gatepb.Enrollment {
	tb.Helper()
	list, err := g.Service.List(context.Background(), &gatepb.ListRequest{})
	if err != nil {
		tb.Fatalf("gate List: %v", err)
	}
	return list.GetEnrollments()
}

// RecordingPolicy enrolls every pod, like agent.EnrollAll, and keeps the pod
// identities it was asked about: the gate's records do not keep labels and
// annotations, the policy is what uses them.
type RecordingPolicy struct {
	mu   sync.Mutex
	pods []*gatepb.PodIdentity
}

// Decide records pod and enrolls it.
func (p *RecordingPolicy) Decide(ctx context.Context, pod *gatepb.PodIdentity) (agent.Decision, error) {
	p.mu.Lock()
	p.pods = append(p.pods, proto.Clone(pod).(*gatepb.PodIdentity))
	p.mu.Unlock()
	return agent.EnrollAll{}.Decide(ctx, pod)
}

// Asked is every pod identity Decide was given, in order.
func (p *RecordingPolicy) Asked() []*gatepb.PodIdentity {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.pods)
}
