package kubernetes

import (
	"fmt"
	"io/fs"
	"path"

	"sigs.k8s.io/yaml"
)

// StartupTaintComponent is the component that turns on the startup taint
// (docs/install.md): the agent's flag and toleration, and RBAC on nodes.
const StartupTaintComponent = "components/startup-taint"

// ComponentPatch is one patch of a kustomize component: what it targets and
// the patch's text (a strategic merge patch or JSON 6902 operations).
type ComponentPatch struct {
	Target struct {
		Group string `json:"group"`
		Kind  string `json:"kind"`
		Name  string `json:"name"`
	} `json:"target"`
	Patch string `json:"patch"`
}

// ReadComponent returns the patches of the embedded component in dir.
func ReadComponent(dir string) ([]ComponentPatch, error) {
	file := path.Join(dir, "kustomization.yaml")
	data, err := fs.ReadFile(manifests, file)
	if err != nil {
		return nil, err
	}
	var k struct {
		Kind    string           `json:"kind"`
		Patches []ComponentPatch `json:"patches"`
	}
	if err := yaml.Unmarshal(data, &k); err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	if k.Kind != "Component" {
		return nil, fmt.Errorf("%s: kind %q, want Component", file, k.Kind)
	}
	return k.Patches, nil
}
