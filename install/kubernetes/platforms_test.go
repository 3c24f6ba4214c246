package kubernetes

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"sigs.k8s.io/yaml"
)

// The components under platforms/ are the table: one per platform whose
// directories differ from the default, each setting exactly the table's
// directories on the DaemonSet and the uninstall Job. (install/helm's tests
// build each component and hold the chart's presets to it.)
func TestPlatformComponents(t *testing.T) {
	platforms := Platforms()
	def := platforms[0]
	if def.Name != "default" {
		t.Fatalf("the first platform is %q, want default", def.Name)
	}
	mounts := map[string]string{}
	for _, m := range AgentMounts() {
		mounts[m.Volume] = m.HostPath
	}
	if mounts["cni-bin"] != def.CNIBinDir || mounts["cni-conf"] != def.CNIConfDir {
		t.Errorf("the DaemonSet mounts %s and %s, the default platform says %s and %s", mounts["cni-bin"], mounts["cni-conf"], def.CNIBinDir, def.CNIConfDir)
	}
	dirs, err := os.ReadDir("platforms")
	if err != nil {
		t.Fatal(err)
	}
	var components []string
	for _, d := range dirs {
		components = append(components, "platforms/"+d.Name())
	}
	var want []string
	for _, p := range platforms {
		if p.Component == "" {
			if p.CNIBinDir != def.CNIBinDir || p.CNIConfDir != def.CNIConfDir {
				t.Errorf("%s has directories of its own but no component", p.Name)
			}
			continue
		}
		want = append(want, p.Component)
		t.Run(p.Name, func(t *testing.T) {
			data, err := os.ReadFile(filepath.Join(p.Component, kustomizationFile))
			if err != nil {
				t.Fatal(err)
			}
			var k struct {
				Kind    string `json:"kind"`
				Patches []struct {
					Target struct {
						Kind string `json:"kind"`
					} `json:"target"`
					Patch string `json:"patch"`
				} `json:"patches"`
			}
			if err := yaml.Unmarshal(data, &k); err != nil {
				t.Fatal(err)
			}
			if k.Kind != "Component" {
				t.Errorf("kind %q, want Component", k.Kind)
			}
			var kinds []string
			for _, pt := range k.Patches {
				kinds = append(kinds, pt.Target.Kind)
				var obj struct {
					Spec struct {
						Template struct {
							Spec struct {
								Volumes []struct {
									Name     string `json:"name"`
									HostPath struct {
										Path string `json:"path"`
									} `json:"hostPath"`
								} `json:"volumes"`
							} `json:"spec"`
						} `json:"template"`
					} `json:"spec"`
				}
				if err := yaml.Unmarshal([]byte(pt.Patch), &obj); err != nil {
					t.Fatal(err)
				}
				got := map[string]string{}
				for _, v := range obj.Spec.Template.Spec.Volumes {
					got[v.Name] = v.HostPath.Path
				}
				if len(got) != 2 || got["cni-bin"] != p.CNIBinDir || got["cni-conf"] != p.CNIConfDir {
					t.Errorf("the %s patch sets %v, want cni-bin %s and cni-conf %s", pt.Target.Kind, got, p.CNIBinDir, p.CNIConfDir)
				}
			}
			slices.Sort(kinds)
			if !slices.Equal(kinds, []string{"DaemonSet", "Job"}) {
				t.Errorf("patches for %q, want the DaemonSet and the uninstall Job", kinds)
			}
		})
	}
	slices.Sort(want)
	if !slices.Equal(components, want) {
		t.Errorf("platforms/ holds %q, the table names %q", components, want)
	}
}
