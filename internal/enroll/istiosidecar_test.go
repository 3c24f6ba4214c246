package enroll

import (
	"net/netip"
	"reflect"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mesh-cni/mesh-cni/internal/podstore"
)

// injected is a pod as Istio's injector leaves it with istio-cni: the
// validation init container, the proxy as a native sidecar, the status.
func injected(annotations map[string]string) *corev1.Pod {
	uid := int64(1337)
	a := map[string]string{IstioAnnotationSidecar: `{"initContainers":["istio-validation","istio-proxy"]}`}
	for k, v := range annotations {
		a[k] = v
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "cart", UID: "u-1", Annotations: a},
		Spec: corev1.PodSpec{
			InitContainers: []corev1.Container{
				{Name: "istio-validation", Args: []string{"istio-iptables", "--run-validation", "--skip-rule-apply"}},
				{Name: IstioProxyContainer, Args: []string{"proxy", "sidecar"}, SecurityContext: &corev1.SecurityContext{RunAsUser: &uid}},
			},
			Containers: []corev1.Container{{Name: "app"}},
		},
	}
}

func TestIstioSidecarPod(t *testing.T) {
	for _, c := range []struct {
		name   string
		change func(*corev1.Pod)
		want   bool
	}{
		{"injected", func(*corev1.Pod) {}, true},
		{"proxy as a regular container", func(p *corev1.Pod) {
			p.Spec.Containers = append(p.Spec.Containers, p.Spec.InitContainers[1])
			p.Spec.InitContainers = p.Spec.InitContainers[:1]
		}, true},
		{"no status", func(p *corev1.Pod) { delete(p.Annotations, IstioAnnotationSidecar) }, false},
		{"istio-init", func(p *corev1.Pod) { p.Spec.InitContainers[0].Name = IstioInitContainer }, false},
		{"no proxy", func(p *corev1.Pod) { p.Spec.InitContainers = p.Spec.InitContainers[:1] }, false},
		{"gateway", func(p *corev1.Pod) { p.Spec.InitContainers[1].Args = []string{"proxy", "router"} }, false},
		{"envoy off", func(p *corev1.Pod) {
			p.Spec.InitContainers[1].Env = []corev1.EnvVar{{Name: "DISABLE_ENVOY", Value: "true"}}
		}, false},
		{"inject=false annotation", func(p *corev1.Pod) { p.Annotations[IstioAnnotationInject] = "false" }, false},
		{"inject=false label wins", func(p *corev1.Pod) {
			p.Annotations[IstioAnnotationInject] = "true"
			p.Labels = map[string]string{IstioLabelInject: "false"}
		}, false},
	} {
		p := injected(nil)
		c.change(p)
		if got, why := IstioSidecarPod(p); got != c.want {
			t.Errorf("%s: sidecar %v (%s), want %v", c.name, got, why, c.want)
		}
	}
}

func TestIstioSidecarCapture(t *testing.T) {
	pfx := netip.MustParsePrefix
	base := podstore.Sidecar{
		ProxyUID: 1337, CgroupUID: "u-1",
		InboundExcludedPorts:  []uint16{15008, 15020, 15021, 15090},
		OutboundExcludedPorts: []uint16{15020},
	}
	for _, c := range []struct {
		name        string
		annotations map[string]string
		change      func(*podstore.Sidecar)
	}{
		{"defaults", nil, func(*podstore.Sidecar) {}},
		{"exclusions", map[string]string{
			istioExcludeInboundPorts:  "22, 8443",
			istioExcludeOutboundPorts: "3306,5432",
			istioExcludeOutboundCIDRs: "10.96.0.0/12,fd00::/8",
		}, func(s *podstore.Sidecar) {
			s.InboundExcludedPorts = []uint16{22, 8443, 15008, 15020, 15021, 15090}
			s.OutboundExcludedPorts = []uint16{3306, 5432}
			s.ExcludedCIDRs = []netip.Prefix{pfx("10.96.0.0/12"), pfx("fd00::/8")}
		}},
		{"inclusions", map[string]string{
			istioIncludeOutboundCIDRs: "10.0.0.0/8",
			istioIncludeOutboundPorts: "443",
			istioIncludeInboundPorts:  "8080,15020",
		}, func(s *podstore.Sidecar) {
			s.OutboundCIDRsOnly, s.IncludedCIDRs, s.OutboundIncludedPorts = true, []netip.Prefix{pfx("10.0.0.0/8")}, []uint16{443}
			s.InboundPortsOnly, s.InboundIncludedPorts = true, []uint16{8080, 15020}
			s.InboundExcludedPorts = []uint16{15008}
		}},
		{"nothing inbound, nothing outbound", map[string]string{
			istioIncludeOutboundCIDRs: "", istioIncludeInboundPorts: "",
		}, func(s *podstore.Sidecar) {
			s.OutboundCIDRsOnly, s.InboundPortsOnly = true, true
			s.InboundExcludedPorts = []uint16{15008}
		}},
		{"included ports with every destination", map[string]string{istioIncludeOutboundPorts: "443"}, func(*podstore.Sidecar) {}},
		{"TPROXY", map[string]string{istioInterceptionMode: "TPROXY"}, func(*podstore.Sidecar) {}},
	} {
		got, err := IstioSidecarCapture(injected(c.annotations))
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		want := base
		want.InboundExcludedPorts = append([]uint16(nil), base.InboundExcludedPorts...)
		c.change(&want)
		if !reflect.DeepEqual(*got, want) {
			t.Errorf("%s:\n got %+v\nwant %+v", c.name, *got, want)
		}
	}

	// The proxy's own uid and DNS capture come from its container.
	p := injected(nil)
	uid := int64(2000)
	p.Spec.InitContainers[1].SecurityContext.RunAsUser = &uid
	p.Spec.InitContainers[1].Env = []corev1.EnvVar{{Name: "ISTIO_META_DNS_CAPTURE", Value: "true"}}
	if got, err := IstioSidecarCapture(p); err != nil || got.ProxyUID != 2000 || !got.DNS {
		t.Errorf("proxy uid 2000 with DNS capture: %+v, %v", got, err)
	}
}

// What istio-cni refuses fails the pod with the annotation named, all at once.
func TestIstioSidecarCaptureRefuses(t *testing.T) {
	bad := map[string]string{
		istioInterceptionMode:     "NONE",
		istioExcludeInboundPorts:  "http",
		istioExcludeOutboundPorts: "*",
		istioIncludeOutboundCIDRs: "10.0.0.0/33",
		istioIncludeInboundPorts:  "0",
		istioExcludeInterfaces:    "net1",
		istioRerouteInterfaces:    "tap0",
	}
	_, err := IstioSidecarCapture(injected(bad))
	if err == nil {
		t.Fatal("no error")
	}
	for key := range bad {
		if !strings.Contains(err.Error(), key) {
			t.Errorf("error does not name %s: %v", key, err)
		}
	}
}

func TestIstioProxyContainerID(t *testing.T) {
	p := injected(nil)
	if id := IstioProxyContainerID(p); id != "" {
		t.Errorf("no status: %q", id)
	}
	running := corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}
	p.Status.InitContainerStatuses = []corev1.ContainerStatus{
		{Name: "istio-validation", ContainerID: "containerd://aaa", State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{}}},
		{Name: IstioProxyContainer, ContainerID: "containerd://bbb", State: running},
	}
	if id := IstioProxyContainerID(p); id != "bbb" {
		t.Errorf("native sidecar: %q, want bbb", id)
	}
	p.Status.InitContainerStatuses[1].State = corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{}}
	if id := IstioProxyContainerID(p); id != "" {
		t.Errorf("waiting: %q", id)
	}
	p.Status.InitContainerStatuses[1] = corev1.ContainerStatus{Name: IstioProxyContainer, ContainerID: "containerd://../x", State: running}
	if id := IstioProxyContainerID(p); id != "" {
		t.Errorf("an id that is a path: %q", id)
	}
}

// The informer's cache holds pods trimmed: what it keeps must give the same
// sidecar decision, capture and proxy container.
func TestIstioSidecarOfTrimmedPod(t *testing.T) {
	p := injected(map[string]string{istioExcludeOutboundPorts: "3306"})
	uid := int64(2000)
	proxy := &p.Spec.InitContainers[1]
	proxy.SecurityContext.RunAsUser = &uid
	proxy.Env = []corev1.EnvVar{{Name: "ISTIO_META_DNS_CAPTURE", Value: "true"}, {Name: "OTHER", Value: "x"}}
	running := corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: metav1.Now()}}
	p.Status.InitContainerStatuses = []corev1.ContainerStatus{{Name: IstioProxyContainer, ContainerID: "containerd://bbb", State: running}}
	p.Status.ContainerStatuses = []corev1.ContainerStatus{{Name: "app", ContainerID: "containerd://ccc", State: running}}
	obj, err := trimPod(p)
	if err != nil {
		t.Fatal(err)
	}
	trimmed := obj.(*corev1.Pod)
	if a, b := IstioProxyContainerID(p), IstioProxyContainerID(trimmed); a != b || a == "" {
		t.Errorf("proxy container %q, of the trimmed pod %q", a, b)
	}
	want, err1 := IstioSidecarCapture(p)
	got, err2 := IstioSidecarCapture(trimmed)
	if err1 != nil || err2 != nil || !reflect.DeepEqual(want, got) {
		t.Errorf("capture %+v (%v), of the trimmed pod %+v (%v)", want, err1, got, err2)
	}
	for _, change := range []func(*corev1.Pod){
		func(p *corev1.Pod) { p.Spec.InitContainers[1].Args = []string{"proxy", "router"} },
		func(p *corev1.Pod) {
			p.Spec.InitContainers[1].Env = []corev1.EnvVar{{Name: "DISABLE_ENVOY", Value: "true"}}
		},
	} {
		change(p)
		obj, _ := trimPod(p)
		if a, _ := IstioSidecarPod(p); a {
			t.Fatal("changed pod still a sidecar pod")
		}
		if b, why := IstioSidecarPod(obj.(*corev1.Pod)); b {
			t.Errorf("trimmed pod taken for a sidecar pod where the pod is not (%s)", why)
		}
		p = injected(nil)
	}
}
