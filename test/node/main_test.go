package node

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"

	"testing"

	"github.com/mesh-cni/mesh-cni/install/kubernetes"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/node/nodeenv"
)

// EnvReleaseImageDir names the environment variable holding the images
// `make image` built at kubernetes.ReleaseCommit (its bin/image); unset, the
// test builds them from that commit.
const EnvReleaseImageDir = "MESH_CNI_RELEASE_IMAGE_DIR"

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

// run builds (or finds cached) everything the node runs before m.Run, so cold
// builds do not count against the test timeout: containerd, crictl, the
// Kubernetes binaries and helm (cached outside the repository), this tree's
// images and the release's.
func run(m *testing.M) int {
	ctx := context.Background()
	if _, err := nodeenv.EnsureBinaries(ctx); err != nil {
		fmt.Fprintf(os.Stderr, "node: %v\n", err)
		return 1
	}
	root, err := harness.ModuleRoot(ctx)
	if err != nil {
		fmt.Fprintf(os.Stderr, "node: %v\n", err)
		return 1
	}
	tmp, err := os.MkdirTemp("", "mesh-cni-images-")
	if err != nil {
		fmt.Fprintf(os.Stderr, "node: %v\n", err)
		return 1
	}
	defer os.RemoveAll(tmp)
	if os.Getenv(nodeenv.EnvImageDir) == "" {
		if err := buildImages(ctx, root, filepath.Join(tmp, "current"), nodeenv.EnvImageDir); err != nil {
			fmt.Fprintf(os.Stderr, "node: this tree's images: %v\n", err)
			return 1
		}
	}
	if os.Getenv(EnvReleaseImageDir) == "" {
		src := filepath.Join(tmp, "release-src")
		if err := exportCommit(ctx, root, kubernetes.ReleaseCommit, src); err != nil {
			fmt.Fprintf(os.Stderr, "node: the release's sources: %v\n", err)
			return 1
		}
		if err := buildImages(ctx, src, filepath.Join(tmp, "release"), EnvReleaseImageDir); err != nil {
			fmt.Fprintf(os.Stderr, "node: the release's images: %v\n", err)
			return 1
		}
	}
	return harness.Run(m, harness.Options{Packages: harness.ReferencePlugins()})
}

// buildImages runs `make image` in src into out and points env at the tars.
func buildImages(ctx context.Context, src, out, env string) error {
	if _, err := nodeenv.BuildImages(ctx, src, out); err != nil {
		return err
	}
	return os.Setenv(env, filepath.Join(out, "image"))
}

// exportCommit writes the tree of commit into dir, read from the repository
// without touching its working tree or index.
func exportCommit(ctx context.Context, root, commit, dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	var stderr bytes.Buffer
	archive := exec.CommandContext(ctx, "git", "-C", root, "archive", "--format=tar", commit)
	archive.Stderr = &stderr
	untar := exec.CommandContext(ctx, "tar", "-x", "-C", dir)
	pipe, err := archive.StdoutPipe()
	if err != nil {
		return err
	}
	untar.Stdin = pipe
	untar.Stderr = &stderr
	if err := untar.Start(); err != nil {
		return err
	}
	if err := archive.Run(); err != nil {
		_ = untar.Wait()
		return fmt.Errorf("git archive %s (a shallow clone lacks it: fetch the history): %w\n%s", commit, err, stderr.String())
	}
	if err := untar.Wait(); err != nil {
		return fmt.Errorf("untar %s: %w\n%s", commit, err, stderr.String())
	}
	return nil
}
