package kubeenv

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
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
	// AgentGroup is given AgentRules by GrantAgent too: further users in it
	// (APIServerOptions.Users) are agents of other nodes, each with a
	// credential of its own.
	AgentGroup = "mesh-cni:agents"
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
		return harness.GetOK(ctx, clientURL+"/health")
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
	// auditLog is the audit log's path; "" without APIServerOptions.Audit.
	auditLog string
}

// APIServerOptions adjust the API server for a cluster that runs pods. The
// zero value is the enrollment tests' server: on loopback, with no kubelet
// and no controllers behind it.
type APIServerOptions struct {
	// Address is the IP address the server listens on and advertises as the
	// kubernetes Service's endpoint (none on loopback); default 127.0.0.1.
	Address string
	// Cluster turns on what a cluster with kubelets and a controller manager
	// needs: the ServiceAccount and NodeRestriction admission plugins, Node
	// and RBAC authorization, privileged containers, the kubernetes Service's
	// endpoints, and a client certificate for the server's calls to kubelets
	// (logs, exec), which it reaches at their InternalIP.
	Cluster bool
	// Users are further static-token users, name -> groups (the node's
	// kubelet, the scheduler, the controller manager, kube-proxy).
	Users map[string][]string
	// PriorityAndFairness turns on API Priority and Fairness, as production
	// API servers run (the tests' servers run without it: fewer moving parts).
	PriorityAndFairness bool
	// Audit writes every request's metadata (user, verb, object, response
	// code) to a log that Audit reads: what clients asked, by whom.
	Audit bool
}

// ServiceCIDR is the cluster's Service range; the kubernetes Service takes
// its first address.
const ServiceCIDR = "10.0.0.0/24"

// StartAPIServer runs kube-apiserver on etcd, keeping its objects under a
// prefix of its own so several API servers can share one etcd. It returns once
// /readyz answers ok (bootstrap RBAC roles included).
func StartAPIServer(tb testing.TB, bins Binaries, etcd *Etcd, name string) *APIServer {
	tb.Helper()
	return StartAPIServerWith(tb, bins, etcd, name, APIServerOptions{})
}

// StartAPIServerWith is StartAPIServer with options.
func StartAPIServerWith(tb testing.TB, bins Binaries, etcd *Etcd, name string, opts APIServerOptions) *APIServer {
	tb.Helper()
	address := opts.Address
	if address == "" {
		address = "127.0.0.1"
	}
	ip := net.ParseIP(address)
	if ip == nil {
		tb.Fatalf("API server address %q is not an IP address", address)
	}
	dir := tb.TempDir()
	// The kubernetes Service's cluster IP and names: in-cluster clients
	// (the agent) verify the serving certificate against them.
	pki, err := newPKI(dir, []net.IP{ip, net.IPv4(10, 0, 0, 1)},
		[]string{"kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"})
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
	var csv strings.Builder
	fmt.Fprintf(&csv, "%s,%s,1,\"system:masters\"\n%s,%s,2\n", s.tokens[AdminUser], AdminUser, s.tokens[AgentUser], AgentUser)
	users := make([]string, 0, len(opts.Users))
	for u := range opts.Users {
		users = append(users, u)
	}
	sort.Strings(users)
	for i, u := range users {
		s.tokens[u] = randomToken()
		fmt.Fprintf(&csv, "%s,%s,%d,\"%s\"\n", s.tokens[u], u, i+3, strings.Join(opts.Users[u], ","))
	}
	if err := os.WriteFile(tokenFile, []byte(csv.String()), 0o600); err != nil {
		tb.Fatal(err)
	}
	port := freePortOn(tb, address)
	s.URL = "https://" + net.JoinHostPort(address, strconv.Itoa(port))
	s.args = []string{
		"--etcd-servers", etcd.URL,
		"--etcd-prefix", "/registry-" + name,
		"--bind-address", address,
		"--advertise-address", address,
		"--secure-port", strconv.Itoa(port),
		"--cert-dir", filepath.Join(dir, "certs"),
		"--tls-cert-file", pki.CertFile,
		"--tls-private-key-file", pki.KeyFile,
		"--token-auth-file", tokenFile,
		"--anonymous-auth=false",
		"--service-account-issuer", "https://kubernetes.default.svc",
		"--service-account-key-file", pki.SAKey,
		"--service-account-signing-key-file", pki.SAKey,
		"--service-cluster-ip-range", ServiceCIDR,
		"--enable-priority-and-fairness=" + strconv.FormatBool(opts.PriorityAndFairness),
		"--profiling=false",
		"--v", "1",
	}
	if opts.Audit {
		s.auditLog = filepath.Join(dir, "audit.log")
		policy := filepath.Join(dir, "audit-policy.yaml")
		if err := os.WriteFile(policy, []byte(auditPolicy), 0o600); err != nil {
			tb.Fatal(err)
		}
		s.args = append(s.args, "--audit-policy-file", policy, "--audit-log-path", s.auditLog,
			"--audit-log-format", "json", "--audit-log-mode", "blocking", "--audit-log-maxsize", "0")
	}
	if opts.Cluster {
		kubeletCert, kubeletKey, err := pki.issueClient(dir, "kubelet-client", "kube-apiserver-kubelet-client", []string{"system:masters"})
		if err != nil {
			tb.Fatal(err)
		}
		s.args = append(s.args,
			"--authorization-mode", "Node,RBAC",
			"--enable-admission-plugins", "NodeRestriction",
			"--allow-privileged=true",
			"--kubelet-client-certificate", kubeletCert,
			"--kubelet-client-key", kubeletKey,
			"--kubelet-preferred-address-types", "InternalIP",
		)
		if ip.IsLoopback() {
			// The kubernetes Service cannot point at loopback (the endpoint
			// reconciler refuses to start); a cluster on loopback has no
			// in-cluster clients to route there anyway.
			s.args = append(s.args, "--endpoint-reconciler-type", "none")
		}
	} else {
		s.args = append(s.args,
			"--authorization-mode", "RBAC",
			// No controller manager makes the default service account, and
			// the pods are never run by a kubelet.
			"--disable-admission-plugins", "ServiceAccount",
			// Nothing routes to the advertised loopback address; the
			// endpoint reconciler has nothing useful to do.
			"--endpoint-reconciler-type", "none",
		)
	}
	s.Start(tb)
	return s
}

// CAFile is the cluster CA's certificate (PEM): what kubelets trust for
// client certificates and the controller manager publishes to pods.
func (s *APIServer) CAFile() string { return s.pki.CACertFile }

// ServiceAccountKeyFile is the service-account signing key (PEM).
func (s *APIServer) ServiceAccountKeyFile() string { return s.pki.SAKey }

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

// GrantAgent gives AgentUser and AgentGroup the AgentRules, cluster-wide.
func (s *APIServer) GrantAgent(tb testing.TB) {
	tb.Helper()
	s.grant(tb, "mesh-agent", AgentRules(),
		rbacv1.Subject{APIGroup: rbacv1.GroupName, Kind: rbacv1.UserKind, Name: AgentUser},
		rbacv1.Subject{APIGroup: rbacv1.GroupName, Kind: rbacv1.GroupKind, Name: AgentGroup})
}

// grant creates the ClusterRole name with rules and binds it to subjects.
func (s *APIServer) grant(tb testing.TB, name string, rules []rbacv1.PolicyRule, subjects ...rbacv1.Subject) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	admin := s.Client(tb, AdminUser)
	if _, err := admin.RbacV1().ClusterRoles().Create(ctx, &rbacv1.ClusterRole{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Rules:      rules,
	}, metav1.CreateOptions{}); err != nil {
		tb.Fatalf("create ClusterRole %s: %v", name, err)
	}
	if _, err := admin.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: name},
		Subjects:   subjects,
	}, metav1.CreateOptions{}); err != nil {
		tb.Fatalf("create ClusterRoleBinding %s: %v", name, err)
	}
}

// pollUntil calls probe every 100 ms until it succeeds, the process exits or
// ctx ends.
func pollUntil(ctx context.Context, proc *harness.Process, probe func(context.Context) error) error {
	return harness.PollUntil(ctx, proc, 100*time.Millisecond, probe)
}

// freePort asks the kernel for a free loopback TCP port. It is released before
// the server binds it; the window is small and ports are not reused at once.
func freePort(tb testing.TB) int {
	tb.Helper()
	return freePortOn(tb, "127.0.0.1")
}

// freePortOn is freePort on another local address.
func freePortOn(tb testing.TB, address string) int {
	tb.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(address, "0"))
	if err != nil {
		tb.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}
