package hostproc

import (
	"errors"
	"strings"
	"testing"
)

// A cgroup path is a pod container's only at exactly the place the kubelet's
// driver and cgroupRoot give it: not a level deeper (a cgroup a process made
// inside its container's, named after another pod), not under another prefix,
// not at the pod's own level.
func TestPodCgroupLayout(t *testing.T) {
	const uid = "0f1e2d3c-aaaa-bbbb-cccc-123456789abc"
	const other = "99999999-aaaa-bbbb-cccc-123456789abc"
	us := strings.ReplaceAll(uid, "-", "_")
	os := strings.ReplaceAll(other, "-", "_")
	const id = "4f2a0c6e9d1b3a5c7e9f0a2b4c6d8e0f1a3b5c7d9e1f2a4b6c8d0e2f4a6b8c0d"
	const hash = "5b1c7d0e2f3a4b5c6d7e8f9a0b1c2d3e"
	type want struct{ uid, container string }
	for _, c := range []struct {
		layout PodCgroupLayout
		path   string
		want   want // zero: refused
		notPod bool // refused as outside the pods' cgroups
	}{
		// cgroupfs, root /.
		{PodCgroupLayout{DriverCgroupfs, "/"}, "/kubepods/besteffort/pod" + uid + "/" + id, want{uid, id}, false},
		{PodCgroupLayout{DriverCgroupfs, "/"}, "/kubepods/burstable/pod" + uid + "/" + id, want{uid, id}, false},
		{PodCgroupLayout{DriverCgroupfs, "/"}, "/kubepods/pod" + uid + "/" + id, want{uid, id}, false},
		{PodCgroupLayout{DriverCgroupfs, "/"}, "/kubepods/burstable/pod" + hash + "/" + id, want{hash, id}, false},
		{PodCgroupLayout{DriverCgroupfs, "/"}, "/kubepods/besteffort/pod" + other + "/" + id + "/pod" + uid + "/" + id, want{}, false},
		{PodCgroupLayout{DriverCgroupfs, "/"}, "/kubepods/besteffort/pod" + uid, want{}, false},
		{PodCgroupLayout{DriverCgroupfs, "/"}, "/kubepods/besteffort/pod" + uid + "/", want{}, false},
		{PodCgroupLayout{DriverCgroupfs, "/"}, "/kubepods/guaranteed/pod" + uid + "/" + id, want{}, false},
		{PodCgroupLayout{DriverCgroupfs, "/"}, "/kubepods/besteffort/burstable/pod" + uid + "/" + id, want{}, false},
		{PodCgroupLayout{DriverCgroupfs, "/"}, "/other/kubepods/besteffort/pod" + uid + "/" + id, want{}, true},
		{PodCgroupLayout{DriverCgroupfs, "/"}, "/../../kubepods/besteffort/pod" + uid + "/" + id, want{}, true},
		{PodCgroupLayout{DriverCgroupfs, "/"}, "/kubepods.slice/kubepods-pod" + us + ".slice/cri-containerd-" + id + ".scope", want{}, true},
		{PodCgroupLayout{DriverCgroupfs, "/"}, "/system.slice/containerd.service", want{}, true},
		{PodCgroupLayout{DriverCgroupfs, "/"}, "/", want{}, true},
		// cgroupfs under a cgroupRoot of the node's.
		{PodCgroupLayout{DriverCgroupfs, "/mesh-node-1a2b3c"}, "/mesh-node-1a2b3c/kubepods/besteffort/pod" + uid + "/" + id, want{uid, id}, false},
		{PodCgroupLayout{DriverCgroupfs, "/mesh-node-1a2b3c/"}, "/mesh-node-1a2b3c/kubepods/pod" + uid + "/" + id, want{uid, id}, false},
		{PodCgroupLayout{DriverCgroupfs, "/mesh-node-1a2b3c"}, "/kubepods/besteffort/pod" + uid + "/" + id, want{}, true},
		{PodCgroupLayout{DriverCgroupfs, "/mesh-node-1a2b3c"}, "/mesh-node-1a2b3c/x/kubepods/besteffort/pod" + uid + "/" + id, want{}, true},
		// systemd, root /.
		{PodCgroupLayout{DriverSystemd, "/"}, "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + us + ".slice/cri-containerd-" + id + ".scope", want{uid, id}, false},
		{PodCgroupLayout{DriverSystemd, "/"}, "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + us + ".slice/crio-" + id + ".scope", want{uid, id}, false},
		{PodCgroupLayout{DriverSystemd, "/"}, "/kubepods.slice/kubepods-pod" + us + ".slice/cri-containerd-" + id + ".scope", want{uid, id}, false},
		{PodCgroupLayout{DriverSystemd, "/"}, "/kubepods.slice/kubepods-pod" + us + ".slice/cri-containerd-" + id + ".scope/kubepods-pod" + os + ".slice/cri-containerd-" + id + ".scope", want{}, false},
		{PodCgroupLayout{DriverSystemd, "/"}, "/kubepods.slice/kubepods-burstable.slice/kubepods-besteffort-pod" + us + ".slice/cri-containerd-" + id + ".scope", want{}, false},
		{PodCgroupLayout{DriverSystemd, "/"}, "/kubepods.slice/kubepods-pod" + uid + ".slice/cri-containerd-" + id + ".scope", want{}, false},
		{PodCgroupLayout{DriverSystemd, "/"}, "/kubepods.slice/kubepods-pod" + us + ".slice/" + id, want{}, false},
		{PodCgroupLayout{DriverSystemd, "/"}, "/kubepods.slice/kubepods-pod" + us + ".slice", want{}, false},
		{PodCgroupLayout{DriverSystemd, "/"}, "/system.slice/kubepods.slice/kubepods-pod" + us + ".slice/cri-containerd-" + id + ".scope", want{}, true},
		{PodCgroupLayout{DriverSystemd, "/"}, "/kubepods/pod" + uid + "/" + id, want{}, true},
		// systemd under a cgroupRoot: the root's names lead every slice's.
		{PodCgroupLayout{DriverSystemd, "/mesh-node"}, "/mesh_node.slice/mesh_node-kubepods.slice/mesh_node-kubepods-besteffort.slice/mesh_node-kubepods-besteffort-pod" + us + ".slice/cri-containerd-" + id + ".scope", want{uid, id}, false},
		{PodCgroupLayout{DriverSystemd, "/a/b"}, "/a.slice/a-b.slice/a-b-kubepods.slice/a-b-kubepods-pod" + us + ".slice/cri-containerd-" + id + ".scope", want{uid, id}, false},
		{PodCgroupLayout{DriverSystemd, "/mesh-node"}, "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + us + ".slice/cri-containerd-" + id + ".scope", want{}, true},
	} {
		gotUID, gotContainer, err := c.layout.Pod(c.path)
		if c.want != (want{}) {
			if err != nil || gotUID != c.want.uid || gotContainer != c.want.container {
				t.Errorf("%s: Pod(%q) = %q, %q, %v; want %q, %q", c.layout, c.path, gotUID, gotContainer, err, c.want.uid, c.want.container)
			}
			continue
		}
		if err == nil || gotUID != "" || errors.Is(err, ErrNotPodCgroup) != c.notPod {
			t.Errorf("%s: Pod(%q) = %q, %q, %v; want refused (outside the pods' cgroups: %v)", c.layout, c.path, gotUID, gotContainer, err, c.notPod)
		}
	}
	for _, l := range []PodCgroupLayout{{"", "/"}, {"systemd ", "/"}, {DriverCgroupfs, ""}, {DriverCgroupfs, "node"}, {DriverSystemd, "/a/../b"}} {
		if err := l.Validate(); err == nil {
			t.Errorf("layout %+v is valid", l)
		}
	}
}

// Every path ContainerCgroups names is read back by Pod as that pod's container,
// for both drivers and roots below the hierarchy's.
func TestContainerCgroups(t *testing.T) {
	const uid, id = "5f0e1c7a-8b1d-4c3e-9a2b-0c4d5e6f7a8b", "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	for _, l := range []PodCgroupLayout{
		{Driver: DriverCgroupfs, Root: "/"},
		{Driver: DriverCgroupfs, Root: "/node-a"},
		{Driver: DriverSystemd, Root: "/"},
		{Driver: DriverSystemd, Root: "/k8s.io"},
	} {
		paths := l.ContainerCgroups(uid, id)
		want := 3
		if l.Driver == DriverSystemd {
			want *= len(containerPrefixes)
		}
		if len(paths) != want {
			t.Errorf("%s: %d paths, want %d: %q", l, len(paths), want, paths)
		}
		for _, p := range paths {
			gotUID, gotID, err := l.Pod(p)
			if err != nil || gotUID != uid || gotID != id {
				t.Errorf("%s: %s read back as pod %q container %q (%v)", l, p, gotUID, gotID, err)
			}
		}
	}
}
