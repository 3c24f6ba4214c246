package agent

import (
	"context"

	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

// Decision is the enrollment policy's answer for one pod.
type Decision struct {
	Enroll bool
	Reason string
}

// Policy decides which pods join the mesh.
type Policy interface {
	Decide(ctx context.Context, pod *gatepb.PodIdentity) (Decision, error)
}

// EnrollAll admits every pod that reaches the agent. The plugin's own
// excludeNamespaces list is then the only scope.
type EnrollAll struct{}

// Decide implements Policy.
func (EnrollAll) Decide(context.Context, *gatepb.PodIdentity) (Decision, error) {
	return Decision{Enroll: true, Reason: "every pod that reaches the agent is enrolled (no enrollment policy configured)"}, nil
}
