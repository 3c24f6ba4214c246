package helm

import (
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"testing"

	"helm.sh/helm/v3/pkg/chartutil"
)

// platformNames are the chart's platform presets, as its schema lists them.
func platformNames(t *testing.T) []string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(chartDir, "values.schema.json"))
	if err != nil {
		t.Fatal(err)
	}
	var schema struct {
		Properties struct {
			Platform struct {
				Enum []string `json:"enum"`
			} `json:"platform"`
		} `json:"properties"`
	}
	if err := json.Unmarshal(data, &schema); err != nil {
		t.Fatal(err)
	}
	return schema.Properties.Platform.Enum
}

// overlay writes a kustomization over base with the platform's component, as
// an operator's overlay does, and builds it.
func overlay(t *testing.T, base, component string) map[string]object {
	t.Helper()
	dir := t.TempDir()
	abs := func(p string) string {
		a, err := filepath.Abs(p)
		if err != nil {
			t.Fatal(err)
		}
		rel, err := filepath.Rel(dir, a)
		if err != nil {
			t.Fatal(err)
		}
		return rel
	}
	k := "resources: [" + abs(base) + "]\n"
	if component != "" {
		k += "components: [" + abs(component) + "]\n"
	}
	if err := os.WriteFile(filepath.Join(dir, "kustomization.yaml"), []byte(k), 0o644); err != nil {
		t.Fatal(err)
	}
	return build(t, dir)
}

// Every platform the chart offers renders what install/kubernetes builds with
// that platform's component (or with none, where the defaults are the
// platform's): the DaemonSet, the SCC where there is one, and the uninstall Job.
func TestPlatformsRenderTheirComponents(t *testing.T) {
	names := platformNames(t)
	if len(names) < 8 {
		t.Fatalf("the schema lists platforms %q", names)
	}
	for _, name := range names {
		if name == "auto" {
			continue
		}
		t.Run(name, func(t *testing.T) {
			component := filepath.Join(kustomize, "platforms", name)
			if _, err := os.Stat(filepath.Join(component, "kustomization.yaml")); err != nil {
				component = ""
			}
			kust := overlay(t, kustomize, component)
			delete(kust, "Namespace/<nil>/"+namespace)
			chart := mustRender(t, map[string]any{"platform": name})
			if len(keys(chart)) != len(keys(kust)) {
				t.Fatalf("the chart renders %v, kustomize builds %v", keys(chart), keys(kust))
			}
			for k, want := range kust {
				diff(t, k, chart[k], want)
			}
			job := mustRender(t, map[string]any{"platform": name, "uninstall": map[string]any{"node": uninstallNode}})
			for k, want := range overlay(t, filepath.Join(kustomize, "uninstall"), component) {
				diff(t, k, job[k], want)
			}
		})
	}
}

// platform: auto reads the cluster: the version strings GKE, EKS and k3s give
// their API servers, and OpenShift's API group.
func TestPlatformAuto(t *testing.T) {
	for _, tc := range []struct {
		version string
		apis    []string
		bin     string
		conf    string
		scc     bool
	}{
		{version: "v1.33.2", bin: "/opt/cni/bin", conf: "/etc/cni/net.d"},
		{version: "v1.33.2-gke.1111000", bin: "/home/kubernetes/bin", conf: "/etc/cni/net.d"},
		{version: "v1.33.1-eks-a1b2c3d", bin: "/opt/cni/bin", conf: "/etc/cni/net.d"},
		{version: "v1.33.2+k3s1", bin: "/var/lib/rancher/k3s/data/cni", conf: "/var/lib/rancher/k3s/agent/etc/cni/net.d"},
		{version: "v1.33.2", apis: []string{"security.openshift.io/v1"}, bin: "/var/lib/cni/bin", conf: "/etc/kubernetes/cni/net.d", scc: true},
	} {
		t.Run(tc.version+"/"+filepath.Base(tc.bin), func(t *testing.T) {
			// What helm install reads from the API server: its GitVersion
			// whole (--kube-version of helm template drops the suffix).
			kv := &chartutil.KubeVersion{Version: tc.version, Major: "1", Minor: "33"}
			objs, err := renderWith(t, nil, kv, tc.apis)
			if err != nil {
				t.Fatal(err)
			}
			got := hostPaths(podSpec(t, objs, "mesh-agent"))
			if got["cni-bin"] != tc.bin || got["cni-conf"] != tc.conf {
				t.Errorf("Kubernetes %s %v: CNI directories %s and %s, want %s and %s", tc.version, tc.apis, got["cni-bin"], got["cni-conf"], tc.bin, tc.conf)
			}
			if _, ok := objs["SecurityContextConstraints/<nil>/mesh-agent"]; ok != tc.scc {
				t.Errorf("SCC rendered: %v, want %v", ok, tc.scc)
			}
		})
	}
}

// The chart's startupTaint renders what install/kubernetes builds with its
// startup-taint component: the flag, the toleration, the node rule of the
// ClusterRole, and the admission policy with the default key.
func TestStartupTaintRendersTheComponent(t *testing.T) {
	kust := overlay(t, kustomize, filepath.Join(kustomize, "components", "startup-taint"))
	delete(kust, "Namespace/<nil>/"+namespace)
	chart := mustRender(t, map[string]any{"startupTaint": map[string]any{"enabled": true}})
	if len(keys(chart)) != len(keys(kust)) {
		t.Fatalf("the chart renders %v, kustomize builds %v", keys(chart), keys(kust))
	}
	for k, want := range kust {
		diff(t, k, chart[k], want)
	}
	if reflect.DeepEqual(chart["ClusterRole/<nil>/mesh-agent"], mustRender(t, nil)["ClusterRole/<nil>/mesh-agent"]) {
		t.Error("the ClusterRole is the same with and without the startup taint")
	}
}
