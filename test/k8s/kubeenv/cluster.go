package kubeenv

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/mesh-cni/mesh-cni/test/harness"
)

// Users the API server knows, by static bearer token.
const (
	// AdminUser is in system:masters: the test's own client.
	AdminUser = "mesh-e2e-admin"
	// AgentUser is the agent's identity, given only AgentRules by GrantAgent.
	AgentUser = "system:serviceaccount:mesh-cni:mesh-agent"
)

// startTimeout bounds the start of etcd or kube-apiserver (bootstrap included)
// on a busy two-core machine.
const startTimeout = 3 * time.Minute

// AgentRules are what the agent's Kubernetes enrollment source needs: the
// least-privilege ClusterRole the tests run the agent with.
func AgentRules() []rbacv1.PolicyRule {
	return []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get", "list", "watch", "patch"}},
		{APIGroups: []string{""}, Resources: []string{"namespaces"}, Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{""}, Resources: []string{"events"}, Verbs: []string{"create"}},
	}
}

// Etcd is an etcd process serving plain HTTP on loopback.
type Etcd struct {
	URL  string
	Proc *harness.Process
}

// StartEtcd runs etcd with its data in a temporary directory, on loopback only,
// until the test ends.
func StartEtcd(tb testing.TB, bins Binaries) *Etcd {
	tb.Helper()
	dir := tb.TempDir()
	client, peer := freePort(tb), freePort(tb)
	clientURL := fmt.Sprintf("http://127.0.0.1:%d", client)
	peerURL := fmt.Sprintf("http://127.0.0.1:%d", peer)
	proc := harness.StartProcess(tb, harness.ProcessOptions{
		Path: bins.Etcd(),
		Name: "etcd",
		Args: []string{
			"--name", "default",
			"--data-dir", filepath.Join(dir, "data"),
			"--listen-client-urls", clientURL,
			"--advertise-client-urls", clientURL,
			"--listen-peer-urls", peerURL,
			"--initial-advertise-peer-urls", peerURL,
			"--initial-cluster", "default=" + peerURL,
			"--log-level", "warn",
			// A test's data need not survive a power cut.
			"--unsafe-no-fsync",
		},
	})
	e := &Etcd{URL: clientURL, Proc: proc}
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	err := pollUntil(ctx, proc, func(ctx context.Context) error {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, clientURL+"/health", nil)
		if err != nil {
			return err
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("etcd /health: %s", resp.Status)
		}
		return nil
	})
	if err != nil {
		tb.Fatalf("etcd did not start: %v", err)
	}
	return e
}

// APIServer is a kube-apiserver process on loopback, with its own certificates
// and static tokens, RBAC authorization and no anonymous access. It can be
// stopped and started again (same port, same etcd data).
type APIServer struct {
	URL    string
	Proc   *harness.Process
	bins   Binaries
	args   []string
	pki    *pki
	tokens map[string]string
	name   string
}

// StartAPIServer runs kube-apiserver on etcd, keeping its objects under a
// prefix of its own so several API servers can share one etcd. It returns once
// /readyz answers ok (bootstrap RBAC roles included).
func StartAPIServer(tb testing.TB, bins Binaries, etcd *Etcd, name string) *APIServer {
	tb.Helper()
	dir := tb.TempDir()
	pki, err := newPKI(dir)
	if err != nil {
		tb.Fatalf("api server certificates: %v", err)
	}
	s := &APIServer{
		bins:   bins,
		pki:    pki,
		name:   name,
		tokens: map[string]string{AdminUser: randomToken(), AgentUser: randomToken()},
	}
	tokenFile := filepath.Join(dir, "tokens.csv")
	csv := fmt.Sprintf("%s,%s,1,\"system:masters\"\n%s,%s,2\n", s.tokens[AdminUser], AdminUser, s.tokens[AgentUser], AgentUser)
	if err := os.WriteFile(tokenFile, []byte(csv), 0o600); err != nil {
		tb.Fatal(err)
	}
	port := freePort(tb)
	s.URL = fmt.Sprintf("https://127.0.0.1:%d", port)
	s.args = []string{
		"--etcd-servers", etcd.URL,
		"--etcd-prefix", "/registry-" + name,
		"--bind-address", "127.0.0.1",
		"--advertise-address", "127.0.0.1",
		"--secure-port", strconv.Itoa(port),
		"--cert-dir", filepath.Join(dir, "certs"),
		"--tls-cert-file", pki.CertFile,
		"--tls-private-key-file", pki.KeyFile,
		"--token-auth-file", tokenFile,
		"--anonymous-auth=false",
		"--authorization-mode", "RBAC",
		"--service-account-issuer", "https://kubernetes.default.svc",
		"--service-account-key-file", pki.SAKey,
		"--service-account-signing-key-file", pki.SAKey,
		"--service-cluster-ip-range", "10.0.0.0/24",
		// No controller manager makes the default service account, and the
		// pods are never run by a kubelet.
		"--disable-admission-plugins", "ServiceAccount",
		// Nothing routes to the advertised loopback address; the endpoint
		// reconciler has nothing useful to do.
		"--endpoint-reconciler-type", "none",
		"--enable-priority-and-fairness=false",
		"--profiling=false",
		"--v", "1",
	}
	s.Start(tb)
	return s
}

// Start runs the API server process (again) and waits until it is ready.
func (s *APIServer) Start(tb testing.TB) {
	tb.Helper()
	s.Proc = harness.StartProcess(tb, harness.ProcessOptions{Path: s.bins.APIServer(), Args: s.args, Name: "kube-apiserver-" + s.name})
	admin := s.Client(tb, AdminUser)
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	err := pollUntil(ctx, s.Proc, func(ctx context.Context) error {
		body, err := admin.Discovery().RESTClient().Get().AbsPath("/readyz").Do(ctx).Raw()
		if err != nil {
			return fmt.Errorf("%w: %s", err, body)
		}
		return nil
	})
	if err != nil {
		tb.Fatalf("kube-apiserver did not become ready: %v", err)
	}
}

// Stop kills the API server process, as a crash or a lost node would: clients
// see connections refused from then on. (A SIGTERM'd kube-apiserver can sit
// for minutes after it stopped listening, which tests gain nothing from.)
func (s *APIServer) Stop(tb testing.TB) {
	tb.Helper()
	if err := s.Proc.Kill(); err != nil {
		tb.Fatalf("stop kube-apiserver: %v", err)
	}
}

// RestConfig is a client configuration for user, trusting only the cluster's CA.
func (s *APIServer) RestConfig(user string) *rest.Config {
	return &rest.Config{
		Host:            s.URL,
		BearerToken:     s.tokens[user],
		TLSClientConfig: rest.TLSClientConfig{CAData: s.pki.CACert},
		UserAgent:       "mesh-cni-e2e/" + user,
		QPS:             50,
		Burst:           100,
	}
}

// Client is a clientset for user.
func (s *APIServer) Client(tb testing.TB, user string) *kubernetes.Clientset {
	tb.Helper()
	c, err := kubernetes.NewForConfig(s.RestConfig(user))
	if err != nil {
		tb.Fatal(err)
	}
	return c
}

// WriteKubeconfig writes a kubeconfig for user to path with mode 0600 (the CA
// and the token inline: the file is the whole credential) and returns path.
func (s *APIServer) WriteKubeconfig(tb testing.TB, user, path string) string {
	tb.Helper()
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["test"] = &clientcmdapi.Cluster{Server: s.URL, CertificateAuthorityData: s.pki.CACert}
	cfg.AuthInfos[user] = &clientcmdapi.AuthInfo{Token: s.tokens[user]}
	cfg.Contexts["test"] = &clientcmdapi.Context{Cluster: "test", AuthInfo: user}
	cfg.CurrentContext = "test"
	data, err := clientcmd.Write(*cfg)
	if err != nil {
		tb.Fatal(err)
	}
	if err := os.WriteFile(path, data, 0o600); err != nil {
		tb.Fatal(err)
	}
	return path
}

// Token is user's bearer token (for asserting it appears nowhere it should not).
func (s *APIServer) Token(user string) string { return s.tokens[user] }

// GrantAgent gives AgentUser the AgentRules, cluster-wide.
func (s *APIServer) GrantAgent(tb testing.TB) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	admin := s.Client(tb, AdminUser)
	_, err := admin.RbacV1().ClusterRoles().Create(ctx, &rbacv1.ClusterRole{
		ObjectMeta: metav1.ObjectMeta{Name: "mesh-agent"},
		Rules:      AgentRules(),
	}, metav1.CreateOptions{})
	if err != nil {
		tb.Fatalf("create agent ClusterRole: %v", err)
	}
	_, err = admin.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "mesh-agent"},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "mesh-agent"},
		Subjects:   []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.UserKind, Name: AgentUser}},
	}, metav1.CreateOptions{})
	if err != nil {
		tb.Fatalf("create agent ClusterRoleBinding: %v", err)
	}
}

// pollUntil calls probe every 100 ms until it succeeds, the process exits or
// ctx ends.
func pollUntil(ctx context.Context, proc *harness.Process, probe func(context.Context) error) error {
	var last error
	for {
		pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		last = probe(pctx)
		cancel()
		if last == nil {
			return nil
		}
		select {
		case <-proc.Done():
			return fmt.Errorf("the process exited (last probe: %v); output:\n%s", last, tail(proc.Output(), 4000))
		case <-ctx.Done():
			return fmt.Errorf("%w (last probe: %v); output:\n%s", ctx.Err(), last, tail(proc.Output(), 4000))
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "..." + s[len(s)-n:]
}

// freePort asks the kernel for a free loopback TCP port. It is released before
// the server binds it; the window is small and ports are not reused at once.
func freePort(tb testing.TB) int {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}
