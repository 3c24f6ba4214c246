package enroll

import (
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

func TestKubeletPorts(t *testing.T) {
	httpProbe := func(host string, port intstr.IntOrString) *corev1.Probe {
		return &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Host: host, Port: port}}}
	}
	tcpProbe := func(host string, port int32) *corev1.Probe {
		return &corev1.Probe{ProbeHandler: corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Host: host, Port: intstr.FromInt32(port)}}}
	}
	grpcProbe := func(port int32) *corev1.Probe {
		return &corev1.Probe{ProbeHandler: corev1.ProbeHandler{GRPC: &corev1.GRPCAction{Port: port}}}
	}
	execProbe := &corev1.Probe{ProbeHandler: corev1.ProbeHandler{Exec: &corev1.ExecAction{Command: []string{"true"}}}}
	named := []corev1.ContainerPort{{Name: "http", ContainerPort: 8080}, {Name: "admin", ContainerPort: 9901}}

	for _, tc := range []struct {
		name string
		spec corev1.PodSpec
		want []uint16
	}{
		{name: "no probes", spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "app"}}}, want: []uint16{}},
		{name: "exec probes connect nowhere", spec: corev1.PodSpec{Containers: []corev1.Container{{
			Name: "app", LivenessProbe: execProbe, ReadinessProbe: execProbe,
		}}}, want: []uint16{}},
		{name: "every kind, sorted, once each", spec: corev1.PodSpec{Containers: []corev1.Container{{
			Name: "app", Ports: named,
			LivenessProbe:  httpProbe("", intstr.FromString("http")),
			ReadinessProbe: tcpProbe("", 8080),
			StartupProbe:   grpcProbe(9000),
			Lifecycle: &corev1.Lifecycle{
				PostStart: &corev1.LifecycleHandler{HTTPGet: &corev1.HTTPGetAction{Port: intstr.FromInt32(7000)}},
				PreStop:   &corev1.LifecycleHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromString("admin")}},
			},
		}}}, want: []uint16{7000, 8080, 9000, 9901}},
		{name: "init and restartable init containers", spec: corev1.PodSpec{
			InitContainers: []corev1.Container{{Name: "sidecar", StartupProbe: tcpProbe("", 15021)}},
			Containers:     []corev1.Container{{Name: "app", ReadinessProbe: tcpProbe("", 80)}},
		}, want: []uint16{80, 15021}},
		{name: "a probe aimed at another host is not this pod's", spec: corev1.PodSpec{Containers: []corev1.Container{{
			Name:           "app",
			LivenessProbe:  httpProbe("10.0.0.9", intstr.FromInt32(8080)),
			ReadinessProbe: tcpProbe("other.example", 5432),
			Lifecycle: &corev1.Lifecycle{
				PreStop: &corev1.LifecycleHandler{HTTPGet: &corev1.HTTPGetAction{Host: "10.0.0.9", Port: intstr.FromInt32(9090)}},
			},
			StartupProbe: tcpProbe("", 81),
		}}}, want: []uint16{81}},
		{name: "named ports resolve in their own container only", spec: corev1.PodSpec{Containers: []corev1.Container{
			{Name: "a", Ports: named},
			{Name: "b", LivenessProbe: httpProbe("", intstr.FromString("http"))},
		}}, want: []uint16{}},
		{name: "a string of digits is a number", spec: corev1.PodSpec{Containers: []corev1.Container{{
			Name: "app", LivenessProbe: httpProbe("", intstr.FromString("8443")),
		}}}, want: []uint16{8443}},
		{name: "out of range ports are left out", spec: corev1.PodSpec{Containers: []corev1.Container{{
			Name: "app", LivenessProbe: tcpProbe("", 70000), ReadinessProbe: tcpProbe("", 0), StartupProbe: grpcProbe(-1),
		}}}, want: []uint16{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pod := &corev1.Pod{Spec: tc.spec}
			got := KubeletPorts(pod)
			if got == nil || !slices.Equal(got, tc.want) {
				t.Errorf("KubeletPorts = %#v, want %#v", got, tc.want)
			}
			// The informer's cache holds pods trimmed: what it keeps must
			// give the same ports.
			trimmed, err := trimPod(pod)
			if err != nil {
				t.Fatal(err)
			}
			if got := KubeletPorts(trimmed.(*corev1.Pod)); !slices.Equal(got, tc.want) {
				t.Errorf("KubeletPorts of the cached pod = %#v, want %#v", got, tc.want)
			}
		})
	}
}
