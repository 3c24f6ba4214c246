package nodeenv

import (
	"path/filepath"
	"testing"

	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/k8s/kubeenv"
)

// The control plane's and the node's identities, as the bootstrap RBAC
// policy of kube-apiserver names them (each has its ClusterRole bound
// already; the kubelet is authorized by the Node authorizer).
const (
	schedulerUser         = "system:kube-scheduler"
	controllerManagerUser = "system:kube-controller-manager"
	proxyUser             = "system:kube-proxy"
)

func nodeUser(node string) string { return "system:node:" + node }

// ControlPlane is the cluster's control plane on the host: etcd,
// kube-apiserver on the host end of the node's veth pair, kube-scheduler and
// kube-controller-manager.
type ControlPlane struct {
	Etcd              *kubeenv.Etcd
	API               *kubeenv.APIServer
	Scheduler         *harness.Process
	ControllerManager *harness.Process
	dir               string
}

func startControlPlane(tb testing.TB, bins Binaries, m *Machine) *ControlPlane {
	tb.Helper()
	c := &ControlPlane{dir: tb.TempDir()}
	c.Etcd = kubeenv.StartEtcd(tb, bins.Kube)
	c.API = kubeenv.StartAPIServerWith(tb, bins.Kube, c.Etcd, m.Name, kubeenv.APIServerOptions{
		Address: m.HostIP.String(),
		Cluster: true,
		Users: map[string][]string{
			nodeUser(m.Name):      {"system:nodes"},
			schedulerUser:         nil,
			controllerManagerUser: nil,
			proxyUser:             nil,
		},
	})
	// Neither serves its own port (--secure-port=0): nothing here scrapes
	// them, and the tests run next to others on the host's ports.
	c.Scheduler = harness.StartProcess(tb, harness.ProcessOptions{
		Path: filepath.Join(bins.KubeNode, "kube-scheduler"),
		Name: "kube-scheduler",
		Args: []string{
			"--kubeconfig", c.kubeconfig(tb, schedulerUser),
			"--secure-port=0",
			"--leader-elect=false",
			"--v=1",
		},
	})
	c.ControllerManager = harness.StartProcess(tb, harness.ProcessOptions{
		Path: filepath.Join(bins.KubeNode, "kube-controller-manager"),
		Name: "kube-controller-manager",
		Args: []string{
			"--kubeconfig", c.kubeconfig(tb, controllerManagerUser),
			"--secure-port=0",
			"--leader-elect=false",
			// Each controller with its own service account, as kubeadm runs it:
			// the controller manager's own role covers only that.
			"--use-service-account-credentials",
			"--service-account-private-key-file", c.API.ServiceAccountKeyFile(),
			// Published to every namespace as kube-root-ca.crt, which the
			// agent's projected token volume carries.
			"--root-ca-file", c.API.CAFile(),
			// No certificates to sign: kubelet has its token, and serves a
			// self-signed certificate.
			"--controllers=*,-csrsigning",
			"--v=1",
		},
	})
	return c
}

// kubeconfig writes a kubeconfig for user and returns its path.
func (c *ControlPlane) kubeconfig(tb testing.TB, user string) string {
	tb.Helper()
	return c.API.WriteKubeconfig(tb, user, filepath.Join(c.dir, filepath.Base(user)+".kubeconfig"))
}
