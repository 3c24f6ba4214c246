package nodeenv

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"

	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/k8s/kubeenv"
)

// Environment variables holding directories of prebuilt binaries. When one is
// unset, EnsureBinaries runs its hack/ script, which builds from the Go module
// proxy into a cache outside the repository (or finds the cache filled), and
// sets the variable for later calls and child processes.
const (
	EnvContainerdDir = "MESH_CNI_CONTAINERD_BIN_DIR" // containerd, containerd-shim-runc-v2, ctr, crictl
	EnvKubeNodeDir   = "MESH_CNI_KUBE_NODE_BIN_DIR"  // kubelet, kube-proxy, kube-scheduler, kube-controller-manager, kubectl
	EnvHelmDir       = "MESH_CNI_HELM_BIN_DIR"       // helm
)

// Binaries are the executables a node and its control plane run.
type Binaries struct {
	// Kube holds kube-apiserver and etcd (test/k8s's).
	Kube kubeenv.Binaries
	// Containerd, KubeNode and Helm are directories, see the Env* variables.
	Containerd string
	KubeNode   string
	Helm       string
	// Runc is Debian's runc (apt-get install runc).
	Runc string
}

// containerd and kube are the paths of binaries in those directories.
func (b Binaries) containerd(name string) string { return filepath.Join(b.Containerd, name) }
func (b Binaries) kube(name string) string       { return filepath.Join(b.KubeNode, name) }

// Kubectl is the kubectl built with the cluster, the client the operator steps use.
func (b Binaries) Kubectl() string { return b.kube("kubectl") }

// HelmCLI is the helm client.
func (b Binaries) HelmCLI() string { return filepath.Join(b.Helm, "helm") }

// Ctr and Crictl are containerd's and the CRI's command-line clients.
func (b Binaries) Ctr() string    { return b.containerd("ctr") }
func (b Binaries) Crictl() string { return b.containerd("crictl") }

func (b Binaries) check() error {
	return kubeenv.CheckExecutables(
		b.containerd("containerd"), b.containerd("containerd-shim-runc-v2"), b.Ctr(), b.Crictl(),
		b.kube("kubelet"), b.kube("kube-proxy"), b.kube("kube-scheduler"), b.kube("kube-controller-manager"), b.Kubectl(),
		b.HelmCLI(), b.Runc,
	)
}

// EnsureBinaries finds or builds every binary of the node and its control
// plane. Call it from TestMain, before m.Run: cold builds (minutes each) then
// do not count against the test timeout.
func EnsureBinaries(ctx context.Context) (Binaries, error) {
	var b Binaries
	var err error
	if b.Kube, err = kubeenv.EnsureBinaries(ctx); err != nil {
		return b, err
	}
	for _, d := range []struct {
		env    string
		dst    *string
		script string
		args   []string
	}{
		{EnvContainerdDir, &b.Containerd, "build-containerd.sh", nil},
		{EnvKubeNodeDir, &b.KubeNode, "build-kube.sh", []string{"node"}},
		{EnvHelmDir, &b.Helm, "build-helm.sh", nil},
	} {
		if dir := os.Getenv(d.env); dir != "" {
			*d.dst = dir
			continue
		}
		dir, err := harness.CachedBuild(ctx, d.script, d.args...)
		if err != nil {
			return b, err
		}
		*d.dst = dir
		if err := os.Setenv(d.env, dir); err != nil {
			return b, err
		}
	}
	if b.Runc, err = exec.LookPath("runc"); err != nil {
		return b, fmt.Errorf("runc (apt-get install runc): %w", err)
	}
	if err := b.check(); err != nil {
		return b, fmt.Errorf("node binaries: %w", err)
	}
	return b, nil
}

// FromEnv returns the binaries EnsureBinaries found, for tests.
func FromEnv() (Binaries, error) {
	kube, err := kubeenv.FromEnv()
	if err != nil {
		return Binaries{}, err
	}
	b := Binaries{Kube: kube, Containerd: os.Getenv(EnvContainerdDir), KubeNode: os.Getenv(EnvKubeNodeDir), Helm: os.Getenv(EnvHelmDir)}
	if b.Containerd == "" || b.KubeNode == "" || b.Helm == "" {
		return b, fmt.Errorf("$%s, $%s or $%s is not set: call nodeenv.EnsureBinaries from TestMain", EnvContainerdDir, EnvKubeNodeDir, EnvHelmDir)
	}
	if b.Runc, err = exec.LookPath("runc"); err != nil {
		return b, fmt.Errorf("runc (apt-get install runc): %w", err)
	}
	return b, b.check()
}
