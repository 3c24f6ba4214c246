package nethook_test

import (
	"errors"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/mesh-cni/mesh-cni/internal/nethook"
	"github.com/mesh-cni/mesh-cni/internal/nethook/nethookpb"
	"github.com/mesh-cni/mesh-cni/pkg/gate"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

const (
	sandboxID = "4f1c2a9e0b7d4e6f8a3c5b2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f"
	podUID    = "6a1b7c2d-3e4f-5a6b-7c8d-9e0f1a2b3c4d"
	netnsPath = "/var/run/netns/cni-6a1b7c2d"
)

func validSetup() *nethookpb.SetupPodNetworkRequest {
	return &nethookpb.SetupPodNetworkRequest{
		SandboxId:    sandboxID,
		NetnsPath:    netnsPath,
		PodName:      "web-0",
		PodNamespace: "shop",
		PodUid:       podUID,
		Labels:       map[string]string{"app": "web"},
		Annotations:  map[string]string{"example.com/owner": "team-a"},
		PrevResult: &nethookpb.SetupPodNetworkResponse{
			Interfaces: []*nethookpb.NetworkInterface{
				{Name: "cni0", MacAddress: "aa:bb:cc:dd:ee:01"},
				{Name: "veth1234", MacAddress: "aa:bb:cc:dd:ee:02"},
				{Name: "net1", Addresses: []string{"192.168.5.4/24"}},
				{Name: "eth0", MacAddress: "02:42:ac:11:00:02", Addresses: []string{"10.1.2.3/24", "fd00::3/64"}, Mtu: 1500},
				{Name: "ib0", Type: nethookpb.DeviceType_RDMA, Addresses: []string{"10.9.0.1/24"}},
				{Name: "eth0", Addresses: []string{"10.1.2.3/24", "10.1.2.4"}},
			},
			Routes: []*nethookpb.RouteEntry{{Destination: "0.0.0.0/0", Gateway: "10.1.2.1"}},
		},
	}
}

func TestSetupToGate(t *testing.T) {
	req := validSetup()
	got, err := nethook.SetupToGate(req, "nethook")
	if err != nil {
		t.Fatal(err)
	}
	want := &gatepb.AddRequest{
		Pod: &gatepb.PodIdentity{Namespace: "shop", Name: "web-0", Uid: podUID,
			Labels: req.Labels, Annotations: req.Annotations},
		Attachment: &gatepb.Attachment{ContainerId: sandboxID, Ifname: "eth0", Network: "nethook"},
		NetnsPath:  netnsPath,
		Interfaces: []*gatepb.Interface{
			{Name: "eth0", Mac: "02:42:ac:11:00:02", Addresses: []string{"10.1.2.3/24", "fd00::3/64", "10.1.2.4/32"}},
			{Name: "net1", Addresses: []string{"192.168.5.4/24"}},
		},
		Source: gatepb.Source_SOURCE_HOOK,
	}
	if !proto.Equal(got, want) {
		t.Fatalf("SetupToGate =\n%v\nwant\n%v", got, want)
	}

	req.PrevResult = nil
	got, err = nethook.SetupToGate(req, "nethook")
	if err != nil || got.GetAttachment().GetIfname() != "eth0" || len(got.GetInterfaces()) != 0 {
		t.Fatalf("without prev_result = %v, %v; want eth0 and no interfaces", got, err)
	}
}

func TestSetupToGateErrors(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change func(*nethookpb.SetupPodNetworkRequest)
		want   string
	}{
		{"no netns", func(r *nethookpb.SetupPodNetworkRequest) { r.NetnsPath = "" }, "netns_path"},
		{"relative netns", func(r *nethookpb.SetupPodNetworkRequest) { r.NetnsPath = "x/y" }, "absolute"},
		{"no sandbox", func(r *nethookpb.SetupPodNetworkRequest) { r.SandboxId = "" }, "container id"},
		{"bad uid", func(r *nethookpb.SetupPodNetworkRequest) { r.PodUid = "../x" }, "uid"},
		{"bad namespace", func(r *nethookpb.SetupPodNetworkRequest) { r.PodNamespace = "Shop" }, "namespace"},
		{"bad ifname", func(r *nethookpb.SetupPodNetworkRequest) {
			r.PrevResult.Interfaces[3].Name = "eth0:1"
		}, "interface name"},
		{"bad mac", func(r *nethookpb.SetupPodNetworkRequest) { r.PrevResult.Interfaces[3].MacAddress = "x" }, "MAC"},
		{"bad address", func(r *nethookpb.SetupPodNetworkRequest) {
			r.PrevResult.Interfaces[3].Addresses = []string{"10.0.0.0/33"}
		}, "address"},
		{"too many interfaces", func(r *nethookpb.SetupPodNetworkRequest) {
			for i := range 17 {
				r.PrevResult.Interfaces = append(r.PrevResult.Interfaces, &nethookpb.NetworkInterface{Name: "n" + strings.Repeat("x", i), Addresses: []string{"10.0.0.1"}})
			}
		}, "interfaces"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req := validSetup()
			tc.change(req)
			_, err := nethook.SetupToGate(req, "nethook")
			if !errors.Is(err, gate.ErrInvalidRequest) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error = %v, want an invalid request about %q", err, tc.want)
			}
		})
	}
}

func TestTeardownToGate(t *testing.T) {
	req := &nethookpb.TeardownPodNetworkRequest{SandboxId: sandboxID, PodName: "web-0", PodNamespace: "shop", PodUid: podUID}
	got, err := nethook.TeardownToGate(req, "nethook")
	if err != nil {
		t.Fatal(err)
	}
	want := &gatepb.DelRequest{
		Pod:        &gatepb.PodIdentity{Namespace: "shop", Name: "web-0", Uid: podUID},
		Attachment: &gatepb.Attachment{ContainerId: sandboxID, Ifname: "eth0", Network: "nethook"},
		Source:     gatepb.Source_SOURCE_HOOK,
	}
	if !proto.Equal(got, want) {
		t.Fatalf("TeardownToGate =\n%v\nwant\n%v", got, want)
	}
	req.PodName = "Odd_Name"
	if got, err := nethook.TeardownToGate(req, "nethook"); err != nil || got.GetPod() != nil {
		t.Fatalf("teardown with an odd name = %v, %v; want a release without pod identity", got, err)
	}
	req.SandboxId = ""
	if _, err := nethook.TeardownToGate(req, "nethook"); !errors.Is(err, gate.ErrInvalidRequest) {
		t.Fatalf("teardown without sandbox: %v", err)
	}
}

// FuzzSetupToGate feeds arbitrary setup requests (as protobuf wire bytes, the
// way they arrive) through the conversion: it never panics, fails only with an
// invalid-request error, and what it returns is what the gate accepts, derived
// from the input as documented.
func FuzzSetupToGate(f *testing.F) {
	for _, m := range []proto.Message{
		validSetup(),
		&nethookpb.SetupPodNetworkRequest{SandboxId: "a", NetnsPath: "/proc/1/ns/net", PodName: "p", PodNamespace: "n"},
		&nethookpb.SetupPodNetworkRequest{SandboxId: "a", NetnsPath: "/n", PodName: "p", PodNamespace: "n",
			PrevResult: &nethookpb.SetupPodNetworkResponse{Interfaces: []*nethookpb.NetworkInterface{
				{Name: "", Addresses: []string{"x"}}, {Name: "eth0", Addresses: []string{"fe80::1%eth0"}}}}},
		&nethookpb.SetupPodNetworkRequest{SandboxId: "a", NetnsPath: "/n", PodName: "p", PodNamespace: "n",
			Labels: map[string]string{"": "x"}, Annotations: map[string]string{"": ""}},
	} {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{})
	f.Add([]byte{0x5a, 0x02, 0x0a, 0x00})

	f.Fuzz(func(t *testing.T, data []byte) {
		req := &nethookpb.SetupPodNetworkRequest{}
		if proto.Unmarshal(data, req) != nil {
			return
		}
		treq := &nethookpb.TeardownPodNetworkRequest{SandboxId: req.GetSandboxId(), NetnsPath: req.GetNetnsPath(),
			PodName: req.GetPodName(), PodNamespace: req.GetPodNamespace(), PodUid: req.GetPodUid()}
		if del, err := nethook.TeardownToGate(treq, "nethook"); err == nil {
			if verr := gate.ValidateDel(del); verr != nil {
				t.Fatalf("TeardownToGate returned a request the gate refuses: %v", verr)
			}
		} else if !errors.Is(err, gate.ErrInvalidRequest) {
			t.Fatalf("TeardownToGate error is not an invalid request: %v", err)
		}

		add, err := nethook.SetupToGate(req, "nethook")
		if err != nil {
			if !errors.Is(err, gate.ErrInvalidRequest) {
				t.Fatalf("error is not an invalid request: %v", err)
			}
			return
		}
		if verr := gate.ValidateDel(&gatepb.DelRequest{Pod: add.GetPod(), Attachment: add.GetAttachment(), NetnsPath: add.GetNetnsPath()}); verr != nil {
			t.Fatalf("gate refuses the converted identity: %v", verr)
		}
		a := add.GetAttachment()
		if a.GetContainerId() != req.GetSandboxId() || a.GetNetwork() != "nethook" || add.GetNetnsPath() != req.GetNetnsPath() || add.GetSource() != gatepb.Source_SOURCE_HOOK {
			t.Fatalf("converted %v from sandbox %q netns %q", add, req.GetSandboxId(), req.GetNetnsPath())
		}
		// Labels and annotations are copied as the gate fits them (empty or
		// oversized keys dropped, long values replaced), never refused.
		p := add.GetPod()
		fit, _ := gate.FitPodMetadata(&gatepb.PodIdentity{Labels: req.GetLabels(), Annotations: req.GetAnnotations()})
		if p.GetName() != req.GetPodName() || p.GetNamespace() != req.GetPodNamespace() || p.GetUid() != req.GetPodUid() ||
			!maps.Equal(p.GetLabels(), fit.GetLabels()) || !maps.Equal(p.GetAnnotations(), fit.GetAnnotations()) {
			t.Fatalf("pod %v from request %v", p, req)
		}
		// Interfaces: exactly the distinct NETDEV names with addresses, eth0 first.
		var want []string
		for _, ni := range req.GetPrevResult().GetInterfaces() {
			if ni.GetType() == nethookpb.DeviceType_NETDEV && len(ni.GetAddresses()) > 0 && !slices.Contains(want, ni.GetName()) {
				want = append(want, ni.GetName())
			}
		}
		var names []string
		for _, i := range add.GetInterfaces() {
			names = append(names, i.GetName())
			if len(i.GetAddresses()) == 0 {
				t.Fatalf("interface %s without addresses", i.GetName())
			}
			for _, s := range i.GetAddresses() {
				if _, err := netip.ParsePrefix(s); err != nil {
					t.Fatalf("address %q is not CIDR: %v", s, err)
				}
			}
		}
		if !slices.Equal(slices.Sorted(slices.Values(names)), slices.Sorted(slices.Values(want))) {
			t.Fatalf("interfaces %v, want %v", names, want)
		}
		switch {
		case len(names) == 0 && a.GetIfname() != nethook.DefaultIfname,
			len(names) > 0 && a.GetIfname() != names[0],
			slices.Contains(names, nethook.DefaultIfname) && names[0] != nethook.DefaultIfname:
			t.Fatalf("attachment ifname %q, interfaces %v", a.GetIfname(), names)
		}
	})
}
