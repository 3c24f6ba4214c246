package helm

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	kubefake "helm.sh/helm/v3/pkg/kube/fake"
	"helm.sh/helm/v3/pkg/storage"
	"helm.sh/helm/v3/pkg/storage/driver"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"
)

const (
	chartDir    = "mesh-cni"
	kustomize   = "../kubernetes"
	releaseName = "mesh-cni"
	namespace   = "mesh-system"
	// uninstallNode is the placeholder install/kubernetes/uninstall uses.
	uninstallNode = "NODE_NAME"
)

// object is one rendered manifest, decoded into plain JSON values.
type object map[string]any

func (o object) key() string {
	meta, _ := o["metadata"].(map[string]any)
	return fmt.Sprintf("%v/%v/%v", o["kind"], meta["namespace"], meta["name"])
}

// decode splits a multi-document YAML stream into objects.
func decode(t *testing.T, stream []byte) map[string]object {
	t.Helper()
	out := map[string]object{}
	for _, doc := range bytes.Split(stream, []byte("\n---")) {
		var o object
		if err := yaml.Unmarshal(doc, &o); err != nil {
			t.Fatalf("rendered document does not parse: %v\n%s", err, doc)
		}
		if len(o) == 0 {
			continue
		}
		if _, dup := out[o.key()]; dup {
			t.Fatalf("%s rendered twice", o.key())
		}
		out[o.key()] = o
	}
	return out
}

// render runs the chart as `helm template` does (the same action, client
// only) with values set over the defaults.
func render(t *testing.T, values map[string]any) (map[string]object, error) {
	t.Helper()
	return renderWith(t, values, nil, nil)
}

// renderWith renders for a cluster of Kubernetes version kv (nil: helm
// template's default) that serves the API versions apis besides the built-in ones.
func renderWith(t *testing.T, values map[string]any, kv *chartutil.KubeVersion, apis []string) (map[string]object, error) {
	t.Helper()
	chrt, err := loader.Load(chartDir)
	if err != nil {
		t.Fatalf("load chart: %v", err)
	}
	cfg := &action.Configuration{
		Releases:     storage.Init(driver.NewMemory()),
		KubeClient:   &kubefake.PrintingKubeClient{Out: io.Discard},
		Capabilities: chartutil.DefaultCapabilities,
		Log:          func(string, ...any) {},
	}
	inst := action.NewInstall(cfg)
	inst.DryRun, inst.ClientOnly, inst.Replace = true, true, true
	inst.ReleaseName, inst.Namespace = releaseName, namespace
	inst.KubeVersion, inst.APIVersions = kv, apis
	rel, err := inst.Run(chrt, values)
	if err != nil {
		return nil, err
	}
	return decode(t, []byte(rel.Manifest)), nil
}

func mustRender(t *testing.T, values map[string]any) map[string]object {
	t.Helper()
	objs, err := render(t, values)
	if err != nil {
		t.Fatalf("render with %v: %v", values, err)
	}
	return objs
}

// build runs kustomize on dir as `kubectl apply -k` does.
func build(t *testing.T, dir string) map[string]object {
	t.Helper()
	k := krusty.MakeKustomizer(krusty.MakeDefaultOptions())
	res, err := k.Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		t.Fatalf("kustomize %s: %v", dir, err)
	}
	out, err := res.AsYaml()
	if err != nil {
		t.Fatal(err)
	}
	return decode(t, out)
}

func keys(m map[string]object) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

func diff(t *testing.T, what string, got, want object) {
	t.Helper()
	if reflect.DeepEqual(got, want) {
		return
	}
	g, _ := json.MarshalIndent(got, "", "  ")
	w, _ := json.MarshalIndent(want, "", "  ")
	t.Errorf("%s differs:\n--- chart\n%s\n--- kustomize\n%s", what, g, w)
}

// The chart and the kustomization are one install: with the default values
// the chart renders every object kustomize builds, identically, except the
// Namespace (the README applies namespace.yaml before `helm install`); and its
// uninstall Job for a node is the kustomization's.
func TestDefaultsRenderTheKustomization(t *testing.T) {
	chart := mustRender(t, nil)
	kust := build(t, kustomize)
	nsKey := "Namespace/<nil>/" + namespace
	if _, ok := kust[nsKey]; !ok {
		t.Fatalf("kustomize built no namespace %s: %v", namespace, keys(kust))
	}
	delete(kust, nsKey)
	if !slices.Equal(keys(chart), keys(kust)) {
		t.Fatalf("the chart renders %v, kustomize builds %v (and the namespace)", keys(chart), keys(kust))
	}
	for k, want := range kust {
		diff(t, k, chart[k], want)
	}

	job := mustRender(t, map[string]any{"uninstall": map[string]any{"node": uninstallNode}})
	kustJob := build(t, filepath.Join(kustomize, "uninstall"))
	if len(kustJob) != 1 {
		t.Fatalf("install/kubernetes/uninstall builds %v, want one Job", keys(kustJob))
	}
	for k, want := range kustJob {
		diff(t, k, job[k], want)
	}
}

// agentArgs returns the rendered DaemonSet's agent container.
func agentContainer(t *testing.T, objs map[string]object) map[string]any {
	t.Helper()
	ds, ok := objs["DaemonSet/"+namespace+"/mesh-agent"]
	if !ok {
		t.Fatalf("no DaemonSet rendered: %v", keys(objs))
	}
	spec := ds["spec"].(map[string]any)["template"].(map[string]any)["spec"].(map[string]any)
	return spec["containers"].([]any)[0].(map[string]any)
}

func argsOf(c map[string]any) []string {
	var out []string
	for _, a := range c["args"].([]any) {
		out = append(out, a.(string))
	}
	return out
}

func TestValues(t *testing.T) {
	const digest = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	for _, tc := range []struct {
		name   string
		values string
		check  func(t *testing.T, objs map[string]object, c map[string]any)
	}{
		{"image digest", "image: {repository: registry.example/agent, digest: " + digest + "}", func(t *testing.T, _ map[string]object, c map[string]any) {
			if c["image"] != "registry.example/agent@"+digest {
				t.Errorf("image %v", c["image"])
			}
		}},
		{"image tag", "image: {digest: '', tag: v9.9.9}", func(t *testing.T, _ map[string]object, c map[string]any) {
			if c["image"] != "ghcr.io/mesh-cni/mesh-agent:v9.9.9" {
				t.Errorf("image %v", c["image"])
			}
		}},
		{"selector profile", "selectorProfile: istio", func(t *testing.T, _ map[string]object, c map[string]any) {
			wantArg(t, c, "--selector-profile=istio")
		}},
		{"excluded namespaces", "excludeNamespaces: [kube-system, monitoring]", func(t *testing.T, _ map[string]object, c map[string]any) {
			wantArg(t, c, "--exclude-namespaces=kube-system,monitoring")
		}},
		{"no excluded namespaces", "excludeNamespaces: []", func(t *testing.T, _ map[string]object, c map[string]any) {
			wantArg(t, c, "--exclude-namespaces=")
		}},
		{"enrollment all without ZDS", "{enrollment: all, zds: {enabled: false}}", func(t *testing.T, _ map[string]object, c map[string]any) {
			wantArg(t, c, "--enrollment=all")
			wantArg(t, c, "--zds-socket=")
		}},
		{"enrollment all, ZDS without service accounts", "{enrollment: all, zds: {withoutServiceAccounts: true}}", func(t *testing.T, _ map[string]object, c map[string]any) {
			wantArg(t, c, "--zds-without-service-accounts")
		}},
		{"enrollment file", "{enrollment: file, zds: {enabled: false}, policy: {namespaces: [shop]}}", func(t *testing.T, objs map[string]object, c map[string]any) {
			wantArg(t, c, "--enrollment=file")
			wantArg(t, c, "--policy-file=/etc/mesh-cni/enrollment.yaml")
			cm, ok := objs["ConfigMap/"+namespace+"/mesh-agent-policy"]
			if !ok {
				t.Fatalf("no policy ConfigMap: %v", keys(objs))
			}
			var policy map[string]any
			if err := yaml.Unmarshal([]byte(cm["data"].(map[string]any)["enrollment.yaml"].(string)), &policy); err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(policy, map[string]any{"namespaces": []any{"shop"}}) {
				t.Errorf("policy file %v", policy)
			}
			mounted := false
			for _, m := range c["volumeMounts"].([]any) {
				mounted = mounted || m.(map[string]any)["mountPath"] == "/etc/mesh-cni"
			}
			if !mounted {
				t.Error("the policy is not mounted at /etc/mesh-cni")
			}
		}},
		{"proxy mark", "proxyMark: '0x539'", func(t *testing.T, _ map[string]object, c map[string]any) {
			wantArg(t, c, "--proxy-mark=0x539")
		}},
		{"DNS capture and raw sockets refused", "{dnsCapture: true, denyRawSockets: true}", func(t *testing.T, _ map[string]object, c map[string]any) {
			wantArg(t, c, "--dns-capture")
			wantArg(t, c, "--deny-raw-sockets")
		}},
		{"plugin log", "plugin: {logLevel: debug, logFile: /var/run/mesh-cni/plugin.log}", func(t *testing.T, _ map[string]object, c map[string]any) {
			wantArg(t, c, "--plugin-log-level=debug")
			wantArg(t, c, "--plugin-log-file=/var/run/mesh-cni/plugin.log")
		}},
		{"no admission policy", "admissionPolicy: {enabled: false}", func(t *testing.T, objs map[string]object, _ map[string]any) {
			for _, k := range keys(objs) {
				if strings.HasPrefix(k, "ValidatingAdmissionPolicy") {
					t.Errorf("%s rendered with admissionPolicy.enabled false", k)
				}
			}
			if _, ok := objs["ClusterRole/<nil>/mesh-agent"]; !ok {
				t.Errorf("no ClusterRole rendered: %v", keys(objs))
			}
		}},
		{"startup taint", "{startupTaint: {enabled: true, key: example.com/not-ready}, runtimeHook: {enabled: true}}", func(t *testing.T, objs map[string]object, c map[string]any) {
			wantArg(t, c, "--startup-taint=example.com/not-ready")
			// Both DaemonSets land on a node that carries it.
			for _, ds := range []string{"mesh-agent", "mesh-cni-hook"} {
				if tol := podSpec(t, objs, ds)["tolerations"].([]any); !slices.ContainsFunc(tol, func(t any) bool {
					return reflect.DeepEqual(t, map[string]any{"key": "example.com/not-ready", "operator": "Exists"})
				}) {
					t.Errorf("%s tolerations %v: want the startup taint's key", ds, tol)
				}
			}
			rules := objs["ClusterRole/<nil>/mesh-agent"]["rules"].([]any)
			if last := rules[len(rules)-1]; !reflect.DeepEqual(last, map[string]any{"apiGroups": []any{""}, "resources": []any{"nodes"}, "verbs": []any{"get", "patch"}}) {
				t.Errorf("the ClusterRole's last rule %v: want get and patch on nodes", last)
			}
			if got := policyVariable(t, objs, "startupTaint"); got != "'example.com/not-ready'" {
				t.Errorf("the admission policy's startupTaint is %s, want the key", got)
			}
		}},
		{"startup taint with tolerations of its own", "{startupTaint: {enabled: true}, tolerations: []}", func(t *testing.T, objs map[string]object, _ map[string]any) {
			if tol := podSpec(t, objs, "mesh-agent")["tolerations"]; !reflect.DeepEqual(tol, []any{map[string]any{"key": "mesh-cni.io/agent-not-ready", "operator": "Exists"}}) {
				t.Errorf("tolerations %v: want the startup taint's alone", tol)
			}
		}},
		{"redirection writers", "admissionPolicy: {redirectionWriters: [system:serviceaccount:istio-system:istio-cni]}", func(t *testing.T, objs map[string]object, _ map[string]any) {
			p, ok := objs["ValidatingAdmissionPolicy/<nil>/mesh-redirection-annotations"]
			if !ok {
				t.Fatalf("no mesh-redirection-annotations policy: %v", keys(objs))
			}
			want := "!(request.userInfo.username in ['system:serviceaccount:" + namespace + ":mesh-agent', 'system:serviceaccount:istio-system:istio-cni'])"
			var got []any
			for _, mc := range p["spec"].(map[string]any)["matchConditions"].([]any) {
				got = append(got, mc.(map[string]any)["expression"])
			}
			if !slices.Contains(got, any(want)) {
				t.Errorf("match conditions %q, want one %q", got, want)
			}
		}},
		{"uninstall on delete off", "uninstall: {onDelete: false}", func(t *testing.T, _ map[string]object, c map[string]any) {
			// On by default in the agent, so passed only to turn it off: the
			// pinned release, which does not know the flag, runs the default.
			wantArg(t, c, "--uninstall-on-delete=false")
		}},
		{"kni", "kni: {enabled: true, upstream: /run/kni/kni.sock}", func(t *testing.T, objs map[string]object, c map[string]any) {
			// The interposer is the gate, the chain entry off: the runtime
			// runs the node's CNI chain itself.
			for _, a := range []string{"--cni-install=false", "--kni-socket=/var/run/mesh-cni/kni/kni.sock", "--kni-upstream=/run/kni/kni.sock", "--kni-enroll-timeout=30s"} {
				wantArg(t, c, a)
			}
			spec := podSpec(t, objs, "mesh-agent")
			var remove map[string]any
			for _, ic := range spec["initContainers"].([]any) {
				if ic.(map[string]any)["name"] == "kni-remove-chain-entry" {
					remove = ic.(map[string]any)
				}
			}
			if remove == nil || !slices.Equal(argsOf(remove)[:2], []string{"uninstall", "--datapath=none"}) {
				t.Fatalf("no init container removing an earlier chain entry: %v", spec["initContainers"])
			}
			if got := hostPaths(spec); got["kni-upstream"] != "/run/kni" || got["kni-socket"] != "" {
				t.Errorf("host paths %v: want the runtime's socket directory, and the interposer's inside /var/run/mesh-cni", got)
			}
		}},
		{"runtime hook", "runtimeHook: {enabled: true, priority: 300, gateTimeout: 10s}", func(t *testing.T, objs map[string]object, c map[string]any) {
			// The agent is rendered as by default.
			if want := agentContainer(t, mustRender(t, nil)); !reflect.DeepEqual(c, want) {
				t.Errorf("the agent container changed with runtimeHook")
			}
			ds, ok := objs["DaemonSet/"+namespace+"/mesh-cni-hook"]
			if !ok {
				t.Fatalf("no hook DaemonSet: %v", keys(objs))
			}
			if ru := ds["spec"].(map[string]any)["updateStrategy"].(map[string]any)["rollingUpdate"].(map[string]any); ru["maxSurge"] != float64(1) || ru["maxUnavailable"] != float64(0) {
				t.Errorf("update strategy %v: want the new hook started before the old one stops", ru)
			}
			spec := podSpec(t, objs, "mesh-cni-hook")
			if spec["hostNetwork"] != true || spec["hostPID"] != false {
				t.Errorf("hostNetwork %v, hostPID %v: want the host's network and a PID namespace of its own", spec["hostNetwork"], spec["hostPID"])
			}
			hook := spec["containers"].([]any)[0].(map[string]any)
			for _, a := range []string{"hook", "--socket=/var/run/mesh-cni/gate.sock", "--hook-plugin-dir=/etc/containerd/net.d", "--hook-priority=300", "--gate-timeout=10s", "--exclude-namespaces=kube-system"} {
				wantArg(t, hook, a)
			}
			probe := hook["readinessProbe"].(map[string]any)["exec"].(map[string]any)["command"].([]any)
			if !slices.Contains(probe, any("--probe")) {
				t.Errorf("readiness probe %v", probe)
			}
			if got := hostPaths(spec); got["plugin-dir"] != "/etc/containerd/net.d" || got["mesh-run"] != "/var/run/mesh-cni" {
				t.Errorf("host paths %v", got)
			}
		}},
		{"CNI directories", "{platform: gke, cni: {binDir: /srv/cni/bin, confDir: /srv/cni/conf}}", func(t *testing.T, objs map[string]object, c map[string]any) {
			if got := hostPaths(podSpec(t, objs, "mesh-agent")); got["cni-bin"] != "/srv/cni/bin" || got["cni-conf"] != "/srv/cni/conf" {
				t.Errorf("host paths %v: want cni.binDir and cni.confDir over the platform's", got)
			}
			// Named, they are the operator's: the agent installs there
			// whatever the runtime loads from, and so does the Job remove.
			wantArg(t, c, "--cni-bin-dir=/opt/cni/bin")
			wantArg(t, c, "--cni-conf-dir=/etc/cni/net.d")
			job, ok := mustRender(t, map[string]any{"cni": map[string]any{"binDir": "/srv/cni/bin", "confDir": "/srv/cni/conf"}, "uninstall": map[string]any{"node": uninstallNode}})["Job/"+namespace+"/mesh-agent-uninstall-"+uninstallNode]
			if !ok {
				t.Fatal("no uninstall Job rendered")
			}
			uninstall := job["spec"].(map[string]any)["template"].(map[string]any)["spec"].(map[string]any)["containers"].([]any)[0].(map[string]any)
			wantArg(t, uninstall, "--cni-bin-dir=/opt/cni/bin")
			wantArg(t, uninstall, "--cni-conf-dir=/etc/cni/net.d")
		}},
		{"CNI bin directory alone", "cni: {binDir: /srv/cni/bin}", func(t *testing.T, _ map[string]object, c map[string]any) {
			wantArg(t, c, "--cni-bin-dir=/opt/cni/bin")
			if slices.ContainsFunc(argsOf(c), func(a string) bool { return strings.HasPrefix(a, "--cni-conf-dir") }) {
				t.Errorf("args %q: the conf dir was not named, so it is the runtime's to decide", argsOf(c))
			}
		}},
		{"runtime check", "cni: {runtimeCheck: true}", func(t *testing.T, _ map[string]object, c map[string]any) {
			wantArg(t, c, "--runtime-cni-check")
		}},
		{"metrics off the node", "metrics: {bindAddress: 0.0.0.0, port: 9464, scrapeAnnotations: true}", func(t *testing.T, objs map[string]object, c map[string]any) {
			wantArg(t, c, "--metrics-addr=0.0.0.0:9464")
			if p := c["ports"].([]any)[0].(map[string]any); p["containerPort"] != float64(9464) {
				t.Errorf("container port %v", p)
			}
			for _, probe := range []string{"startupProbe", "livenessProbe", "readinessProbe"} {
				if h := c[probe].(map[string]any)["httpGet"].(map[string]any); h["host"] != "127.0.0.1" || h["port"] != "metrics" {
					t.Errorf("%s %v: want loopback, which a wildcard bind serves", probe, h)
				}
			}
			ann := podTemplateMeta(t, objs, "annotations")
			if ann["prometheus.io/scrape"] != "true" || ann["prometheus.io/port"] != "9464" || ann["prometheus.io/path"] != "/metrics" {
				t.Errorf("annotations %v", ann)
			}
		}},
		{"metrics on one IPv6 address", "metrics: {bindAddress: 'fd00::1'}", func(t *testing.T, _ map[string]object, c map[string]any) {
			wantArg(t, c, "--metrics-addr=[fd00::1]:15099")
			if h := c["readinessProbe"].(map[string]any)["httpGet"].(map[string]any); h["host"] != "fd00::1" {
				t.Errorf("readiness probe %v: want the bound address", h)
			}
		}},
		{"metrics service, monitor and rules", "metrics: {bindAddress: 0.0.0.0, service: {enabled: true}, serviceMonitor: {enabled: true, interval: 15s, labels: {release: kps}}, prometheusRule: {enabled: true, labels: {release: kps}}}", func(t *testing.T, objs map[string]object, _ map[string]any) {
			svc, ok := objs["Service/"+namespace+"/mesh-agent-metrics"]
			if !ok {
				t.Fatalf("no Service: %v", keys(objs))
			}
			spec := svc["spec"].(map[string]any)
			if spec["clusterIP"] != "None" || spec["selector"].(map[string]any)["app.kubernetes.io/name"] != "mesh-agent" {
				t.Errorf("Service spec %v", spec)
			}
			sm, ok := objs["ServiceMonitor/"+namespace+"/mesh-agent"]
			if !ok {
				t.Fatalf("no ServiceMonitor: %v", keys(objs))
			}
			ep := sm["spec"].(map[string]any)["endpoints"].([]any)[0].(map[string]any)
			if ep["port"] != "metrics" || ep["interval"] != "15s" || sm["metadata"].(map[string]any)["labels"].(map[string]any)["release"] != "kps" {
				t.Errorf("ServiceMonitor %v", sm)
			}
			pr, ok := objs["PrometheusRule/"+namespace+"/mesh-agent"]
			if !ok {
				t.Fatalf("no PrometheusRule: %v", keys(objs))
			}
			var file map[string]any
			data, err := os.ReadFile(filepath.Join(chartDir, "files", "prometheus-rules.yaml"))
			if err != nil {
				t.Fatal(err)
			}
			if err := yaml.Unmarshal(data, &file); err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(pr["spec"], object(file)) && !reflect.DeepEqual(pr["spec"], file) {
				t.Errorf("the PrometheusRule's spec is not files/prometheus-rules.yaml:\n%v", pr["spec"])
			}
		}},
		{"scheduling", `{nodeSelector: {pool: mesh}, tolerations: [{key: dedicated, operator: Equal, value: infra, effect: NoSchedule}],
			affinity: {nodeAffinity: {requiredDuringSchedulingIgnoredDuringExecution: {nodeSelectorTerms: [{matchExpressions: [{key: kubernetes.io/arch, operator: In, values: [amd64]}]}]}}},
			priorityClassName: mesh-critical, imagePullSecrets: [{name: regcred}], runtimeHook: {enabled: true}}`, func(t *testing.T, objs map[string]object, _ map[string]any) {
			for _, ds := range []string{"mesh-agent", "mesh-cni-hook"} {
				spec := podSpec(t, objs, ds)
				// Helm merges maps into the defaults (a key set to null drops one).
				if !reflect.DeepEqual(spec["nodeSelector"], map[string]any{"pool": "mesh", "kubernetes.io/os": "linux"}) {
					t.Errorf("%s nodeSelector %v", ds, spec["nodeSelector"])
				}
				if tol := spec["tolerations"].([]any); len(tol) != 1 || tol[0].(map[string]any)["key"] != "dedicated" {
					t.Errorf("%s tolerations %v", ds, tol)
				}
				if _, ok := spec["affinity"].(map[string]any)["nodeAffinity"]; !ok {
					t.Errorf("%s affinity %v", ds, spec["affinity"])
				}
				if spec["priorityClassName"] != "mesh-critical" {
					t.Errorf("%s priorityClassName %v", ds, spec["priorityClassName"])
				}
				if !reflect.DeepEqual(spec["imagePullSecrets"], []any{map[string]any{"name": "regcred"}}) {
					t.Errorf("%s imagePullSecrets %v", ds, spec["imagePullSecrets"])
				}
			}
		}},
		{"pod labels and annotations", "{podLabels: {team: net}, podAnnotations: {example.com/owner: net}}", func(t *testing.T, objs map[string]object, _ map[string]any) {
			if l := podTemplateMeta(t, objs, "labels"); l["team"] != "net" || l["app.kubernetes.io/name"] != "mesh-agent" {
				t.Errorf("labels %v", l)
			}
			if a := podTemplateMeta(t, objs, "annotations"); a["example.com/owner"] != "net" || a["kubectl.kubernetes.io/default-container"] != "agent" {
				t.Errorf("annotations %v", a)
			}
		}},
		{"update strategy", "updateStrategy: {type: OnDelete}", func(t *testing.T, objs map[string]object, _ map[string]any) {
			ds := objs["DaemonSet/"+namespace+"/mesh-agent"]
			if us := ds["spec"].(map[string]any)["updateStrategy"]; !reflect.DeepEqual(us, map[string]any{"type": "OnDelete"}) {
				t.Errorf("updateStrategy %v", us)
			}
		}},
		{"extra env and args", "{extraEnv: [{name: GODEBUG, value: 'madvdontneed=1'}], extraArgs: [--reconcile-interval=1m]}", func(t *testing.T, _ map[string]object, c map[string]any) {
			args := argsOf(c)
			if args[len(args)-1] != "--reconcile-interval=1m" {
				t.Errorf("args %q: want the extra flag last", args)
			}
			env := c["env"].([]any)
			if last := env[len(env)-1].(map[string]any); last["name"] != "GODEBUG" || last["value"] != "madvdontneed=1" {
				t.Errorf("env %v", env)
			}
		}},
		{"security profiles", "{seccompProfile: {type: RuntimeDefault}, seLinuxOptions: {type: spc_t}, appArmorProfile: {type: Localhost, localhostProfile: mesh-agent}}", func(t *testing.T, _ map[string]object, c map[string]any) {
			sc := c["securityContext"].(map[string]any)
			if !reflect.DeepEqual(sc["seccompProfile"], map[string]any{"type": "RuntimeDefault"}) ||
				!reflect.DeepEqual(sc["seLinuxOptions"], map[string]any{"type": "spc_t"}) ||
				!reflect.DeepEqual(sc["appArmorProfile"], map[string]any{"type": "Localhost", "localhostProfile": "mesh-agent"}) {
				t.Errorf("securityContext %v", sc)
			}
		}},
		{"gate timeout and log format", "{gateTimeout: 2m, logFormat: console, runtimeHook: {enabled: true}}", func(t *testing.T, objs map[string]object, c map[string]any) {
			wantArg(t, c, "--gate-timeout=2m")
			wantArg(t, c, "--log-format=console")
			wantArg(t, podSpec(t, objs, "mesh-cni-hook")["containers"].([]any)[0].(map[string]any), "--log-format=console")
		}},
		{"probes and termination grace", "{probes: {liveness: {periodSeconds: 20}, readiness: {failureThreshold: 5, successThreshold: 2}}, terminationGracePeriodSeconds: 40}", func(t *testing.T, objs map[string]object, c map[string]any) {
			// Maps merge into the defaults: what is not set keeps its value.
			for probe, want := range map[string]map[string]any{
				"startupProbe":   {"periodSeconds": float64(2), "failureThreshold": float64(30)},
				"livenessProbe":  {"periodSeconds": float64(20), "timeoutSeconds": float64(3), "failureThreshold": float64(3)},
				"readinessProbe": {"periodSeconds": float64(5), "timeoutSeconds": float64(3), "failureThreshold": float64(5), "successThreshold": float64(2)},
			} {
				got := map[string]any{}
				for k, v := range c[probe].(map[string]any) {
					if k != "httpGet" {
						got[k] = v
					}
				}
				if !reflect.DeepEqual(got, want) {
					t.Errorf("%s timings %v, want %v", probe, got, want)
				}
			}
			if g := podSpec(t, objs, "mesh-agent")["terminationGracePeriodSeconds"]; g != float64(40) {
				t.Errorf("terminationGracePeriodSeconds %v", g)
			}
		}},
		{"resources", "resources: {requests: {cpu: 100m, memory: 128Mi}, limits: {memory: 1Gi}}", func(t *testing.T, _ map[string]object, c map[string]any) {
			want := map[string]any{"requests": map[string]any{"cpu": "100m", "memory": "128Mi"}, "limits": map[string]any{"memory": "1Gi"}}
			if !reflect.DeepEqual(c["resources"], want) {
				t.Errorf("resources %v", c["resources"])
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var values map[string]any
			if err := yaml.Unmarshal([]byte(tc.values), &values); err != nil {
				t.Fatal(err)
			}
			objs := mustRender(t, values)
			tc.check(t, objs, agentContainer(t, objs))
		})
	}
}

// policyVariable is the expression of the admission policy's variable name.
func policyVariable(t *testing.T, objs map[string]object, name string) string {
	t.Helper()
	p, ok := objs["ValidatingAdmissionPolicy/<nil>/mesh-agent"]
	if !ok {
		t.Fatalf("no admission policy rendered: %v", keys(objs))
	}
	for _, v := range p["spec"].(map[string]any)["variables"].([]any) {
		if v := v.(map[string]any); v["name"] == name {
			return v["expression"].(string)
		}
	}
	t.Fatalf("the admission policy has no variable %s", name)
	return ""
}

// podTemplateMeta is a field of the agent's pod template's metadata.
func podTemplateMeta(t *testing.T, objs map[string]object, field string) map[string]any {
	t.Helper()
	ds := objs["DaemonSet/"+namespace+"/mesh-agent"]
	m, _ := ds["spec"].(map[string]any)["template"].(map[string]any)["metadata"].(map[string]any)[field].(map[string]any)
	return m
}

// podSpec is the pod template's spec of the DaemonSet name.
func podSpec(t *testing.T, objs map[string]object, name string) map[string]any {
	t.Helper()
	ds, ok := objs["DaemonSet/"+namespace+"/"+name]
	if !ok {
		t.Fatalf("no DaemonSet %s rendered: %v", name, keys(objs))
	}
	return ds["spec"].(map[string]any)["template"].(map[string]any)["spec"].(map[string]any)
}

// hostPaths maps a pod spec's hostPath volumes to their paths.
func hostPaths(spec map[string]any) map[string]string {
	out := map[string]string{}
	for _, v := range spec["volumes"].([]any) {
		v := v.(map[string]any)
		if hp, ok := v["hostPath"].(map[string]any); ok {
			out[v["name"].(string)] = hp["path"].(string)
		}
	}
	return out
}

func wantArg(t *testing.T, c map[string]any, arg string) {
	t.Helper()
	if !slices.Contains(argsOf(c), arg) {
		t.Errorf("args %q lack %q", argsOf(c), arg)
	}
}

// Values the agent could not run with are refused at render time, saying why.
func TestRejects(t *testing.T) {
	for _, tc := range []struct {
		values string
		why    string
	}{
		{"enrollment: everything", "enrollment"},
		{"selectorProfile: linkerd", "selectorProfile"},
		{"enrollment: all", "service accounts"},
		{"{enrollment: file, zds: {enabled: false}}", "needs a policy"},
		{"image: {digest: sha256:short}", "digest"},
		{"image: {digest: ''}", "image.digest (or image.tag)"},
		{"excludeNamespaces: [Kube_System]", "excludeNamespaces"},
		{"plugin: {logFile: relative.log}", "logFile"},
		{"proxyMark: mark", "proxyMark"},
		{"denyRawSockets: 'yes'", "denyRawSockets"},
		{"imagee: {tag: x}", "imagee"},
		{"admissionPolicy: {enabled: 'yes'}", "admissionPolicy"},
		{`admissionPolicy: {redirectionWriters: ["x', 'y"]}`, "redirectionWriters"},
		{"kni: {enabled: true, upstream: kni.sock}", "upstream"},
		{"kni: {enrollTimeout: 30}", "enrollTimeout"},
		{"runtimeHook: {enabled: true, priority: 0}", "priority"},
		{"runtimeHook: {pluginDir: net.d}", "pluginDir"},
		{"platform: aks", "platform"},
		{"cni: {binDir: bin}", "binDir"},
		{"cni: {confdir: /etc/cni}", "confdir"},
		{"metrics: {bindAddress: localhost}", "bindAddress"},
		{"metrics: {port: 0}", "port"},
		{"metrics: {serviceMonitor: {interval: often}}", "interval"},
		{"extraArgs: [reconcile-interval=1m]", "extraArgs"},
		{"extraEnv: [{value: x}]", "name"},
		{"updateStrategy: {type: Recreate}", "updateStrategy"},
		{"tolerations: {operator: Exists}", "tolerations"},
		{"imagePullSecrets: [regcred]", "imagePullSecrets"},
		{"startupTaint: {enabled: 'yes'}", "startupTaint"},
		{"startupTaint: {enabled: true, key: \"x' || true || '\"}", "/startupTaint/key"},
		{"startupTaint: {key: a/b/c}", "/startupTaint/key"},
		{"startupTaint: {enabeld: true}", "enabeld"},
		{"logFormat: text", "logFormat"},
		{"gateTimeout: 30", "gateTimeout"},
		{"probes: {liveness: {periodSeconds: 0}}", "periodSeconds"},
		{"probes: {liveness: {successThreshold: 2}}", "successThreshold"},
		{"probes: {readiness: {httpGet: {path: /}}}", "httpGet"},
		{"terminationGracePeriodSeconds: 5", "terminationGracePeriodSeconds"},
		{"metrics: {dashboard: {enabeld: true}}", "enabeld"},
	} {
		var values map[string]any
		if err := yaml.Unmarshal([]byte(tc.values), &values); err != nil {
			t.Fatal(err)
		}
		_, err := render(t, values)
		if err == nil {
			t.Errorf("%s: rendered without error", tc.values)
			continue
		}
		if !strings.Contains(err.Error(), tc.why) {
			t.Errorf("%s: error %q does not say %q", tc.values, err, tc.why)
		}
	}
}

func TestMain(m *testing.M) {
	// The chart is read from the module's directory.
	if _, err := os.Stat(filepath.Join(chartDir, "Chart.yaml")); err != nil {
		fmt.Fprintf(os.Stderr, "run from install/helm: %v\n", err)
		os.Exit(1)
	}
	os.Exit(m.Run())
}
