package node

import (
	"os"
	"runtime"
	"testing"

	"github.com/mesh-cni/mesh-cni/install/kubernetes"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/node/nodeenv"
)

// The image the manifests pin is reproducible: `make image` at the release's
// commit (TestMain built it from that commit's tree) gives exactly the digest
// in release.go and kustomization.yaml, so whoever builds that commit runs
// what the manifests name. The build depends on the Go release too.
func TestReleaseImageReproducible(t *testing.T) {
	if runtime.Version() != kubernetes.ReleaseGo {
		t.Skipf("the release was built with %s, this is %s: the digests of other toolchains differ", kubernetes.ReleaseGo, runtime.Version())
	}
	im, err := nodeenv.ReadImages(os.Getenv(EnvReleaseImageDir))
	if err != nil {
		t.Fatal(err)
	}
	if got := im["mesh-agent"].Digest; got != kubernetes.ReleaseDigest {
		t.Fatalf("make image at %s built %s; release.go pins %s", kubernetes.ReleaseCommit, got, kubernetes.ReleaseDigest)
	}
}

// readmeMarkers are the lines around block name in docs/install.md.
func readmeMarkers(name string) (begin, end string) {
	return "<!-- begin install: " + name + " (run as written by test/node; MESH_UPDATE_DOCS=1 go test ./test/node/ -run TestReadmeInstall rewrites it) -->",
		"<!-- end install: " + name + " -->"
}

// TestReadmeInstall keeps the install and uninstall commands of docs/install.md the
// ones TestNode runs: each block of opBlocks sits in docs/install.md between its
// markers, word for word.
func TestReadmeInstall(t *testing.T) {
	for _, b := range opBlocks() {
		begin, end := readmeMarkers(b.Name)
		harness.DocSection(t, "docs/install.md", begin, end, b.markdown())
	}
}
