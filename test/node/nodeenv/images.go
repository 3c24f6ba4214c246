package nodeenv

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"time"
)

// EnvImageDir names the environment variable holding a directory of images
// `make image` built (its bin/image). When it is unset, BuildImages runs
// `make image` into a temporary directory and sets it.
const EnvImageDir = "MESH_CNI_IMAGE_DIR"

// ImageTimeout bounds one `make image` (static builds of six binaries).
const ImageTimeout = 15 * time.Minute

// Image is one OCI layout tar `make image` wrote.
type Image struct {
	// Tar is the layout tar (what `ctr images import` takes).
	Tar string
	// Repository is the image's name without tag; Digest its manifest digest.
	Repository string
	Digest     string
}

// Ref is the image pinned by digest, as pod specs name it.
func (i Image) Ref() string { return i.Repository + "@" + i.Digest }

// Images are the images of one `make image`, by name (mesh-agent, refproxy,
// echoserver, echoclient, pause).
type Images map[string]Image

// ImageNames are the images `make image` builds.
func ImageNames() []string {
	return []string{"mesh-agent", "refproxy", "echoserver", "echoclient", "pause"}
}

// Tars lists every image's tar.
func (im Images) Tars() []string {
	var out []string
	for _, n := range ImageNames() {
		out = append(out, im[n].Tar)
	}
	return out
}

var digestRE = regexp.MustCompile(`^sha256:[0-9a-f]{64}$`)

// ReadImages reads the images in dir (a `make image` output: <name>.tar and
// <name>.tar.digest). Repositories are those the Makefile names them by.
func ReadImages(dir string) (Images, error) {
	im := Images{}
	var errs []error
	for _, n := range ImageNames() {
		tar := filepath.Join(dir, n+".tar")
		d, err := os.ReadFile(tar + ".digest")
		if err != nil {
			errs = append(errs, err)
			continue
		}
		digest := strings.TrimSpace(string(d))
		if !digestRE.MatchString(digest) {
			errs = append(errs, fmt.Errorf("%s.digest holds %q, not a sha256 digest", tar, digest))
			continue
		}
		repo := "mesh-cni.test/" + n
		if n == "mesh-agent" {
			repo = AgentRepository
		}
		im[n] = Image{Tar: tar, Repository: repo, Digest: digest}
	}
	return im, errors.Join(errs...)
}

// AgentRepository is the agent image's name in the manifests.
const AgentRepository = "ghcr.io/mesh-cni/mesh-agent"

// BuildImages runs `make image` in the source tree src with its output under
// out (out/image holds the tars) and reads them. extra are further make
// arguments (variables).
func BuildImages(ctx context.Context, src, out string, extra ...string) (Images, error) {
	ctx, cancel := context.WithTimeout(ctx, ImageTimeout)
	defer cancel()
	args := append([]string{"-C", src, "image", "BIN=" + out}, extra...)
	cmd := exec.CommandContext(ctx, "make", args...)
	var output bytes.Buffer
	cmd.Stdout = &output
	cmd.Stderr = &output
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("make %s: %w\n%s", strings.Join(args, " "), err, output.String())
	}
	return ReadImages(filepath.Join(out, "image"))
}
