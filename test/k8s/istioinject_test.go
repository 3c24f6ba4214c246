package k8s

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
	jsonpatch "gopkg.in/evanphx/json-patch.v4"
	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/yaml"

	"github.com/mesh-cni/mesh-cni/internal/agentcli"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/node/nodeenv"
	"github.com/mesh-cni/mesh-cni/test/proxy"
)

// Istio's sidecar injection, as a cluster with istio-cni runs it: istiod's
// own injector, configured by its chart with pilot.cni.enabled (the
// unprivileged istio-validation init container in place of istio-init).

// injectorConfigMaps renders istiod's chart (hack/build-istio.sh keeps it
// beside the binaries) with istio-cni on, as an operator installs it, and
// returns the ConfigMaps its injector reads: its templates and values, and
// the mesh configuration, dual-stack.
func injectorConfigMaps(t *testing.T) []*corev1.ConfigMap {
	t.Helper()
	dir := os.Getenv(nodeenv.EnvHelmDir)
	if dir == "" {
		t.Fatalf("$%s is not set: hack/peers.sh builds helm", nodeenv.EnvHelmDir)
	}
	helm := filepath.Join(dir, "helm")
	chart := filepath.Join(istioBins(t), "istio-discovery")
	// The node's pods have both families: Istio's dual-stack setting, as its
	// documentation has operators set it.
	out, err := exec.Command(helm, "template", "istiod", chart, "-n", "istio-system", "--set", "pilot.cni.enabled=true",
		"--set-string", "meshConfig.defaultConfig.proxyMetadata.ISTIO_DUAL_STACK=true").Output()
	if err != nil {
		t.Fatalf("helm template %s (helm from $%s): %v", chart, nodeenv.EnvHelmDir, err)
	}
	var cms []*corev1.ConfigMap
	for doc := range strings.SplitSeq(string(out), "\n---") {
		var meta struct {
			Kind     string            `json:"kind"`
			Metadata metav1.ObjectMeta `json:"metadata"`
		}
		if err := yaml.Unmarshal([]byte(doc), &meta); err != nil || meta.Kind != "ConfigMap" {
			continue
		}
		if meta.Metadata.Name != "istio-sidecar-injector" && meta.Metadata.Name != "istio" {
			continue
		}
		cm := &corev1.ConfigMap{}
		if err := yaml.Unmarshal([]byte(doc), cm); err != nil {
			t.Fatal(err)
		}
		cms = append(cms, cm)
	}
	if len(cms) != 2 {
		t.Fatalf("istiod's chart rendered %d of its injector's two ConfigMaps", len(cms))
	}
	return cms
}

// inject asks istiod's injection webhook for pod, as the API server would at
// its creation, and returns the pod with its answer applied. The webhook's
// certificate is checked against istiod's root, which istiod publishes.
func (n *ambientNode) inject(t *testing.T, pod *corev1.Pod) *corev1.Pod {
	t.Helper()
	ctx := apiContext(t)
	var root []byte
	fixtures.WaitFor(t, time.Minute, "istiod's root certificate published", func() bool {
		cm, err := n.admin.CoreV1().ConfigMaps("istio-system").Get(ctx, "istio-ca-root-cert", metav1.GetOptions{})
		if err != nil {
			return false
		}
		root = []byte(cm.Data["root-cert.pem"])
		return len(root) > 0
	})
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(root) {
		t.Fatal("istiod's root certificate does not parse")
	}
	client := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: pool, ServerName: "istiod.istio-system.svc", MinVersion: tls.VersionTLS12}}}
	raw, err := json.Marshal(pod)
	if err != nil {
		t.Fatal(err)
	}
	review := admissionv1.AdmissionReview{
		TypeMeta: metav1.TypeMeta{APIVersion: "admission.k8s.io/v1", Kind: "AdmissionReview"},
		Request: &admissionv1.AdmissionRequest{
			UID: types.UID("inject-" + pod.Name), Kind: metav1.GroupVersionKind{Version: "v1", Kind: "Pod"},
			Resource: metav1.GroupVersionResource{Version: "v1", Resource: "pods"}, Namespace: pod.Namespace, Name: pod.Name,
			Operation: admissionv1.Create, Object: runtime.RawExtension{Raw: raw},
		},
	}
	body, err := json.Marshal(review)
	if err != nil {
		t.Fatal(err)
	}
	var resp *http.Response
	fixtures.WaitFor(t, time.Minute, "istiod's injector answering", func() bool {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, n.injector, bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/json")
		resp, err = client.Do(req)
		if err != nil {
			t.Logf("injector: %v", err)
			return false
		}
		if resp.StatusCode != http.StatusOK {
			resp.Body.Close()
			return false
		}
		return true
	})
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	var answer admissionv1.AdmissionReview
	if err := json.Unmarshal(b, &answer); err != nil {
		t.Fatalf("the injector's answer: %v\n%s", err, b)
	}
	if r := answer.Response; r == nil || !r.Allowed || len(r.Patch) == 0 {
		t.Fatalf("the injector did not inject: %s", b)
	}
	patch, err := jsonpatch.DecodePatch(answer.Response.Patch)
	if err != nil {
		t.Fatal(err)
	}
	patched, err := patch.Apply(raw)
	if err != nil {
		t.Fatal(err)
	}
	out := &corev1.Pod{}
	if err := json.Unmarshal(patched, out); err != nil {
		t.Fatal(err)
	}
	return out
}

// container is the named container of the pod, init or not (nil: none).
func container(p *corev1.Pod, name string) *corev1.Container {
	for _, list := range [][]corev1.Container{p.Spec.InitContainers, p.Spec.Containers} {
		for i := range list {
			if list[i].Name == name {
				return &list[i]
			}
		}
	}
	return nil
}

// literalEnv is a container's environment as its runtime would set it where
// it is given literally (valueFrom: the downward API, left out).
func literalEnv(c *corev1.Container) []string {
	var env []string
	for _, e := range c.Env {
		if e.ValueFrom == nil {
			env = append(env, e.Name+"="+e.Value)
		}
	}
	return env
}

// containerProc is where a container's processes run: the pod's network
// namespace, the container's cgroup, its uid.
type containerProc struct {
	netns, cgroup string
	uid           uint32
}

func (c containerProc) credential() *syscall.Credential {
	return &syscall.Credential{Uid: c.uid, Gid: c.uid}
}

// say connects from the container to target (a shell's /dev/tcp, as the
// container's own process would), sends a line and returns the first line
// it gets back: a captured connection reaches a proxy that echoes it, one
// that is not the server, which answers "FROM <peer>".
func (c containerProc) say(t *testing.T, ctx context.Context, target string) string {
	t.Helper()
	host, port, err := net.SplitHostPort(target)
	if err != nil {
		t.Fatal(err)
	}
	script := fmt.Sprintf("exec 3<>/dev/tcp/%s/%s && echo hello >&3 && head -n 1 <&3", host, port)
	p := harness.StartProcess(t, harness.ProcessOptions{Path: "timeout", Args: []string{"10", "bash", "-c", script},
		NetNSPath: c.netns, Cgroup: c.cgroup, Credential: c.credential(), Dir: "/", Name: "connect"})
	if err := p.Wait(ctx); err != nil {
		return "ERR " + strings.TrimSpace(p.Output())
	}
	return strings.TrimSpace(p.Output())
}

// echoProxy runs the reference proxy as a sidecar container: it echoes what
// it is sent and records what it accepted (outbound on 15001, inbound on
// 15006), in a file the container's uid may write.
func echoProxy(t *testing.T, c containerProc) (records string) {
	t.Helper()
	dir, err := os.MkdirTemp("", "mesh-sidecar-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	records = filepath.Join(dir, "proxy.jsonl")
	p := harness.StartProcess(t, harness.ProcessOptions{Path: harness.Bins(t).Path("refproxy"), Args: []string{"-echo", "-record", records},
		NetNSPath: c.netns, Cgroup: c.cgroup, Credential: c.credential(), Dir: "/", Name: "istio-proxy"})
	// A pod's first connection must not beat its proxy's listen: a capture
	// to a port nobody listens on yet is refused like no capture at all.
	fixtures.WaitFor(t, 10*time.Second, "the sidecar listening on its outbound and inbound ports", func() bool {
		return listening(p.Pid(), proxy.DefaultOutboundPort) && listening(p.Pid(), proxy.DefaultInboundPort)
	})
	return records
}

// listening reports whether a TCP socket listens on port in the network
// namespace of process pid, asked of the kernel's socket diagnostics there.
func listening(pid int, port uint16) bool {
	ns, err := netns.GetFromPid(pid)
	if err != nil {
		return false
	}
	defer ns.Close()
	// The handle opens its sock_diag socket in ns only when asked for that
	// family; otherwise the dump would read the caller's namespace.
	h, err := netlink.NewHandleAt(ns, unix.NETLINK_INET_DIAG)
	if err != nil {
		return false
	}
	defer h.Close()
	for _, family := range []uint8{unix.AF_INET, unix.AF_INET6} {
		socks, _ := h.SocketDiagTCP(family)
		for _, s := range socks {
			if s.ID.SourcePort == port && s.State == netlink.TCP_LISTEN {
				return true
			}
		}
	}
	return false
}

// reachesSidecar checks that c's connect to target reaches the sidecar that
// records into records (echoProxy), on its dir port, with target as the
// original destination.
func reachesSidecar(t *testing.T, ctx context.Context, records, what string, c containerProc, dir proxy.Direction, target string) {
	t.Helper()
	before := len(readRecords[proxy.Record](t, records))
	if got := c.say(t, ctx, target); got != "hello" {
		t.Errorf("%s to %s: %q, want the sidecar's echo", what, target, got)
		return
	}
	var recs []proxy.Record
	fixtures.WaitFor(t, 10*time.Second, "the sidecar's record of a connection to "+target, func() bool {
		recs = readRecords[proxy.Record](t, records)
		return len(recs) > before
	})
	if r := recs[before]; r.Direction != dir || r.OriginalDst.String() != target {
		t.Errorf("%s: the sidecar recorded %s to %s, want %s to %s", what, r.Direction, r.OriginalDst, dir, target)
	}
}

// reachesServer checks that c's connect to target reaches its server (a
// peerServer, answering "FROM <peer>"), past any sidecar.
func reachesServer(t *testing.T, ctx context.Context, what string, c containerProc, target string) {
	t.Helper()
	if got := c.say(t, ctx, target); !strings.HasPrefix(got, "FROM ") {
		t.Errorf("%s to %s: %q, want the server itself", what, target, got)
	}
}

// sidecarRule is what mesh-agent status says the pod's sidecar is known by.
func sidecarRule(t *testing.T, a *agent, uid types.UID) string {
	t.Helper()
	out, err := exec.Command(harness.Bins(t).Path("mesh-agent"), "status", "-o", "json", "--socket", a.Socket, "--bpffs-root", a.BPFFS).Output()
	if err != nil {
		t.Fatalf("mesh-agent status: %v\n%s", err, out)
	}
	var st agentcli.NodeStatus
	if err := json.Unmarshal(out, &st); err != nil {
		t.Fatal(err)
	}
	for _, ps := range st.Pods {
		if ps.UID == string(uid) {
			return ps.Proxy
		}
	}
	t.Fatalf("status lists no pod %s", uid)
	return ""
}
