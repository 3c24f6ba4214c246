package agentcli

import (
	"os"
	"strings"

	"github.com/mesh-cni/mesh-cni/internal/agent"
	"github.com/mesh-cni/mesh-cni/internal/enroll"
	"github.com/mesh-cni/mesh-cni/internal/istiorules"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

// istioCNITakeover is istio-cni as the node agent the istio profile replaces
// on a running node: the pods it handed to ztunnel are the ones it annotated
// ambient.istio.io/redirection=enabled (mesh-cni writes the same value only
// for pods it captured, and those it has records of), and what it leaves in
// such a pod is its in-pod iptables chains.
func istioCNITakeover() *agent.Takeover {
	return &agent.Takeover{
		HandedOver: func(pod *gatepb.PodIdentity) bool {
			return pod.GetAnnotations()[enroll.IstioAnnotationRedirection] == enroll.OutcomeEnabled
		},
		Remove: func(ns *os.File) (string, bool, error) {
			res, err := istiorules.Remove(ns)
			var parts []string
			if len(res.Jumps) > 0 {
				parts = append(parts, "entry rules: "+strings.Join(res.Jumps, ", "))
			}
			if len(res.Chains) > 0 {
				parts = append(parts, "chains: "+strings.Join(res.Chains, ", "))
			}
			if len(res.Kept) > 0 {
				parts = append(parts, "emptied, kept: "+strings.Join(res.Kept, ", "))
			}
			if len(res.Deferred) > 0 {
				parts = append(parts, "left for later: "+strings.Join(res.Deferred, ", "))
			}
			if len(parts) == 0 {
				return "nothing", false, err
			}
			return strings.Join(parts, "; "), res.Pending(), err
		},
	}
}
