package enroll

import (
	"slices"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// KubeletPorts are the ports of pod p the kubelet connects to on the pod's own
// behalf: those of its containers' liveness, readiness and startup probes
// (httpGet, tcpSocket, grpc) and of their postStart and preStop hooks (httpGet,
// tcpSocket), init containers' included (a restartable one has probes), sorted
// and without duplicates, never nil. A probe or hook that names a host connects
// there, not to this pod, and is left out: the data path captures the kubelet's
// connections to any port not listed, so a probe another pod's author aims at
// this pod goes through its proxy. A named port is resolved against the
// container's own ports, as the kubelet resolves it; one that names none is
// left out (the kubelet's probe fails before it connects).
func KubeletPorts(p *corev1.Pod) []uint16 {
	out := []uint16{}
	add := func(c *corev1.Container, host string, port intstr.IntOrString) {
		if host != "" {
			return
		}
		if n, ok := resolvePort(c, port); ok {
			out = append(out, n)
		}
	}
	handler := func(c *corev1.Container, h *corev1.ProbeHandler) {
		switch {
		case h.HTTPGet != nil:
			add(c, h.HTTPGet.Host, h.HTTPGet.Port)
		case h.TCPSocket != nil:
			add(c, h.TCPSocket.Host, h.TCPSocket.Port)
		case h.GRPC != nil:
			add(c, "", intstr.FromInt32(h.GRPC.Port))
		}
	}
	hook := func(c *corev1.Container, h *corev1.LifecycleHandler) {
		switch {
		case h == nil:
		case h.HTTPGet != nil:
			add(c, h.HTTPGet.Host, h.HTTPGet.Port)
		case h.TCPSocket != nil:
			add(c, h.TCPSocket.Host, h.TCPSocket.Port)
		}
	}
	visit := func(cs []corev1.Container) {
		for i := range cs {
			c := &cs[i]
			for _, pr := range []*corev1.Probe{c.LivenessProbe, c.ReadinessProbe, c.StartupProbe} {
				if pr != nil {
					handler(c, &pr.ProbeHandler)
				}
			}
			if c.Lifecycle != nil {
				hook(c, c.Lifecycle.PostStart)
				hook(c, c.Lifecycle.PreStop)
			}
		}
	}
	visit(p.Spec.InitContainers)
	visit(p.Spec.Containers)
	slices.Sort(out)
	return slices.Compact(out)
}

// resolvePort is port as a number: itself (a string of digits too, as the
// kubelet reads it), or the container port of that name.
func resolvePort(c *corev1.Container, port intstr.IntOrString) (uint16, bool) {
	n := port.IntValue() // a string that is not a number reads 0
	if port.Type == intstr.String && n == 0 {
		for _, cp := range c.Ports {
			if cp.Name == port.StrVal {
				n = int(cp.ContainerPort)
				break
			}
		}
	}
	if n <= 0 || n > 65535 {
		return 0, false
	}
	return uint16(n), true
}
