package cniplugin

import (
	"fmt"
	"strings"

	"github.com/containernetworking/cni/pkg/types"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gateclient"
)

// PodArgs is the Kubernetes pod identity a runtime passes in CNI_ARGS.
type PodArgs struct {
	Namespace   string
	Name        string
	UID         string
	InfraID     string
	HasIdentity bool
}

const maxArgsLen = 64 << 10

// parseArgs reads CNI_ARGS ("K1=V1;K2=V2"). Unknown keys are ignored, whatever
// IgnoreUnknown says: other plugins in the chain may need them. A part that is not
// KEY=VALUE is an error, since it means the runtime and the plugin disagree on
// the format.
func parseArgs(raw string) (PodArgs, error) {
	var pa PodArgs
	if len(raw) > maxArgsLen {
		return pa, types.NewError(types.ErrInvalidEnvironmentVariables, "mesh-cni: CNI_ARGS is too long", fmt.Sprintf("%d bytes", len(raw)))
	}
	if strings.TrimSpace(raw) == "" {
		return pa, nil
	}
	for _, part := range strings.Split(raw, ";") {
		if part == "" {
			continue
		}
		k, v, ok := strings.Cut(part, "=")
		if !ok || k == "" {
			return pa, types.NewError(types.ErrInvalidEnvironmentVariables, "mesh-cni: CNI_ARGS is not a list of KEY=VALUE pairs separated by ';'", truncate(part, 80))
		}
		switch k {
		case "K8S_POD_NAMESPACE":
			pa.Namespace = v
		case "K8S_POD_NAME":
			pa.Name = v
		case "K8S_POD_UID":
			pa.UID = v
		case "K8S_POD_INFRA_CONTAINER_ID":
			pa.InfraID = v
		}
	}
	pa.HasIdentity = pa.Namespace != "" && pa.Name != ""
	return pa, nil
}

// requireIdentity is for the commands that need to know the pod.
// identity is the pod as the gate names it.
func (pa PodArgs) identity() gateclient.PodIdentity {
	return gateclient.PodIdentity{Namespace: pa.Namespace, Name: pa.Name, UID: pa.UID}
}

func (pa PodArgs) requireIdentity() error {
	if pa.HasIdentity {
		return nil
	}
	return types.NewError(types.ErrInvalidEnvironmentVariables,
		"mesh-cni: CNI_ARGS lacks the pod identity (K8S_POD_NAMESPACE and K8S_POD_NAME); mesh-cni needs it to decide whether the pod joins the mesh",
		"")
}
