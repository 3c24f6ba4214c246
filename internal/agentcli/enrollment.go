package agentcli

import (
	"context"
	"flag"
	"fmt"
	"os"
	"time"

	"go.uber.org/zap"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/mesh-cni/mesh-cni/internal/agent"
	"github.com/mesh-cni/mesh-cni/internal/enroll"
)

// Enrollment sources of --enrollment.
const (
	EnrollmentAll        = "all"
	EnrollmentFile       = "file"
	EnrollmentKubernetes = "kubernetes"
)

// DefaultPolicyFile is where --enrollment=file reads its policy (a ConfigMap
// mounted as a directory in the DaemonSet).
const DefaultPolicyFile = "/etc/mesh-cni/enrollment.yaml"

// The agent's client limits: client-go's defaults (5 per second, 10 at once)
// would queue the writes of a node's burst of pod starts for tens of seconds.
// A pod start outside the mesh makes no request, a meshed one one write (and a
// read when the agent's watch has not delivered the pod yet); API Priority and
// Fairness on the server, not this limit, is what protects it from a fleet.
const (
	DefaultAPIQPS   = 20
	DefaultAPIBurst = 110
)

// enrollOptions are the flags choosing which pods join the mesh.
type enrollOptions struct {
	mode       string
	policyFile string
	profile    string
	kubeconfig string
	nodeName   string
	apiTimeout time.Duration
	apiQPS     float64
	apiBurst   int
	// apiStartJitter bounds the random delay before the first list and watch.
	apiStartJitter time.Duration
	// startupTaint is the taint key removed from the node once the agent
	// is ready (startuptaint.go); it shares the credential and the node.
	startupTaint string
}

func (e *enrollOptions) register(fs *flag.FlagSet) {
	fs.StringVar(&e.mode, "enrollment", EnrollmentAll, "which pods join the mesh: file (the --policy-file), kubernetes (namespace and pod labels, read with the agent's own credentials) or all (every pod that reaches the agent: for tests and demos; production should choose file or kubernetes)")
	fs.StringVar(&e.policyFile, "policy-file", DefaultPolicyFile, "enrollment policy file of --enrollment=file; watched, reloaded on change, an invalid edit is logged and the last good policy kept")
	fs.StringVar(&e.profile, "selector-profile", enroll.ProfileMeshCNI, "which labels enroll and opt out pods: mesh-cni (mesh-cni.io/dataplane-mode=enabled|disabled) or istio (istio.io/dataplane-mode=ambient|none)")
	fs.StringVar(&e.kubeconfig, "kubeconfig", "", "kubeconfig of --enrollment=kubernetes and --startup-taint (empty: the in-cluster service account); only the agent reads it, keep it mode 0600")
	fs.StringVar(&e.nodeName, "node-name", "", "this node's name, scoping --enrollment=kubernetes to its pods and naming the node --startup-taint is removed from (default: $NODE_NAME)")
	fs.StringVar(&e.startupTaint, "startup-taint", "", "remove every taint with this key (e.g. mesh-cni.io/agent-not-ready), any value and effect, from this node once the agent is ready, so that pods scheduled there start meshed; empty: off")
	fs.Float64Var(&e.apiQPS, "api-qps", DefaultAPIQPS, "the agent's sustained rate of API requests per second (client-go's default is 5)")
	fs.IntVar(&e.apiBurst, "api-burst", DefaultAPIBurst, "how many API requests the agent may make at once above --api-qps: sized so that a node's burst of pod starts (the kubelet's default max-pods is 110) is not queued behind the rate limit")
	fs.DurationVar(&e.apiStartJitter, "api-start-jitter", enroll.DefaultStartJitter, "a random delay of up to this long before the agent's first list and watch, so that agents restarted together do not reach the API server in the same instant (0: none)")
	fs.DurationVar(&e.apiTimeout, "api-timeout", enroll.DefaultAPITimeout, "how long an ADD waits for the API server when its pod is not cached yet before failing with the reason (keep it below --gate-timeout)")
}

// policy starts the chosen enrollment source; it runs until ctx is cancelled.
func (e enrollOptions) policy(ctx context.Context, log *zap.Logger) (agent.Policy, error) {
	log = log.Named("enrollment")
	if _, err := enroll.ProfileSelectors(e.profile); err != nil {
		return nil, fmt.Errorf("--selector-profile: %w", err)
	}
	switch e.mode {
	case EnrollmentAll:
		log.Info("every pod that reaches the agent is enrolled (--enrollment=all); choose file or kubernetes to select pods")
		return agent.EnrollAll{}, nil
	case EnrollmentFile:
		src, err := enroll.StartFileSource(ctx, enroll.FileConfig{Path: e.policyFile, Profile: e.profile, Logger: log})
		if err != nil {
			return nil, fmt.Errorf("--policy-file: %w", err)
		}
		return src, nil
	case EnrollmentKubernetes:
		return e.kubeSource(ctx, log)
	default:
		return nil, fmt.Errorf("--enrollment=%q: want %s, %s or %s", e.mode, EnrollmentFile, EnrollmentKubernetes, EnrollmentAll)
	}
}

// node is this node's name: --node-name, else $NODE_NAME; what names the
// flag that needs it.
func (e enrollOptions) node(what string) (string, error) {
	node := e.nodeName
	if node == "" {
		node = os.Getenv("NODE_NAME")
	}
	if node == "" {
		return "", fmt.Errorf("%s needs --node-name or $NODE_NAME (the downward API's spec.nodeName)", what)
	}
	return node, nil
}

// client is the agent's Kubernetes client, as the agent of node; what names
// the flag that needs it.
func (e enrollOptions) client(log *zap.Logger, node, what string) (kubernetes.Interface, *rest.Config, error) {
	cfg, err := e.restConfig(log, what)
	if err != nil {
		return nil, nil, err
	}
	cfg.UserAgent = "mesh-agent/" + node
	cfg.QPS, cfg.Burst = float32(e.apiQPS), e.apiBurst
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, nil, fmt.Errorf("kubernetes client: %w", err)
	}
	return client, cfg, nil
}

func (e enrollOptions) kubeSource(ctx context.Context, log *zap.Logger) (agent.Policy, error) {
	node, err := e.node("--enrollment=kubernetes")
	if err != nil {
		return nil, err
	}
	if e.apiTimeout <= 0 {
		return nil, fmt.Errorf("--api-timeout must be positive")
	}
	if e.apiQPS <= 0 || e.apiBurst <= 0 || e.apiStartJitter < 0 {
		return nil, fmt.Errorf("--api-qps and --api-burst must be positive, --api-start-jitter not negative")
	}
	sel, err := enroll.ProfileSelectors(e.profile)
	if err != nil {
		return nil, err
	}
	client, cfg, err := e.client(log, node, "--enrollment=kubernetes")
	if err != nil {
		return nil, err
	}
	src, err := enroll.StartKubeSource(ctx, enroll.KubeConfig{
		Client: client, NodeName: node, Selectors: sel, APITimeout: e.apiTimeout, StartJitter: e.apiStartJitter, Logger: log,
	})
	if err != nil {
		return nil, err
	}
	log.Info("enrollment follows Kubernetes labels", zap.String("node", node), zap.String("profile", sel.Profile), zap.String("api_host", cfg.Host))
	return src, nil
}

func (e enrollOptions) restConfig(log *zap.Logger, what string) (*rest.Config, error) {
	if e.kubeconfig == "" {
		cfg, err := rest.InClusterConfig()
		if err != nil {
			return nil, fmt.Errorf("%s without --kubeconfig needs the in-cluster service account: %w", what, err)
		}
		return cfg, nil
	}
	if st, err := os.Stat(e.kubeconfig); err == nil && st.Mode().Perm()&0o077 != 0 {
		// The credential is the agent's alone; nothing else on the node,
		// the plugin included, is meant to read it.
		log.Warn("--kubeconfig is readable by other users than its owner: make it mode 0600", zap.String("kubeconfig", e.kubeconfig), zap.Stringer("mode", st.Mode().Perm()))
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", e.kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("--kubeconfig %s: %w", e.kubeconfig, err)
	}
	return cfg, nil
}
