package main

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// epoch is every timestamp in the image: file times in the layer and the
// layout tar, and the config's creation time. Reproducible builds use a fixed
// time rather than the build's.
var epoch = time.Unix(0, 0).UTC()

// File is one file of the image.
type File struct {
	// Src is the file on disk.
	Src string
	// Dst is its absolute path in the image.
	Dst string
}

// Spec describes an image.
type Spec struct {
	// Ref is the name written into the layout's index (both the OCI ref.name
	// annotation and containerd's image name annotation).
	Ref        string
	Files      []File
	Entrypoint []string
	Arch       string
	// Labels go into the image config (org.opencontainers.image.version and
	// the like). They change the digest, so two builds of the same binaries
	// with different versions are different images.
	Labels map[string]string
}

// Build writes the image of spec as an OCI layout tar at out and returns its
// manifest digest.
func Build(ctx context.Context, spec Spec, out string) (string, error) {
	img, err := Image(spec)
	if err != nil {
		return "", err
	}
	digest, err := img.Digest()
	if err != nil {
		return "", fmt.Errorf("manifest digest: %w", err)
	}
	dir, err := os.MkdirTemp(filepath.Dir(out), ".layout-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(dir)
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return "", fmt.Errorf("OCI layout: %w", err)
	}
	// Two names for the one manifest: the tag, and repository@digest. A pod
	// spec pins the image by digest, and the CRI resolves only names an image
	// record carries: an image imported under its tag alone would be looked
	// for in a registry when referenced by digest.
	digestRef, err := DigestRef(spec.Ref, digest.String())
	if err != nil {
		return "", err
	}
	for _, name := range []string{spec.Ref, digestRef} {
		anns := map[string]string{
			"org.opencontainers.image.ref.name": name,
			"io.containerd.image.name":          name,
		}
		if err := p.AppendImage(img, layout.WithAnnotations(anns)); err != nil {
			return "", fmt.Errorf("OCI layout: %w", err)
		}
	}
	if err := ctx.Err(); err != nil {
		return "", err
	}
	if err := tarDir(dir, out); err != nil {
		return "", err
	}
	return digest.String(), nil
}

// DigestRef returns the repository of ref (a name with a tag) joined to digest:
// the name that pins the image.
func DigestRef(ref, digest string) (string, error) {
	repo := ref
	// A tag follows the last colon after the last slash (a colon before it
	// belongs to a registry port).
	if i := strings.LastIndexByte(ref, ':'); i > strings.LastIndexByte(ref, '/') {
		repo = ref[:i]
	}
	if strings.Contains(repo, "@") {
		return "", fmt.Errorf("image name %q: want repository:tag, not a digest", ref)
	}
	if repo == "" || !strings.HasPrefix(digest, "sha256:") {
		return "", fmt.Errorf("image name %q, digest %q: want repository:tag and sha256:...", ref, digest)
	}
	return repo + "@" + digest, nil
}

// Image returns the image of spec: one layer with the files and their parent
// directories, on linux/spec.Arch.
func Image(spec Spec) (v1.Image, error) {
	if spec.Ref == "" {
		return nil, fmt.Errorf("image has no name")
	}
	layerTar, err := layerTar(spec.Files)
	if err != nil {
		return nil, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerTar)), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return nil, fmt.Errorf("layer: %w", err)
	}
	base := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	base = mutate.ConfigMediaType(base, types.OCIConfigJSON)
	img, err := mutate.AppendLayers(base, layer)
	if err != nil {
		return nil, fmt.Errorf("layer: %w", err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.OS = "linux"
	cf.Architecture = spec.Arch
	cf.Created = v1.Time{Time: epoch}
	cf.Config = v1.Config{
		Entrypoint: spec.Entrypoint,
		Env:        []string{"PATH=/usr/local/bin:/usr/bin:/bin"},
		WorkingDir: "/",
		Labels:     spec.Labels,
	}
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	return img, nil
}

// layerTar returns the layer's uncompressed tar: every file and each parent
// directory once, sorted by path, owned by root, with fixed modes and times.
func layerTar(files []File) ([]byte, error) {
	type entry struct {
		name string
		src  string // empty for a directory
	}
	entries := map[string]entry{}
	for _, f := range files {
		if !path.IsAbs(f.Dst) || path.Clean(f.Dst) != f.Dst || f.Dst == "/" {
			return nil, fmt.Errorf("%q: the destination must be a clean absolute file path", f.Dst)
		}
		name := strings.TrimPrefix(f.Dst, "/")
		if _, dup := entries[name]; dup {
			return nil, fmt.Errorf("%q is added twice", f.Dst)
		}
		entries[name] = entry{name: name, src: f.Src}
		for d := path.Dir(name); d != "."; d = path.Dir(d) {
			if e, ok := entries[d]; ok && e.src != "" {
				return nil, fmt.Errorf("%q is both a file and a directory", "/"+d)
			}
			entries[d] = entry{name: d}
		}
	}
	names := make([]string, 0, len(entries))
	for n := range entries {
		names = append(names, n)
	}
	slices.Sort(names)

	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, n := range names {
		e := entries[n]
		hdr := &tar.Header{Name: n, ModTime: epoch, Format: tar.FormatPAX}
		var data []byte
		if e.src == "" {
			hdr.Typeflag, hdr.Name, hdr.Mode = tar.TypeDir, n+"/", 0o755
		} else {
			var err error
			if data, err = regularFile(e.src); err != nil {
				return nil, err
			}
			hdr.Typeflag, hdr.Mode, hdr.Size = tar.TypeReg, 0o755, int64(len(data))
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return nil, fmt.Errorf("layer %s: %w", n, err)
		}
		if _, err := tw.Write(data); err != nil {
			return nil, fmt.Errorf("layer %s: %w", n, err)
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// regularFile reads src, which must be a regular file.
func regularFile(src string) ([]byte, error) {
	st, err := os.Stat(src)
	if err != nil {
		return nil, err
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%s is not a regular file", src)
	}
	return os.ReadFile(src)
}

// tarDir writes the tree under dir into a tar at out, sorted, with fixed
// owners, modes and times, replacing out whole.
func tarDir(dir, out string) error {
	var names []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p != dir {
			names = append(names, p)
		}
		return nil
	})
	if err != nil {
		return err
	}
	slices.Sort(names)
	tmp, err := os.CreateTemp(filepath.Dir(out), ".image-")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	tw := tar.NewWriter(tmp)
	for _, p := range names {
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		st, err := os.Lstat(p)
		if err != nil {
			return err
		}
		hdr := &tar.Header{Name: filepath.ToSlash(rel), ModTime: epoch, Mode: 0o644, Format: tar.FormatPAX}
		switch {
		case st.IsDir():
			hdr.Typeflag, hdr.Name, hdr.Mode = tar.TypeDir, hdr.Name+"/", 0o755
		case st.Mode().IsRegular():
			hdr.Typeflag, hdr.Size = tar.TypeReg, st.Size()
		default:
			return fmt.Errorf("%s: unexpected file type in the layout", p)
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if hdr.Typeflag == tar.TypeReg {
			if err := copyFile(tw, p); err != nil {
				return err
			}
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	if err := tmp.Chmod(0o644); err != nil {
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), out)
}

func copyFile(w io.Writer, p string) error {
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	_, err = io.Copy(w, f)
	return err
}
