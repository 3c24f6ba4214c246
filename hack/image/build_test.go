package main

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"
)

func writeFile(t *testing.T, dir, name, content string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// The same files give the same bytes and digest; other content another digest.
func TestBuildReproducible(t *testing.T) {
	dir := t.TempDir()
	a := writeFile(t, dir, "a", "binary a")
	b := writeFile(t, dir, "b", "binary b")
	spec := Spec{
		Ref:        "example.test/agent:dev",
		Files:      []File{{Src: b, Dst: "/usr/local/bin/b"}, {Src: a, Dst: "/usr/local/bin/a"}},
		Entrypoint: []string{"/usr/local/bin/a"},
		Arch:       "amd64",
	}
	build := func(name string, s Spec) (string, []byte) {
		out := filepath.Join(dir, name)
		d, err := Build(context.Background(), s, out)
		if err != nil {
			t.Fatalf("Build: %v", err)
		}
		data, err := os.ReadFile(out)
		if err != nil {
			t.Fatal(err)
		}
		return d, data
	}
	d1, tar1 := build("one.tar", spec)
	// Change the input files' times and the order of the flags: no effect.
	if err := os.Chtimes(a, epoch.AddDate(3, 0, 0), epoch.AddDate(3, 0, 0)); err != nil {
		t.Fatal(err)
	}
	spec.Files[0], spec.Files[1] = spec.Files[1], spec.Files[0]
	d2, tar2 := build("two.tar", spec)
	if d1 != d2 || !bytes.Equal(tar1, tar2) {
		t.Fatalf("two builds of the same files differ: %s vs %s (tars equal: %v)", d1, d2, bytes.Equal(tar1, tar2))
	}
	writeFile(t, dir, "a", "binary a, changed")
	if d3, _ := build("three.tar", spec); d3 == d1 {
		t.Fatalf("changed content kept digest %s", d1)
	}

	// The tar is an OCI layout whose index names the image and its digest.
	index := tarMember(t, tar1, "index.json")
	var idx struct {
		Manifests []struct {
			Digest      string            `json:"digest"`
			MediaType   string            `json:"mediaType"`
			Annotations map[string]string `json:"annotations"`
		} `json:"manifests"`
	}
	if err := json.Unmarshal(index, &idx); err != nil {
		t.Fatal(err)
	}
	// Both names point at the one manifest: the tag and repository@digest.
	wantNames := []string{spec.Ref, "example.test/agent@" + d1}
	if len(idx.Manifests) != len(wantNames) {
		t.Fatalf("index has %d manifests, want %d", len(idx.Manifests), len(wantNames))
	}
	for i, m := range idx.Manifests {
		if m.Digest != d1 || m.MediaType != "application/vnd.oci.image.manifest.v1+json" ||
			m.Annotations["io.containerd.image.name"] != wantNames[i] || m.Annotations["org.opencontainers.image.ref.name"] != wantNames[i] {
			t.Fatalf("index entry %d %+v, want digest %s and name %s", i, m, d1, wantNames[i])
		}
	}
	// A label changes the config and so the digest.
	spec.Labels = map[string]string{"org.opencontainers.image.version": "v2"}
	if d4, _ := build("four.tar", spec); d4 == d1 {
		t.Fatalf("a label kept digest %s", d1)
	}
	if len(tarMember(t, tar1, "oci-layout")) == 0 {
		t.Fatal("oci-layout is empty")
	}
}

func TestDigestRef(t *testing.T) {
	const d = "sha256:0123"
	for ref, want := range map[string]string{
		"ghcr.io/mesh-cni/mesh-agent:dev": "ghcr.io/mesh-cni/mesh-agent@" + d,
		"localhost:5000/agent:v1":         "localhost:5000/agent@" + d,
		"localhost:5000/agent":            "localhost:5000/agent@" + d,
		"mesh-cni.test/pause":             "mesh-cni.test/pause@" + d,
		"ghcr.io/x@sha256:ab":             "",
		"ghcr.io/x@sha256:ab:tag":         "",
		":tag":                            "",
	} {
		got, err := DigestRef(ref, d)
		if want == "" {
			if err == nil {
				t.Errorf("DigestRef(%q) = %q, want an error", ref, got)
			}
			continue
		}
		if err != nil || got != want {
			t.Errorf("DigestRef(%q) = %q, %v; want %q", ref, got, err, want)
		}
	}
}

func TestBuildRejects(t *testing.T) {
	dir := t.TempDir()
	a := writeFile(t, dir, "a", "x")
	for name, files := range map[string][]File{
		"relative":        {{Src: a, Dst: "usr/bin/a"}},
		"unclean":         {{Src: a, Dst: "/usr//bin/a"}},
		"twice":           {{Src: a, Dst: "/a"}, {Src: a, Dst: "/a"}},
		"file and dir":    {{Src: a, Dst: "/a"}, {Src: a, Dst: "/a/b"}},
		"missing source":  {{Src: filepath.Join(dir, "nope"), Dst: "/a"}},
		"directory input": {{Src: dir, Dst: "/a"}},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := Build(context.Background(), Spec{Ref: "x.test/y:z", Files: files}, filepath.Join(dir, "out.tar"))
			if err == nil {
				t.Fatal("Build accepted it")
			}
		})
	}
}

func tarMember(t *testing.T, data []byte, name string) []byte {
	t.Helper()
	tr := tar.NewReader(bytes.NewReader(data))
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			t.Fatalf("%s not in the tar", name)
		}
		if err != nil {
			t.Fatal(err)
		}
		if h.Name == name {
			b, err := io.ReadAll(tr)
			if err != nil {
				t.Fatal(err)
			}
			return b
		}
	}
}
