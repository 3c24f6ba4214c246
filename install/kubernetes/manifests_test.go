package kubernetes

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/selection"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"

	"github.com/mesh-cni/mesh-cni/internal/agentcli"
	"github.com/mesh-cni/mesh-cni/internal/cniplugin"
	"github.com/mesh-cni/mesh-cni/internal/enroll"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/k8s/kubeenv"
)

const kustomizationFile = "kustomization.yaml"

// object is one decoded document of a manifest file.
type object struct {
	file  string
	index int
	obj   runtime.Object
}

func (o object) String() string { return fmt.Sprintf("%s document %d", o.file, o.index) }

// strictDecoder decodes YAML or JSON into the typed API objects of the kinds
// the manifests may hold. Unknown fields, fields spelled in another case,
// duplicate keys and kinds outside the scheme are all errors.
func strictDecoder(t *testing.T) runtime.Decoder {
	t.Helper()
	scheme := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{corev1.AddToScheme, appsv1.AddToScheme, rbacv1.AddToScheme, batchv1.AddToScheme, admissionregistrationv1.AddToScheme} {
		if err := add(scheme); err != nil {
			t.Fatalf("build scheme: %v", err)
		}
	}
	return serializer.NewCodecFactory(scheme, serializer.EnableStrict).UniversalDeserializer()
}

// splitDocuments returns the non-empty YAML documents of data.
func splitDocuments(data []byte) ([][]byte, error) {
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	var docs [][]byte
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return docs, nil
		}
		if err != nil {
			return nil, err
		}
		j, err := yaml.YAMLToJSON(doc)
		if err != nil {
			return nil, err
		}
		if string(j) == "null" { // only comments or whitespace
			continue
		}
		docs = append(docs, doc)
	}
}

func decodeStrict(dec runtime.Decoder, doc []byte) (runtime.Object, error) {
	obj, _, err := dec.Decode(doc, nil, nil)
	if err != nil {
		return nil, err
	}
	return obj, nil
}

// manifestFiles returns the YAML files of the directory except the
// kustomization, sorted.
func manifestFiles(t *testing.T) []string {
	t.Helper()
	entries, err := os.ReadDir(".")
	if err != nil {
		t.Fatal(err)
	}
	var files []string
	for _, e := range entries {
		name := e.Name()
		if strings.HasSuffix(name, ".yml") {
			t.Errorf("%s: name manifests *.yaml (the embed pattern and the kustomization check only see those)", name)
		}
		if e.Type().IsRegular() && strings.HasSuffix(name, ".yaml") && name != kustomizationFile {
			files = append(files, name)
		}
	}
	return files
}

// loadObjects decodes every document of every manifest file strictly.
func loadObjects(t *testing.T) []object {
	t.Helper()
	dec := strictDecoder(t)
	var objs []object
	for _, file := range manifestFiles(t) {
		data, err := fs.ReadFile(Manifests(), file)
		if err != nil {
			t.Fatalf("%s is not embedded: %v", file, err)
		}
		docs, err := splitDocuments(data)
		if err != nil {
			t.Fatalf("%s: %v", file, err)
		}
		if len(docs) == 0 {
			t.Errorf("%s holds no object", file)
		}
		for i, doc := range docs {
			obj, err := decodeStrict(dec, doc)
			if err != nil {
				t.Errorf("%s document %d: %v", file, i, err)
				continue
			}
			objs = append(objs, object{file: file, index: i, obj: obj})
		}
	}
	if t.Failed() {
		t.FailNow()
	}
	return objs
}

// only returns the single object of type T, failing unless there is exactly one.
func only[T runtime.Object](t *testing.T, objs []object) T {
	t.Helper()
	var found []T
	for _, o := range objs {
		if v, ok := o.obj.(T); ok {
			found = append(found, v)
		}
	}
	if len(found) != 1 {
		var zero T
		t.Fatalf("want exactly one %T, found %d", zero, len(found))
	}
	return found[0]
}

func TestStrictDecoderRejects(t *testing.T) {
	dec := strictDecoder(t)
	base := "apiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: x\n"
	if _, err := decodeStrict(dec, []byte(base)); err != nil {
		t.Fatalf("valid object rejected: %v", err)
	}
	for name, doc := range map[string]string{
		"unknown field":           base + "automountServiceAccountTokn: true\n",
		"field in the wrong case": base + "AutomountServiceAccountToken: true\n",
		"duplicate key":           base + "automountServiceAccountToken: true\nautomountServiceAccountToken: false\n",
		"kind outside the scheme": "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata:\n  name: x\n",
		"beta version":            "apiVersion: rbac.authorization.k8s.io/v1beta1\nkind: ClusterRole\nmetadata:\n  name: x\n",
		"wrong type":              base + "automountServiceAccountToken: \"yes\"\n",
	} {
		if _, err := decodeStrict(dec, []byte(doc)); err == nil {
			t.Errorf("%s: decoded without error", name)
		}
	}
}

func TestManifestKinds(t *testing.T) {
	objs := loadObjects(t)
	type key struct{ kind, namespace, name string }
	want := []key{
		{"Namespace", "", Namespace},
		{"ServiceAccount", Namespace, ServiceAccount},
		{"ClusterRole", "", "mesh-agent"},
		{"ClusterRoleBinding", "", "mesh-agent"},
		{"Role", Namespace, "mesh-agent"},
		{"RoleBinding", Namespace, "mesh-agent"},
		{"ResourceQuota", Namespace, "mesh-agent-node-critical"},
		{"DaemonSet", Namespace, DaemonSet},
		{"ValidatingAdmissionPolicy", "", "mesh-agent"},
		{"ValidatingAdmissionPolicyBinding", "", "mesh-agent"},
		{"ValidatingAdmissionPolicy", "", "mesh-redirection-annotations"},
		{"ValidatingAdmissionPolicyBinding", "", "mesh-redirection-annotations"},
		{"ValidatingAdmissionPolicy", "", "mesh-enforced-namespaces"},
		{"ValidatingAdmissionPolicyBinding", "", "mesh-enforced-namespaces"},
	}
	var got []key
	for _, o := range objs {
		m, err := meta.Accessor(o.obj)
		if err != nil {
			t.Errorf("%v: %v", o, err)
			continue
		}
		// The decoder knows each kind by its Go type, named as the kind.
		got = append(got, key{reflect.TypeOf(o.obj).Elem().Name(), m.GetNamespace(), m.GetName()})
	}
	less := func(a, b key) int { return strings.Compare(a.kind+"/"+a.name, b.kind+"/"+b.name) }
	slices.SortFunc(got, less)
	slices.SortFunc(want, less)
	if !slices.Equal(got, want) {
		t.Errorf("objects (kind, namespace, name):\n got %v\nwant %v", got, want)
	}

	ns := only[*corev1.Namespace](t, objs)
	if lvl := ns.Labels["pod-security.kubernetes.io/enforce"]; lvl != "privileged" {
		t.Errorf("namespace %s: pod-security enforce level %q, want privileged (the agent pods are privileged)", ns.Name, lvl)
	}
}

// kustomization is the part of a kustomization.yaml these manifests use.
type kustomization struct {
	APIVersion string   `json:"apiVersion"`
	Kind       string   `json:"kind"`
	Resources  []string `json:"resources"`
	Images     []struct {
		Name   string `json:"name"`
		Digest string `json:"digest"`
	} `json:"images"`
}

// readKustomization decodes file strictly, so a misspelt field (which
// kustomize would reject) fails here too; a newTag would fail as well.
func readKustomization(t *testing.T, file string) kustomization {
	t.Helper()
	data, err := fs.ReadFile(Manifests(), file)
	if err != nil {
		t.Fatal(err)
	}
	var k kustomization
	if err := yaml.UnmarshalStrict(data, &k); err != nil {
		t.Fatalf("%s: %v", file, err)
	}
	if k.APIVersion != "kustomize.config.k8s.io/v1beta1" || k.Kind != "Kustomization" {
		t.Errorf("%s: apiVersion %q kind %q", file, k.APIVersion, k.Kind)
	}
	return k
}

var digestRE = regexp.MustCompile(`^sha256:[0-9a-f]{64}$`)

func TestKustomizationListsEveryFile(t *testing.T) {
	k := readKustomization(t, kustomizationFile)
	files := manifestFiles(t)
	listed := slices.Clone(k.Resources)
	slices.Sort(listed)
	if dup := slices.Compact(slices.Clone(listed)); len(dup) != len(listed) {
		t.Errorf("%s lists a resource twice: %v", kustomizationFile, k.Resources)
	}
	if !slices.Equal(slices.Compact(listed), files) {
		t.Errorf("%s resources %v, want every manifest in the directory: %v", kustomizationFile, k.Resources, files)
	}
}

// Both kustomizations pin the agent image by the release's digest, never by
// a tag (a tag can be moved to other bytes; "latest" always is).
func TestReleasePinned(t *testing.T) {
	if !digestRE.MatchString(ReleaseDigest) {
		t.Errorf("ReleaseDigest %q is not a sha256 digest", ReleaseDigest)
	}
	if !regexp.MustCompile(`^[0-9a-f]{40}$`).MatchString(ReleaseCommit) {
		t.Errorf("ReleaseCommit %q: want the full commit id the image was built from", ReleaseCommit)
	}
	if !regexp.MustCompile(`^go1\.[0-9]+(\.[0-9]+)?$`).MatchString(ReleaseGo) {
		t.Errorf("ReleaseGo %q: want the Go release that built it, e.g. go1.26.8", ReleaseGo)
	}
	for _, file := range []string{kustomizationFile, "uninstall/" + kustomizationFile} {
		k := readKustomization(t, file)
		if len(k.Images) != 1 || k.Images[0].Name != Image || k.Images[0].Digest != ReleaseDigest {
			t.Errorf("%s images %+v: want one entry named %q pinning digest %s (release.go)", file, k.Images, Image, ReleaseDigest)
		}
	}
	if strings.ContainsAny(Image, ":@") {
		t.Errorf("Image %q: want the repository alone; kustomize pins the digest", Image)
	}
}

// agentContainer returns the DaemonSet and its agent container.
func agentContainer(t *testing.T, objs []object) (*appsv1.DaemonSet, corev1.Container) {
	t.Helper()
	ds := only[*appsv1.DaemonSet](t, objs)
	cs := ds.Spec.Template.Spec.Containers
	if len(cs) != 1 || cs[0].Name != Container {
		t.Fatalf("DaemonSet containers: want exactly one named %q, got %d", Container, len(cs))
	}
	checkBPFFSInit(t, ds)
	return ds, cs[0]
}

// flagArgs parses the container's args: the run subcommand, then --name=value.
func flagArgs(t *testing.T, c corev1.Container) map[string]string {
	t.Helper()
	if len(c.Command) != 1 || c.Command[0] != AgentBinary {
		t.Errorf("command %q, want [%s]", c.Command, AgentBinary)
	}
	if len(c.Args) == 0 || c.Args[0] != "run" {
		t.Fatalf("args %q: want the run subcommand first", c.Args)
	}
	flags := map[string]string{}
	for _, a := range c.Args[1:] {
		name, value, ok := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		if !strings.HasPrefix(a, "--") || !ok || name == "" {
			t.Errorf("arg %q: want --name=value (one argument, so a value can never be taken for a flag)", a)
			continue
		}
		if _, dup := flags[name]; dup {
			t.Errorf("flag --%s given twice", name)
		}
		flags[name] = value
	}
	return flags
}

// under reports whether p is dir or inside it.
func under(p, dir string) bool {
	return p == dir || strings.HasPrefix(p, strings.TrimSuffix(dir, "/")+"/")
}

func TestDaemonSetMountsMatchAgentPaths(t *testing.T) {
	ds, c := agentContainer(t, loadObjects(t))
	pod := ds.Spec.Template.Spec

	// Volumes: hostPath only, each used by exactly one mount.
	volumes := map[string]corev1.Volume{}
	for _, v := range pod.Volumes {
		if v.HostPath == nil {
			t.Errorf("volume %q is not a hostPath volume", v.Name)
			continue
		}
		if v.HostPath.Type == nil || *v.HostPath.Type == "" {
			t.Errorf("volume %q: set the hostPath type, so a missing or wrong host path fails the pod instead of being created as a file", v.Name)
		}
		volumes[v.Name] = v
	}

	mounts := map[string]corev1.VolumeMount{}
	for _, m := range c.VolumeMounts {
		if _, dup := mounts[m.Name]; dup {
			t.Errorf("volume %q mounted twice", m.Name)
		}
		if m.SubPath != "" || m.SubPathExpr != "" {
			t.Errorf("mount %q uses a subPath; the table has none", m.Name)
		}
		mounts[m.Name] = m
	}

	for _, want := range AgentMounts() {
		m, ok := mounts[want.Volume]
		if !ok {
			t.Errorf("no mount of volume %q (%s at %s)", want.Volume, want.HostPath, want.Path)
			continue
		}
		delete(mounts, want.Volume)
		prop := ""
		if m.MountPropagation != nil && *m.MountPropagation != corev1.MountPropagationNone {
			prop = string(*m.MountPropagation)
		}
		got := Mount{Volume: m.Name, Path: m.MountPath, ReadOnly: m.ReadOnly, Propagation: prop}
		if v, ok := volumes[want.Volume]; ok {
			got.HostPath = v.HostPath.Path
			delete(volumes, want.Volume)
		}
		if got != want {
			t.Errorf("mount of volume %q:\n got %+v\nwant %+v", want.Volume, got, want)
		}
	}
	for name, m := range mounts {
		t.Errorf("mount %q at %s is not in AgentMounts", name, m.MountPath)
	}
	for name := range volumes {
		t.Errorf("volume %q is not in AgentMounts", name)
	}

	// Mounts never nest: kubelet gives no order guarantee that would make an
	// inner one reliable, and an inner hostPath would be created inside the
	// outer host directory.
	table := AgentMounts()
	for i, a := range table {
		for _, b := range table[i+1:] {
			if under(a.Path, b.Path) || under(b.Path, a.Path) {
				t.Errorf("mounts %q (%s) and %q (%s) nest", a.Volume, a.Path, b.Volume, b.Path)
			}
		}
		if a.Propagation == PropagationBidirectional && (c.SecurityContext == nil || c.SecurityContext.Privileged == nil || !*c.SecurityContext.Privileged) {
			t.Errorf("mount %q is Bidirectional: the API server accepts that only in a privileged container", a.Volume)
		}
	}

	// Path flags: given exactly as in the table, each inside exactly one mount
	// (or, for files of the image, inside none).
	flags := flagArgs(t, c)
	for _, pf := range AgentPathFlags() {
		got, ok := flags[pf.Flag]
		if !ok {
			t.Errorf("args lack --%s=%s", pf.Flag, pf.Value)
		} else if got != pf.Value {
			t.Errorf("--%s=%s, the table says %s", pf.Flag, got, pf.Value)
		}
		var in []string
		for _, m := range table {
			if under(pf.Value, m.Path) {
				in = append(in, m.Volume)
			}
		}
		switch {
		case pf.InImage && len(in) != 0:
			t.Errorf("--%s=%s is a file of the image but mount %v hides it", pf.Flag, pf.Value, in)
		case !pf.InImage && len(in) != 1:
			t.Errorf("--%s=%s: want it inside exactly one mount, is inside %v", pf.Flag, pf.Value, in)
		}
	}
	for _, m := range table {
		if under(AgentBinary, m.Path) {
			t.Errorf("mount %q hides the agent binary %s", m.Volume, AgentBinary)
		}
	}
	// Every absolute path among the args is a path flag of the table.
	known := map[string]bool{}
	for _, pf := range AgentPathFlags() {
		known[pf.Flag] = true
	}
	for name, value := range flags {
		if strings.HasPrefix(value, "/") && !known[name] {
			t.Errorf("--%s=%s is a path missing from AgentPathFlags", name, value)
		}
	}
}

// The DaemonSet names no CNI directory: the agent installs where the node's
// runtime loads CNI from, and reads its cni-bin and cni-conf mounts as its
// defaults, the pinned release too, so that a platform's mounts are where it
// installs when they are the runtime's or the runtime cannot be read.
func TestCNIDirsAreTheRuntimes(t *testing.T) {
	_, c := agentContainer(t, loadObjects(t))
	flags := flagArgs(t, c)
	for _, f := range []string{"cni-bin-dir", "cni-conf-dir", "runtime-cni-check"} {
		if v, ok := flags[f]; ok {
			t.Errorf("--%s=%s: the operator's choice (docs/install.md), not the manifests' default", f, v)
		}
	}
	mounts := map[string]string{}
	for _, m := range AgentMounts() {
		mounts[m.Volume] = m.Path
	}
	if mounts["cni-bin"] != agentcli.DefaultCNIBinDir || mounts["cni-conf"] != agentcli.DefaultCNIConfDir {
		t.Errorf("CNI mounts at %s and %s, the agent's defaults are %s and %s", mounts["cni-bin"], mounts["cni-conf"], agentcli.DefaultCNIBinDir, agentcli.DefaultCNIConfDir)
	}
}

// declaredAgentFlags returns the flags `mesh-agent run` declares, read from its
// own usage text.
func declaredAgentFlags(t *testing.T) map[string]bool {
	t.Helper()
	var stdout, stderr bytes.Buffer
	agentcli.Main(context.Background(), []string{"run", "-h"}, &stdout, &stderr)
	flags := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^  -([a-z0-9][a-z0-9-]*)`).FindAllStringSubmatch(stderr.String()+stdout.String(), -1) {
		flags[m[1]] = true
	}
	if !flags["socket"] {
		t.Fatalf("could not read the flags of mesh-agent run from its usage:\n%s%s", stdout.String(), stderr.String())
	}
	return flags
}

func TestAgentArgs(t *testing.T) {
	ds, c := agentContainer(t, loadObjects(t))
	flags := flagArgs(t, c)
	declared := declaredAgentFlags(t)
	for name := range flags {
		if !declared[name] {
			t.Errorf("--%s is not a flag of mesh-agent run (the agent would exit at start)", name)
		}
	}

	// The plugin on the host dials its default socket path unless its CNI
	// config says otherwise: the agent must listen right there.
	if got := flags["socket"]; got != cniplugin.DefaultSocketPath {
		t.Errorf("--socket=%s, but the mesh-cni plugin dials %s by default", got, cniplugin.DefaultSocketPath)
	}
	if flags["datapath"] != "ebpf" {
		t.Errorf("--datapath=%q: the DaemonSet must redirect traffic (ebpf)", flags["datapath"])
	}

	// The metrics/health address is the one the probes and the port use.
	if got := flags["metrics-addr"]; got != MetricsAddr {
		t.Errorf("--metrics-addr=%s, want %s", got, MetricsAddr)
	}
	host, portStr, err := net.SplitHostPort(MetricsAddr)
	if err != nil {
		t.Fatal(err)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil {
		t.Fatal(err)
	}
	var portName string
	for _, p := range c.Ports {
		if int(p.ContainerPort) == port && p.Protocol == corev1.ProtocolTCP {
			portName = p.Name
		}
	}
	if portName == "" {
		t.Errorf("no TCP container port %d declared (with hostNetwork it reserves the port on the node)", port)
	}
	for _, p := range []struct {
		name, path string
		probe      *corev1.Probe
	}{
		{"startup", "/healthz", c.StartupProbe},
		{"liveness", "/healthz", c.LivenessProbe},
		{"readiness", "/readyz", c.ReadinessProbe},
	} {
		if p.probe == nil || p.probe.HTTPGet == nil {
			t.Errorf("%s probe: want httpGet %s", p.name, p.path)
			continue
		}
		g := p.probe.HTTPGet
		if g.Path != p.path || g.Host != host || g.Scheme != "" && g.Scheme != corev1.URISchemeHTTP ||
			!(g.Port.StrVal == portName || g.Port.IntValue() == port) {
			t.Errorf("%s probe: httpGet %s:%s%s, want %s:%d%s", p.name, g.Host, g.Port.String(), g.Path, host, port, p.path)
		}
	}

	// The pod outlives the agent's own shutdown grace, with a margin.
	grace, err := time.ParseDuration(flags["shutdown-grace"])
	if err != nil {
		t.Fatalf("--shutdown-grace: %v", err)
	}
	tgps := ds.Spec.Template.Spec.TerminationGracePeriodSeconds
	if tgps == nil || time.Duration(*tgps)*time.Second < grace+5*time.Second {
		t.Errorf("terminationGracePeriodSeconds %v: want at least --shutdown-grace (%v) + 5s", tgps, grace)
	}
}

func TestDaemonSetSpec(t *testing.T) {
	objs := loadObjects(t)
	ds, c := agentContainer(t, objs)
	pod := ds.Spec.Template.Spec

	if sel := ds.Spec.Selector; sel == nil || len(sel.MatchLabels) == 0 || len(sel.MatchExpressions) != 0 {
		t.Errorf("selector %v: want matchLabels only", sel)
	} else {
		for k, v := range sel.MatchLabels {
			if ds.Spec.Template.Labels[k] != v {
				t.Errorf("selector %s=%s does not match the pod template's labels", k, v)
			}
		}
	}
	if !pod.HostNetwork {
		t.Error("hostNetwork: want true")
	}
	if !pod.HostPID || pod.HostIPC {
		t.Error("want hostPID (a node proxy's cgroup, listeners taken from their process) and no hostIPC")
	}
	if pod.PriorityClassName != "system-node-critical" {
		t.Errorf("priorityClassName %q", pod.PriorityClassName)
	}
	if !slices.ContainsFunc(pod.Tolerations, func(tol corev1.Toleration) bool {
		return tol.Key == "" && tol.Operator == corev1.TolerationOpExists && tol.Effect == ""
	}) {
		t.Errorf("tolerations %v: want one {operator: Exists} so that every node runs the agent", pod.Tolerations)
	}

	us := ds.Spec.UpdateStrategy
	if us.Type != appsv1.RollingUpdateDaemonSetStrategyType || us.RollingUpdate == nil ||
		us.RollingUpdate.MaxUnavailable == nil || us.RollingUpdate.MaxUnavailable.String() != "1" ||
		us.RollingUpdate.MaxSurge == nil || us.RollingUpdate.MaxSurge.String() != "0" {
		t.Errorf("updateStrategy %+v: want RollingUpdate, maxUnavailable 1, maxSurge 0 (never two agents on a node)", us)
	}

	sa := only[*corev1.ServiceAccount](t, objs)
	if pod.ServiceAccountName != sa.Name || ds.Namespace != sa.Namespace {
		t.Errorf("DaemonSet %s/%s runs as service account %q, the manifests define %s/%s", ds.Namespace, ds.Name, pod.ServiceAccountName, sa.Namespace, sa.Name)
	}

	// The agent's token must be the one the kubelet mounts: bound to the
	// pod, it names the node, which the admission policy checks.
	if a := pod.AutomountServiceAccountToken; a == nil || !*a {
		t.Errorf("automountServiceAccountToken %v: want true (the pod-bound token names the node for admissionpolicy.yaml)", a)
	}
	if a := sa.AutomountServiceAccountToken; a != nil && !*a {
		t.Errorf("ServiceAccount %s sets automountServiceAccountToken false", sa.Name)
	}

	if c.Image != Image {
		t.Errorf("image %q, want %q (kustomize images replaces it)", c.Image, Image)
	}
	if c.ImagePullPolicy != corev1.PullIfNotPresent {
		t.Errorf("imagePullPolicy %q: want IfNotPresent (a restart must not need the registry)", c.ImagePullPolicy)
	}

	env := map[string]corev1.EnvVar{}
	for _, e := range c.Env {
		env[e.Name] = e
	}
	for name, path := range map[string]string{
		"NODE_NAME": "spec.nodeName",
		// --uninstall-on-delete finds its DaemonSet from its own pod.
		agentcli.EnvPodName:      "metadata.name",
		agentcli.EnvPodNamespace: "metadata.namespace",
	} {
		if e := env[name]; e.ValueFrom == nil || e.ValueFrom.FieldRef == nil || e.ValueFrom.FieldRef.FieldPath != path {
			t.Errorf("env %s %+v: want fieldRef %s", name, e, path)
		}
	}
	if e, ok := env["GOMEMLIMIT"]; ok {
		// GOMEMLIMIT is read as bytes: a divisor would make it tiny.
		if r := e.ValueFrom; r == nil || r.ResourceFieldRef == nil || r.ResourceFieldRef.Resource != "limits.memory" ||
			!r.ResourceFieldRef.Divisor.IsZero() && r.ResourceFieldRef.Divisor.Value() != 1 {
			t.Errorf("env GOMEMLIMIT %+v: want resourceFieldRef limits.memory in bytes", e)
		}
	}

	res := c.Resources
	for _, r := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
		if q, ok := res.Requests[r]; !ok || q.IsZero() {
			t.Errorf("no %s request", r)
		}
	}
	if q, ok := res.Limits[corev1.ResourceMemory]; !ok || q.Cmp(res.Requests[corev1.ResourceMemory]) < 0 {
		t.Errorf("memory limit %v: want one, at least the request", res.Limits)
	}

	sc := c.SecurityContext
	if sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
		t.Error("securityContext.readOnlyRootFilesystem: want true")
	}
}

func TestRBACLeastPrivilege(t *testing.T) {
	objs := loadObjects(t)
	role := only[*rbacv1.ClusterRole](t, objs)
	binding := only[*rbacv1.ClusterRoleBinding](t, objs)
	sa := only[*corev1.ServiceAccount](t, objs)

	// Exactly what the agent uses: the rules test/k8s runs the agent's
	// Kubernetes enrollment source with against a real API server (its pods,
	// annotations and Events), as "group/resource" -> verbs.
	want := map[string][]string{}
	for _, r := range kubeenv.AgentRules() {
		for _, res := range r.Resources {
			for _, g := range r.APIGroups {
				want[g+"/"+res] = append(want[g+"/"+res], r.Verbs...)
			}
		}
	}
	got := map[string][]string{}
	if role.AggregationRule != nil {
		t.Error("ClusterRole aggregates other roles")
	}
	for i, r := range role.Rules {
		if len(r.NonResourceURLs) != 0 {
			t.Errorf("rule %d grants non-resource URLs %v", i, r.NonResourceURLs)
		}
		for _, list := range [][]string{r.APIGroups, r.Resources, r.Verbs, r.ResourceNames} {
			if slices.Contains(list, "*") || slices.ContainsFunc(list, func(s string) bool { return strings.Contains(s, "*") }) {
				t.Errorf("rule %d has a wildcard: %+v", i, r)
			}
		}
		for _, res := range r.Resources {
			if base, _, _ := strings.Cut(res, "/"); base == "secrets" || base == "configmaps" || base == "serviceaccounts" {
				t.Errorf("rule %d grants %s", i, res)
			}
			for _, g := range r.APIGroups {
				got[g+"/"+res] = append(got[g+"/"+res], r.Verbs...)
			}
		}
	}
	for _, m := range []map[string][]string{got, want} {
		for k, v := range m {
			slices.Sort(v)
			m[k] = slices.Compact(v)
		}
	}
	gotJSON, _ := json.Marshal(got)
	wantJSON, _ := json.Marshal(want)
	if !bytes.Equal(gotJSON, wantJSON) {
		t.Errorf("ClusterRole grants\n %s\nwant exactly\n %s", gotJSON, wantJSON)
	}

	if binding.RoleRef != (rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role.Name}) {
		t.Errorf("ClusterRoleBinding roleRef %+v, want the ClusterRole %q", binding.RoleRef, role.Name)
	}
	wantSubj := []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: sa.Name, Namespace: sa.Namespace}}
	if !slices.Equal(binding.Subjects, wantSubj) {
		t.Errorf("ClusterRoleBinding subjects %+v, want %+v", binding.Subjects, wantSubj)
	}

	// --uninstall-on-delete reads the agent's own DaemonSet: get, in its
	// namespace, by its name, and nothing else.
	ds, _ := agentContainer(t, objs)
	nsRole := only[*rbacv1.Role](t, objs)
	nsBinding := only[*rbacv1.RoleBinding](t, objs)
	wantRules := []rbacv1.PolicyRule{{APIGroups: []string{"apps"}, Resources: []string{"daemonsets"}, ResourceNames: []string{ds.Name}, Verbs: []string{"get", "list", "watch"}}}
	if nsRole.Namespace != ds.Namespace || !reflect.DeepEqual(nsRole.Rules, wantRules) {
		t.Errorf("Role %s/%s rules %+v, want in %s exactly %+v", nsRole.Namespace, nsRole.Name, nsRole.Rules, ds.Namespace, wantRules)
	}
	if nsBinding.Namespace != ds.Namespace || nsBinding.RoleRef != (rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: nsRole.Name}) ||
		!slices.Equal(nsBinding.Subjects, wantSubj) {
		t.Errorf("RoleBinding %s/%s %+v %+v, want the Role %q for %+v", nsBinding.Namespace, nsBinding.Name, nsBinding.RoleRef, nsBinding.Subjects, nsRole.Name, wantSubj)
	}
}

// The admission policy binds the manifests' own service account, checks the
// annotation the agent writes and the values it writes there, refuses when it
// cannot be evaluated, and is enforced by its binding. What it allows and
// refuses is shown against a real API server in test/k8s.
func TestAdmissionPolicy(t *testing.T) {
	objs := loadObjects(t)
	policy, binding := policyNamed(t, objs, "mesh-agent")
	sa := only[*corev1.ServiceAccount](t, objs)

	if fp := policy.Spec.FailurePolicy; fp == nil || *fp != admissionregistrationv1.Fail {
		t.Errorf("failurePolicy %v, want Fail", fp)
	}
	user := fmt.Sprintf("'system:serviceaccount:%s:%s'", sa.Namespace, sa.Name)
	if mc := policy.Spec.MatchConditions; len(mc) != 1 || !strings.Contains(mc[0].Expression, "request.userInfo.username == "+user) {
		t.Errorf("matchConditions %+v: want one matching the username %s", mc, user)
	}
	exprs := expressions(t, policy)
	for _, want := range []string{
		"'" + enroll.AnnotationRedirection + "'",
		"['" + enroll.OutcomeEnabled + "', '" + enroll.OutcomeDisabled + "', '" + enroll.OutcomeFailed + "']",
		"'authentication.kubernetes.io/node-name'",
	} {
		if !strings.Contains(exprs, want) {
			t.Errorf("the policy's expressions do not mention %s", want)
		}
	}
	// Nodes: writes to them are matched, and the key the agent may remove
	// is the one the install registers nodes with.
	if rules := policy.Spec.MatchConstraints.ResourceRules; len(rules) != 1 || !slices.Contains(rules[0].Resources, "nodes") || !slices.Contains(rules[0].Resources, "nodes/*") {
		t.Errorf("matchConstraints %+v: want the writes to nodes and their subresources matched", rules)
	}
	if got := policyVariable(t, policy, "startupTaint"); got != "'"+agentcli.DefaultStartupTaint+"'" {
		t.Errorf("the startupTaint variable is %s, want '%s'", got, agentcli.DefaultStartupTaint)
	}
	if binding.Spec.PolicyName != policy.Name || !slices.Equal(binding.Spec.ValidationActions, []admissionregistrationv1.ValidationAction{admissionregistrationv1.Deny}) ||
		binding.Spec.ParamRef != nil || binding.Spec.MatchResources != nil {
		t.Errorf("binding %+v: want policy %s, Deny, for every namespace", binding.Spec, policy.Name)
	}
}

// policyVariable is the expression of the policy's variable name.
func policyVariable(t *testing.T, policy *admissionregistrationv1.ValidatingAdmissionPolicy, name string) string {
	t.Helper()
	for _, v := range policy.Spec.Variables {
		if v.Name == name {
			return v.Expression
		}
	}
	t.Fatalf("the admission policy has no variable %s", name)
	return ""
}

// The startup-taint component passes the flag with the key the admission
// policy names, tolerates that key, and grants get and patch on nodes: only
// with it does the agent get any node write.
func TestStartupTaintComponent(t *testing.T) {
	patches, err := ReadComponent(StartupTaintComponent)
	if err != nil {
		t.Fatal(err)
	}
	type op struct {
		Op    string          `json:"op"`
		Path  string          `json:"path"`
		Value json.RawMessage `json:"value"`
	}
	got := map[string][]op{}
	for _, p := range patches {
		var ops []op
		if err := yaml.UnmarshalStrict([]byte(p.Patch), &ops); err != nil {
			t.Fatalf("%s patch: %v", p.Target.Kind, err)
		}
		got[p.Target.Kind+"/"+p.Target.Name] = ops
	}
	declared := declaredAgentFlags(t)
	ds := got["DaemonSet/"+DaemonSet]
	var arg string
	var tol corev1.Toleration
	for _, o := range ds {
		switch o.Path {
		case "/spec/template/spec/containers/0/args/-":
			if err := json.Unmarshal(o.Value, &arg); err != nil {
				t.Fatal(err)
			}
		case "/spec/template/spec/tolerations/-":
			if err := json.Unmarshal(o.Value, &tol); err != nil {
				t.Fatal(err)
			}
		}
	}
	if arg != "--startup-taint="+agentcli.DefaultStartupTaint || !declared["startup-taint"] {
		t.Errorf("the component passes %q, want --startup-taint=%s (a flag of mesh-agent run)", arg, agentcli.DefaultStartupTaint)
	}
	if tol != (corev1.Toleration{Key: agentcli.DefaultStartupTaint, Operator: corev1.TolerationOpExists}) {
		t.Errorf("the component adds toleration %+v, want the key with operator Exists", tol)
	}
	var rule rbacv1.PolicyRule
	if cr := got["ClusterRole/mesh-agent"]; len(cr) != 1 || cr[0].Op != "add" || cr[0].Path != "/rules/-" {
		t.Fatalf("ClusterRole patch %+v: want one rule added", cr)
	} else if err := json.Unmarshal(cr[0].Value, &rule); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(rule, rbacv1.PolicyRule{APIGroups: []string{""}, Resources: []string{"nodes"}, Verbs: []string{"get", "patch"}}) {
		t.Errorf("the component grants %+v, want get and patch on nodes", rule)
	}
	policy, _ := policyNamed(t, loadObjects(t), "mesh-agent")
	if v := policyVariable(t, policy, "startupTaint"); v != "'"+agentcli.DefaultStartupTaint+"'" {
		t.Errorf("the admission policy lets the agent remove %s, the component sets %s", v, agentcli.DefaultStartupTaint)
	}
}

// policyNamed returns the ValidatingAdmissionPolicy of that name and its
// binding (of the same name, binding it), failing unless both exist once.
func policyNamed(t *testing.T, objs []object, name string) (*admissionregistrationv1.ValidatingAdmissionPolicy, *admissionregistrationv1.ValidatingAdmissionPolicyBinding) {
	t.Helper()
	var policies []*admissionregistrationv1.ValidatingAdmissionPolicy
	var bindings []*admissionregistrationv1.ValidatingAdmissionPolicyBinding
	for _, o := range objs {
		switch v := o.obj.(type) {
		case *admissionregistrationv1.ValidatingAdmissionPolicy:
			if v.Name == name {
				policies = append(policies, v)
			}
		case *admissionregistrationv1.ValidatingAdmissionPolicyBinding:
			if v.Name == name {
				bindings = append(bindings, v)
			}
		}
	}
	if len(policies) != 1 || len(bindings) != 1 {
		t.Fatalf("want one ValidatingAdmissionPolicy and one binding named %s, found %d and %d", name, len(policies), len(bindings))
	}
	if bindings[0].Spec.PolicyName != name {
		t.Errorf("binding %s binds policy %q", name, bindings[0].Spec.PolicyName)
	}
	return policies[0], bindings[0]
}

// expressions is every variable, match condition and validation expression
// of a policy, one a line, and fails on a validation that is not Forbidden
// or has no message.
func expressions(t *testing.T, policy *admissionregistrationv1.ValidatingAdmissionPolicy) string {
	t.Helper()
	var exprs strings.Builder
	for _, m := range policy.Spec.MatchConditions {
		exprs.WriteString(m.Expression + "\n")
	}
	for _, v := range policy.Spec.Variables {
		exprs.WriteString(v.Expression + "\n")
	}
	for _, v := range policy.Spec.Validations {
		exprs.WriteString(v.Expression + "\n" + v.MessageExpression + "\n")
		if v.Reason == nil || *v.Reason != "Forbidden" {
			t.Errorf("%s: validation %q: reason %v, want Forbidden", policy.Name, v.Expression, v.Reason)
		}
		if v.Message == "" && v.MessageExpression == "" {
			t.Errorf("%s: validation %q has no message", policy.Name, v.Expression)
		}
	}
	return exprs.String()
}

// The mesh's annotations are refused to everyone but the agent's own service
// account on pod create and update (not delete), and a pod in a namespace
// labelled enforcing may not gain any pod-level opt-out of either selector
// profile. What they allow and refuse is shown against a real API server in
// test/k8s (TestAgentAdmissionPolicy).
func TestPodPolicies(t *testing.T) {
	objs := loadObjects(t)
	sa := only[*corev1.ServiceAccount](t, objs)
	pods := []admissionregistrationv1.NamedRuleWithOperations{{RuleWithOperations: admissionregistrationv1.RuleWithOperations{
		Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create, admissionregistrationv1.Update},
		Rule:       admissionregistrationv1.Rule{APIGroups: []string{""}, APIVersions: []string{"*"}, Resources: []string{"pods", "pods/*", "bindings"}},
	}}}

	annotations, binding := policyNamed(t, objs, "mesh-redirection-annotations")
	writers := fmt.Sprintf("!(request.userInfo.username in ['system:serviceaccount:%s:%s'])", sa.Namespace, sa.Name)
	exprs := expressions(t, annotations)
	if !strings.Contains(exprs, writers+"\n") {
		t.Errorf("%s: no match condition %s (the agent alone writes the annotations by default)", annotations.Name, writers)
	}
	for _, key := range []string{enroll.AnnotationRedirection, enroll.IstioAnnotationRedirection} {
		if !strings.Contains(exprs, "'"+key+"'") {
			t.Errorf("%s: the expressions do not mention %s", annotations.Name, key)
		}
	}
	if binding.Spec.MatchResources != nil {
		t.Errorf("%s: binding limited to %+v, want every namespace", binding.Name, binding.Spec.MatchResources)
	}

	enforce, enforceBinding := policyNamed(t, objs, "mesh-enforced-namespaces")
	exprs = expressions(t, enforce)
	for _, profile := range enroll.Profiles() {
		sel, err := enroll.ProfileSelectors(profile)
		if err != nil {
			t.Fatal(err)
		}
		for where, list := range map[string][]labels.Selector{"labels": sel.PodOptOut, "annotations": sel.PodOptOutAnnotation} {
			for _, s := range list {
				reqs, _ := s.Requirements()
				for _, r := range reqs {
					value := ""
					if r.Operator() != selection.Exists {
						value = r.Values().List()[0]
					}
					want := fmt.Sprintf("['%s', '%s', '%s']", where, r.Key(), value)
					if !strings.Contains(exprs, want) {
						t.Errorf("%s: profile %s opts pods out by %s %s, which the policy does not list as %s", enforce.Name, profile, where, s, want)
					}
				}
			}
		}
	}
	if !strings.Contains(exprs, "['annotations', '"+enroll.IstioAnnotationBypassInbound+"', '']") {
		t.Errorf("%s: the policy does not list %s", enforce.Name, enroll.IstioAnnotationBypassInbound)
	}
	ns := enforceBinding.Spec.MatchResources
	if ns == nil || ns.NamespaceSelector == nil || len(ns.NamespaceSelector.MatchExpressions) != 0 ||
		len(ns.NamespaceSelector.MatchLabels) != 1 || ns.NamespaceSelector.MatchLabels[enroll.LabelEnforce] != enroll.ValueEnforce {
		t.Errorf("%s: binding matches %+v, want namespaces labelled %s=%s only", enforceBinding.Name, ns, enroll.LabelEnforce, enroll.ValueEnforce)
	}

	for _, p := range []*admissionregistrationv1.ValidatingAdmissionPolicy{annotations, enforce} {
		if fp := p.Spec.FailurePolicy; fp == nil || *fp != admissionregistrationv1.Fail {
			t.Errorf("%s: failurePolicy %v, want Fail", p.Name, fp)
		}
		if p.Spec.MatchConstraints == nil || !reflect.DeepEqual(p.Spec.MatchConstraints.ResourceRules, pods) {
			t.Errorf("%s: matches %+v, want pod create and update, every subresource, and bindings", p.Name, p.Spec.MatchConstraints)
		}
	}
	for _, b := range []*admissionregistrationv1.ValidatingAdmissionPolicyBinding{binding, enforceBinding} {
		if !slices.Equal(b.Spec.ValidationActions, []admissionregistrationv1.ValidationAction{admissionregistrationv1.Deny}) || b.Spec.ParamRef != nil {
			t.Errorf("binding %s: %+v, want Deny without parameters", b.Name, b.Spec)
		}
	}
}

// kubectlForKustomize finds a kubectl: the one hack/build-kube.sh node builds
// (the cluster's own version), else one on PATH.
func kubectlForKustomize(t *testing.T) string {
	t.Helper()
	if dir := os.Getenv("MESH_CNI_KUBE_NODE_BIN_DIR"); dir != "" {
		return filepath.Join(dir, "kubectl")
	}
	kubectl, err := exec.LookPath("kubectl")
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("kubectl is needed to build the kustomization: %v", err)
		}
		t.Skipf("kubectl not found (%v); CI runs this test", err)
	}
	return kubectl
}

// admissionPolicies names the ValidatingAdmissionPolicies (and their
// bindings, named alike) that clusters older than 1.30 leave out.
var admissionPolicies = []string{"mesh-agent", "mesh-redirection-annotations", "mesh-enforced-namespaces"}

// withoutPolicyOverlay is docs/install.md's kustomization for clusters older
// than 1.30, on base.
func withoutPolicyOverlay(base string) string {
	var b strings.Builder
	b.WriteString("resources:\n  - " + base + "\npatches:\n")
	for _, name := range admissionPolicies {
		for _, kind := range []string{"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"} {
			fmt.Fprintf(&b, "  - patch: |-\n      $patch: delete\n      apiVersion: admissionregistration.k8s.io/v1\n      kind: %s\n      metadata:\n        name: %s\n", kind, name)
		}
	}
	return b.String()
}

// TestInstallDocOverlay: docs/install.md shows the overlay the tests build.
func TestInstallDocOverlay(t *testing.T) {
	doc := fixtures.ReadDoc(t, "docs/install.md")
	want := "```yaml\n" + withoutPolicyOverlay("../install/kubernetes") + "```\n"
	if !strings.Contains(string(doc), want) {
		t.Errorf("docs/install.md does not show the overlay for clusters older than 1.30:\n%s", want)
	}
}

// TestKustomizeBuild builds the kustomizations with kubectl's kustomize, as
// `kubectl apply -k` does, and through an overlay that pins another build.
func TestKustomizeBuild(t *testing.T) {
	kubectl := kubectlForKustomize(t)
	dec := strictDecoder(t)
	build := func(dir string) []runtime.Object {
		t.Helper()
		ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
		defer cancel()
		var stderr bytes.Buffer
		cmd := exec.CommandContext(ctx, kubectl, "kustomize", dir)
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("kubectl kustomize %s: %v\n%s", dir, err, stderr.String())
		}
		docs, err := splitDocuments(out)
		if err != nil {
			t.Fatal(err)
		}
		var objs []runtime.Object
		for i, doc := range docs {
			obj, err := decodeStrict(dec, doc)
			if err != nil {
				t.Fatalf("built document %d: %v", i, err)
			}
			objs = append(objs, obj)
		}
		return objs
	}
	images := func(objs []runtime.Object) []string {
		var out []string
		for _, o := range objs {
			switch v := o.(type) {
			case *appsv1.DaemonSet:
				out = append(out, v.Spec.Template.Spec.Containers[0].Image)
			case *batchv1.Job:
				out = append(out, v.Spec.Template.Spec.Containers[0].Image)
			}
		}
		return out
	}
	pinned := Image + "@" + ReleaseDigest

	objs := build(".")
	if got, want := len(objs), len(loadObjects(t)); got != want {
		t.Errorf("kustomize built %d objects, the files hold %d", got, want)
	}
	if got := images(objs); !slices.Equal(got, []string{pinned}) {
		t.Errorf("the DaemonSet runs %q, want the release %s", got, pinned)
	}
	if got := images(build("uninstall")); !slices.Equal(got, []string{pinned}) {
		t.Errorf("the uninstall Job runs %q, want the release %s", got, pinned)
	}

	// kustomize takes bases only by relative path.
	overlay := t.TempDir()
	here, err := filepath.Abs(".")
	if err != nil {
		t.Fatal(err)
	}
	base, err := filepath.Rel(overlay, here)
	if err != nil {
		t.Fatal(err)
	}
	other := "sha256:" + strings.Repeat("ab", 32)
	kust := fmt.Sprintf("resources:\n  - %s\nimages:\n  - name: %s\n    digest: %s\n", base, Image, other)
	if err := os.WriteFile(path.Join(overlay, kustomizationFile), []byte(kust), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := images(build(overlay)); !slices.Equal(got, []string{Image + "@" + other}) {
		t.Errorf("an overlay pinning %s set the agent image to %q", other, got)
	}

	// Clusters older than 1.30 do not serve the policy's API: the README's
	// overlay leaves both objects out, and only them.
	old := t.TempDir()
	if base, err = filepath.Rel(old, here); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path.Join(old, kustomizationFile), []byte(withoutPolicyOverlay(base)), 0o644); err != nil {
		t.Fatal(err)
	}
	built := build(old)
	for _, o := range built {
		switch o.(type) {
		case *admissionregistrationv1.ValidatingAdmissionPolicy, *admissionregistrationv1.ValidatingAdmissionPolicyBinding:
			t.Errorf("the overlay without the policy still builds a %T", o)
		}
	}
	if got, want := len(built), len(objs)-2*len(admissionPolicies); got != want {
		t.Errorf("the overlay without the policy builds %d objects, want %d", got, want)
	}
}

// checkBPFFSInit holds the DaemonSet's one init container to its job: mounting a
// bpffs at the host's /sys/fs/bpf, the one step that needs privileges, with the
// agent's own image and nothing else mounted.
func checkBPFFSInit(t *testing.T, ds *appsv1.DaemonSet) {
	t.Helper()
	ics := ds.Spec.Template.Spec.InitContainers
	if len(ics) != 1 || ics[0].Name != "bpffs" {
		t.Fatalf("DaemonSet init containers %d: want exactly one, bpffs", len(ics))
	}
	ic, agent := ics[0], ds.Spec.Template.Spec.Containers[0]
	if ic.Image != agent.Image || !slices.Equal(ic.Command, []string{"/usr/local/bin/mesh-agent"}) || !slices.Equal(ic.Args, []string{"mount-bpffs"}) {
		t.Errorf("init container runs %s %q %q: want the agent's image running mesh-agent mount-bpffs", ic.Image, ic.Command, ic.Args)
	}
	if len(ic.VolumeMounts) != 1 || ic.VolumeMounts[0].MountPath != "/sys/fs/bpf" ||
		ic.VolumeMounts[0].MountPropagation == nil || *ic.VolumeMounts[0].MountPropagation != corev1.MountPropagationBidirectional {
		t.Errorf("init container mounts %+v: want only the host's /sys/fs/bpf, Bidirectional", ic.VolumeMounts)
	}
	sc := agent.SecurityContext
	if sc == nil || (sc.Privileged != nil && *sc.Privileged) || sc.Capabilities == nil ||
		!slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) ||
		!slices.Equal(sc.Capabilities.Add, []corev1.Capability{"SYS_ADMIN", "NET_ADMIN", "SYS_PTRACE"}) {
		t.Errorf("agent security context %+v: want not privileged, all capabilities dropped but SYS_ADMIN, NET_ADMIN and SYS_PTRACE", sc)
	}
}
