package helm

import (
	"os"
	"path/filepath"
	"regexp"
	"testing"

	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
)

// An overlay that moves the kustomize install to another namespace, as
// docs/install.md says: with replacements/service-account.yaml the admission
// policies name the agent's service account in that namespace (without it,
// they would still allow only mesh-system's: the agent's own writes refused,
// its narrowing policy matching nobody).
func TestKustomizeOtherNamespace(t *testing.T) {
	base, err := filepath.Abs(kustomize)
	if err != nil {
		t.Fatal(err)
	}
	usernames := regexp.MustCompile(`system:serviceaccount:([a-z0-9-]+):mesh-agent`)
	render := func(t *testing.T, withReplacements bool) map[string]int {
		t.Helper()
		dir := t.TempDir()
		rel, err := filepath.Rel(dir, base)
		if err != nil {
			t.Fatal(err)
		}
		kust := "resources: [" + rel + "]\nnamespace: mesh-alt\n"
		if withReplacements {
			data, err := os.ReadFile(filepath.Join(base, "replacements", "service-account.yaml"))
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir, "service-account-replacements.yaml"), data, 0o644); err != nil {
				t.Fatal(err)
			}
			kust += "replacements: [{path: service-account-replacements.yaml}]\n"
		}
		if err := os.WriteFile(filepath.Join(dir, "kustomization.yaml"), []byte(kust), 0o644); err != nil {
			t.Fatal(err)
		}
		res, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(filesys.MakeFsOnDisk(), dir)
		if err != nil {
			t.Fatalf("kustomize: %v", err)
		}
		out, err := res.AsYaml()
		if err != nil {
			t.Fatal(err)
		}
		seen := map[string]int{}
		for _, m := range usernames.FindAllSubmatch(out, -1) {
			seen[string(m[1])]++
		}
		return seen
	}
	if got := render(t, false); got["mesh-system"] == 0 {
		t.Errorf("without the replacements the policies name %v; the file would not be needed", got)
	}
	got := render(t, true)
	if len(got) != 1 || got["mesh-alt"] < 2 {
		t.Errorf("with the replacements the policies name the agent in %v, want mesh-alt only (both policies)", got)
	}
}
