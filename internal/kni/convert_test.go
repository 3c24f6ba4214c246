package kni_test

import (
	"errors"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/mesh-cni/mesh-cni/internal/kni"
	"github.com/mesh-cni/mesh-cni/internal/kni/knipb"
	"github.com/mesh-cni/mesh-cni/pkg/gate"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

const (
	sandboxID = "4f1c2a9e0b7d4e6f8a3c5b2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f"
	podUID    = "6a1b7c2d-3e4f-5a6b-7c8d-9e0f1a2b3c4d"
	netnsPath = "/var/run/netns/cni-6a1b7c2d"
)

func validAttach() (*knipb.AttachInterfaceRequest, *knipb.AttachInterfaceResponse) {
	req := &knipb.AttachInterfaceRequest{
		Name:      "web-0",
		Id:        sandboxID,
		Namespace: "shop",
		Isolation: &knipb.Isolation{Path: netnsPath, Type: "namespace"},
		Labels:    map[string]string{"app": "web", kni.LabelPodUID: podUID},
		Annotations: map[string]string{
			"example.com/owner": "team-a",
		},
	}
	resp := &knipb.AttachInterfaceResponse{Ipconfigs: map[string]*knipb.IPConfig{
		"net1": {Ip: []string{"192.168.5.4/24"}},
		"eth0": {Ip: []string{"10.1.2.3", "fd00::3"}, Mac: "02:42:ac:11:00:02"},
	}}
	return req, resp
}

func TestAttachToGate(t *testing.T) {
	req, resp := validAttach()
	got, err := kni.AttachToGate(req, resp, "kni")
	if err != nil {
		t.Fatal(err)
	}
	want := &gatepb.AddRequest{
		Pod: &gatepb.PodIdentity{
			Namespace: "shop", Name: "web-0", Uid: podUID,
			Labels:      req.Labels,
			Annotations: req.Annotations,
		},
		Attachment: &gatepb.Attachment{ContainerId: sandboxID, Ifname: "eth0", Network: "kni"},
		NetnsPath:  netnsPath,
		Interfaces: []*gatepb.Interface{
			{Name: "eth0", Mac: "02:42:ac:11:00:02", Addresses: []string{"10.1.2.3/32", "fd00::3/128"}},
			{Name: "net1", Addresses: []string{"192.168.5.4/24"}},
		},
		Source: gatepb.Source_SOURCE_KNI,
	}
	if !proto.Equal(got, want) {
		t.Fatalf("AttachToGate =\n%v\nwant\n%v", got, want)
	}
	// The maps are copies: the gate may keep them.
	got.Pod.Labels["app"] = "changed"
	if req.Labels["app"] != "web" {
		t.Fatal("AttachToGate shares the request's label map")
	}
}

// netnsIs checks that the request names want as the pod's netns.
func netnsIs(want string) func(*testing.T, *gatepb.AddRequest) {
	return func(t *testing.T, a *gatepb.AddRequest) {
		if a.GetNetnsPath() != want {
			t.Errorf("netns = %q, want %q", a.GetNetnsPath(), want)
		}
	}
}

func TestAttachToGateSources(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change func(*knipb.AttachInterfaceRequest, *knipb.AttachInterfaceResponse)
		check  func(*testing.T, *gatepb.AddRequest)
	}{{
		name: "netns from request extradata",
		change: func(req *knipb.AttachInterfaceRequest, _ *knipb.AttachInterfaceResponse) {
			req.Isolation = nil
			req.Extradata = map[string]string{kni.ExtradataNetns: "/proc/1234/ns/net"}
		},
		check: netnsIs("/proc/1234/ns/net"),
	}, {
		name: "netns from response extradata",
		change: func(req *knipb.AttachInterfaceRequest, resp *knipb.AttachInterfaceResponse) {
			req.Isolation = &knipb.Isolation{Type: "namespace"}
			resp.Extradata = map[string]string{kni.ExtradataNetns: "/run/netns/from-runtime"}
		},
		check: netnsIs("/run/netns/from-runtime"),
	}, {
		name: "isolation wins over extradata",
		change: func(req *knipb.AttachInterfaceRequest, _ *knipb.AttachInterfaceResponse) {
			req.Extradata = map[string]string{kni.ExtradataNetns: "/run/netns/other"}
		},
		check: netnsIs(netnsPath),
	}, {
		name: "name and namespace from sandbox labels",
		change: func(req *knipb.AttachInterfaceRequest, _ *knipb.AttachInterfaceResponse) {
			req.Name, req.Namespace = "", ""
			req.Labels[kni.LabelPodName] = "from-label"
			req.Labels[kni.LabelPodNamespace] = "labelled"
		},
		check: func(t *testing.T, a *gatepb.AddRequest) {
			if a.GetPod().GetName() != "from-label" || a.GetPod().GetNamespace() != "labelled" {
				t.Errorf("pod = %v", a.GetPod())
			}
		},
	}, {
		name: "uid from extradata first",
		change: func(req *knipb.AttachInterfaceRequest, _ *knipb.AttachInterfaceResponse) {
			req.Extradata = map[string]string{"uid": "11111111-2222", "pod_uid": "33333333-4444"}
		},
		check: func(t *testing.T, a *gatepb.AddRequest) {
			if a.GetPod().GetUid() != "33333333-4444" {
				t.Errorf("uid = %q, want extradata pod_uid", a.GetPod().GetUid())
			}
		},
	}, {
		name: "a uid that is not uid-shaped is dropped",
		change: func(req *knipb.AttachInterfaceRequest, _ *knipb.AttachInterfaceResponse) {
			req.Labels[kni.LabelPodUID] = "not a uid/../"
		},
		check: func(t *testing.T, a *gatepb.AddRequest) {
			if a.GetPod().GetUid() != "" {
				t.Errorf("uid = %q, want none", a.GetPod().GetUid())
			}
		},
	}, {
		name: "no interfaces reported",
		change: func(_ *knipb.AttachInterfaceRequest, resp *knipb.AttachInterfaceResponse) {
			resp.Ipconfigs = nil
		},
		check: func(t *testing.T, a *gatepb.AddRequest) {
			if a.GetAttachment().GetIfname() != "eth0" || len(a.GetInterfaces()) != 0 {
				t.Errorf("attachment %v, interfaces %v", a.GetAttachment(), a.GetInterfaces())
			}
		},
	}, {
		name: "no eth0: first by name",
		change: func(_ *knipb.AttachInterfaceRequest, resp *knipb.AttachInterfaceResponse) {
			resp.Ipconfigs = map[string]*knipb.IPConfig{"net2": {}, "net1": {Ip: []string{"fe80::1%net1"}}}
		},
		check: func(t *testing.T, a *gatepb.AddRequest) {
			if a.GetAttachment().GetIfname() != "net1" || !slices.Equal(a.GetInterfaces()[0].GetAddresses(), []string{"fe80::1/128"}) {
				t.Errorf("attachment %v, interfaces %v", a.GetAttachment(), a.GetInterfaces())
			}
		},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			req, resp := validAttach()
			tc.change(req, resp)
			got, err := kni.AttachToGate(req, resp, "kni")
			if err != nil {
				t.Fatal(err)
			}
			tc.check(t, got)
		})
	}
}

func TestAttachToGateErrors(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change func(*knipb.AttachInterfaceRequest, *knipb.AttachInterfaceResponse)
		want   string
	}{
		{"no netns", func(req *knipb.AttachInterfaceRequest, _ *knipb.AttachInterfaceResponse) { req.Isolation = nil }, "no network namespace"},
		{"relative netns", func(req *knipb.AttachInterfaceRequest, _ *knipb.AttachInterfaceResponse) {
			req.Isolation.Path = "netns/x"
		}, "absolute"},
		{"no id", func(req *knipb.AttachInterfaceRequest, _ *knipb.AttachInterfaceResponse) { req.Id = "" }, "container id"},
		{"bad name", func(req *knipb.AttachInterfaceRequest, _ *knipb.AttachInterfaceResponse) { req.Name = "Web_0" }, "pod name"},
		{"no namespace", func(req *knipb.AttachInterfaceRequest, _ *knipb.AttachInterfaceResponse) { req.Namespace = "" }, "pod namespace"},
		{"bad ifname", func(_ *knipb.AttachInterfaceRequest, resp *knipb.AttachInterfaceResponse) {
			resp.Ipconfigs["../eth1"] = &knipb.IPConfig{}
		}, "interface name"},
		{"long ifname", func(_ *knipb.AttachInterfaceRequest, resp *knipb.AttachInterfaceResponse) {
			resp.Ipconfigs["a-very-long-ifname"] = &knipb.IPConfig{}
		}, "interface name"},
		{"bad mac", func(_ *knipb.AttachInterfaceRequest, resp *knipb.AttachInterfaceResponse) {
			resp.Ipconfigs["eth0"].Mac = "zz"
		}, "MAC"},
		{"bad address", func(_ *knipb.AttachInterfaceRequest, resp *knipb.AttachInterfaceResponse) {
			resp.Ipconfigs["eth0"].Ip = []string{"10.1.2.300"}
		}, "address"},
		{"too many interfaces", func(_ *knipb.AttachInterfaceRequest, resp *knipb.AttachInterfaceResponse) {
			for i := range 17 {
				resp.Ipconfigs["if"+strings.Repeat("x", i)] = &knipb.IPConfig{}
			}
		}, "interfaces"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req, resp := validAttach()
			tc.change(req, resp)
			_, err := kni.AttachToGate(req, resp, "kni")
			if !errors.Is(err, gate.ErrInvalidRequest) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error = %v, want an invalid request about %q", err, tc.want)
			}
		})
	}
}

func TestDetachToGate(t *testing.T) {
	req := &knipb.DetachInterfaceRequest{Id: sandboxID, Name: "web-0", Namespace: "shop", Isolation: &knipb.Isolation{Path: netnsPath},
		Labels: map[string]string{"app": "web", kni.LabelPodUID: podUID}}
	got, err := kni.DetachToGate(req, "kni")
	if err != nil {
		t.Fatal(err)
	}
	want := &gatepb.DelRequest{
		Pod:        &gatepb.PodIdentity{Namespace: "shop", Name: "web-0", Uid: podUID},
		Attachment: &gatepb.Attachment{ContainerId: sandboxID, Ifname: "eth0", Network: "kni"},
		NetnsPath:  netnsPath,
		Source:     gatepb.Source_SOURCE_KNI,
	}
	if !proto.Equal(got, want) {
		t.Fatalf("DetachToGate =\n%v\nwant\n%v", got, want)
	}
	// An odd pod name does not stop a release; a missing sandbox id does.
	req.Name = "Odd_Name"
	if got, err := kni.DetachToGate(req, "kni"); err != nil || got.GetPod() != nil {
		t.Fatalf("detach with an odd name = %v, %v; want a release without pod identity", got, err)
	}
	req.Id = ""
	if _, err := kni.DetachToGate(req, "kni"); !errors.Is(err, gate.ErrInvalidRequest) {
		t.Fatalf("detach without id: %v", err)
	}
}

func mustMarshal(f *testing.F, m proto.Message) []byte {
	b, err := proto.Marshal(m)
	if err != nil {
		f.Fatal(err)
	}
	return b
}

// FuzzAttachToGate feeds arbitrary attach requests and runtime responses (as
// protobuf wire bytes, the way they arrive) through the conversion: it never
// panics, fails only with an invalid-request error, and what it returns is what
// the gate accepts, derived from the input as documented.
func FuzzAttachToGate(f *testing.F) {
	req, resp := validAttach()
	f.Add(mustMarshal(f, req), mustMarshal(f, resp))
	old := proto.Clone(req).(*knipb.AttachInterfaceRequest)
	old.Isolation = nil
	old.Extradata = map[string]string{kni.ExtradataNetns: "/proc/42/ns/net", "pod_uid": podUID}
	f.Add(mustMarshal(f, old), mustMarshal(f, &knipb.AttachInterfaceResponse{}))
	f.Add(mustMarshal(f, &knipb.AttachInterfaceRequest{Id: "x", Name: "a", Namespace: "b"}),
		mustMarshal(f, &knipb.AttachInterfaceResponse{Extradata: map[string]string{kni.ExtradataNetns: "/run/netns/n"},
			Ipconfigs: map[string]*knipb.IPConfig{"eth0": {Ip: []string{"::ffff:10.0.0.1", "10.0.0.1/8"}}, "": {Mac: "bad"}}}))
	f.Add(mustMarshal(f, &knipb.AttachInterfaceRequest{Id: "x", Name: "a", Namespace: "b", Isolation: req.GetIsolation(),
		Labels: map[string]string{"": "x"}, Annotations: map[string]string{"": ""}}), mustMarshal(f, resp))
	f.Add([]byte{}, []byte{})
	f.Add([]byte{0x0a, 0xff}, []byte{0x0a})

	f.Fuzz(func(t *testing.T, reqBytes, respBytes []byte) {
		req, resp := &knipb.AttachInterfaceRequest{}, &knipb.AttachInterfaceResponse{}
		if proto.Unmarshal(reqBytes, req) != nil || proto.Unmarshal(respBytes, resp) != nil {
			return
		}
		add, err := kni.AttachToGate(req, resp, "kni")
		dreq := &knipb.DetachInterfaceRequest{Id: req.GetId(), Name: req.GetName(), Namespace: req.GetNamespace(),
			Isolation: req.GetIsolation(), Labels: req.GetLabels(), Extradata: req.GetExtradata()}
		if del, derr := kni.DetachToGate(dreq, "kni"); derr == nil {
			if verr := gate.ValidateDel(del); verr != nil {
				t.Fatalf("DetachToGate returned a request the gate refuses: %v", verr)
			}
		} else if !errors.Is(derr, gate.ErrInvalidRequest) {
			t.Fatalf("DetachToGate error is not an invalid request: %v", derr)
		}
		if err != nil {
			if !errors.Is(err, gate.ErrInvalidRequest) {
				t.Fatalf("error is not an invalid request: %v", err)
			}
			return
		}
		if verr := gate.ValidateDel(&gatepb.DelRequest{Pod: add.GetPod(), Attachment: add.GetAttachment(), NetnsPath: add.GetNetnsPath()}); verr != nil {
			t.Fatalf("gate refuses the converted identity: %v", verr)
		}
		if add.GetAttachment().GetContainerId() != req.GetId() || add.GetAttachment().GetNetwork() != "kni" || add.GetSource() != gatepb.Source_SOURCE_KNI {
			t.Fatalf("attachment %v, source %v", add.GetAttachment(), add.GetSource())
		}
		wantNetns := req.GetIsolation().GetPath()
		if wantNetns == "" {
			wantNetns = req.GetExtradata()[kni.ExtradataNetns]
		}
		if wantNetns == "" {
			wantNetns = resp.GetExtradata()[kni.ExtradataNetns]
		}
		if add.GetNetnsPath() != wantNetns {
			t.Fatalf("netns %q, want %q", add.GetNetnsPath(), wantNetns)
		}
		// Copied as the gate fits them: empty or oversized keys dropped, long
		// values replaced, the pod never refused for them.
		fit, _ := gate.FitPodMetadata(&gatepb.PodIdentity{Labels: req.GetLabels(), Annotations: req.GetAnnotations()})
		if !maps.Equal(add.GetPod().GetLabels(), fit.GetLabels()) || !maps.Equal(add.GetPod().GetAnnotations(), fit.GetAnnotations()) {
			t.Fatal("labels or annotations not copied as fitted")
		}
		var names []string
		for _, i := range add.GetInterfaces() {
			names = append(names, i.GetName())
			for _, a := range i.GetAddresses() {
				if _, err := netip.ParsePrefix(a); err != nil {
					t.Fatalf("address %q is not CIDR: %v", a, err)
				}
			}
			if len(i.GetAddresses()) != len(resp.GetIpconfigs()[i.GetName()].GetIp()) {
				t.Fatalf("interface %s: %d addresses from %d", i.GetName(), len(i.GetAddresses()), len(resp.GetIpconfigs()[i.GetName()].GetIp()))
			}
		}
		if !slices.Equal(slices.Sorted(slices.Values(names)), slices.Sorted(maps.Keys(resp.GetIpconfigs()))) {
			t.Fatalf("interfaces %v from ipconfigs %v", names, slices.Collect(maps.Keys(resp.GetIpconfigs())))
		}
		switch {
		case len(names) == 0 && add.GetAttachment().GetIfname() != kni.DefaultIfname,
			len(names) > 0 && add.GetAttachment().GetIfname() != names[0],
			slices.Contains(names, kni.DefaultIfname) && names[0] != kni.DefaultIfname:
			t.Fatalf("attachment ifname %q, interfaces %v", add.GetAttachment().GetIfname(), names)
		}
	})
}
