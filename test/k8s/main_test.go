package k8s

import (
	"context"
	"fmt"
	"os"
	"testing"

	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/k8s/kubeenv"
)

func TestMain(m *testing.M) {
	// Before m.Run, so a cold build of kube-apiserver and etcd (minutes) does
	// not count against the test timeout; a cached one is found at once.
	if _, err := kubeenv.EnsureBinaries(context.Background()); err != nil {
		fmt.Fprintf(os.Stderr, "k8s: kube-apiserver and etcd: %v\n", err)
		os.Exit(1)
	}
	// istiod and istio-cni, the peers of TestIstioAmbient: built once with
	// hack/build-istio.sh into its cache (or found there).
	dir, err := harness.IstioBinDir(context.Background())
	if err != nil {
		fmt.Fprintf(os.Stderr, "k8s: %v\n", err)
		os.Exit(1)
	}
	os.Setenv(harness.EnvIstioBinDir, dir)
	// istio-cni's node agent sees the host's namespaces through a bind of
	// /run/netns made before its pods' namespaces exist.
	if err := harness.ShareNetnsDir(); err != nil {
		fmt.Fprintf(os.Stderr, "k8s: %v\n", err)
		os.Exit(1)
	}
	harness.Main(m, harness.Options{Packages: harness.AllBinaries()})
}
