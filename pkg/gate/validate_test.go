package gate

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

func validAdd() *gatepb.AddRequest {
	return &gatepb.AddRequest{
		Pod:        &gatepb.PodIdentity{Namespace: "shop", Name: "cart-7d9f", Uid: "0f1e2d3c-aaaa-bbbb-cccc-123456789abc"},
		Attachment: &gatepb.Attachment{ContainerId: "c0ffee", Ifname: "eth0", Network: "k8s-pod-network"},
		NetnsPath:  "/proc/self/ns/net",
		Interfaces: []*gatepb.Interface{{Name: "eth0", Mac: "0a:58:0a:01:00:05", Addresses: []string{"10.1.0.5/24", "fd00::5/64"}}},
		Source:     gatepb.Source_SOURCE_CNI,
	}
}

func TestValidateAdd(t *testing.T) {
	regular := filepath.Join(t.TempDir(), "not-a-netns")
	if err := os.WriteFile(regular, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name    string
		mutate  func(r *gatepb.AddRequest)
		wantErr string
	}{
		{name: "valid", mutate: func(*gatepb.AddRequest) {}},
		{name: "no pod", mutate: func(r *gatepb.AddRequest) { r.Pod = nil }, wantErr: "pod identity is missing"},
		{name: "uppercase namespace", mutate: func(r *gatepb.AddRequest) { r.Pod.Namespace = "Shop" }, wantErr: "namespace"},
		{name: "long namespace", mutate: func(r *gatepb.AddRequest) { r.Pod.Namespace = strings.Repeat("a", 64) }, wantErr: "namespace"},
		{name: "name with slash", mutate: func(r *gatepb.AddRequest) { r.Pod.Name = "../etc" }, wantErr: "pod name"},
		{name: "empty name", mutate: func(r *gatepb.AddRequest) { r.Pod.Name = "" }, wantErr: "pod name"},
		{name: "bad uid", mutate: func(r *gatepb.AddRequest) { r.Pod.Uid = "uid;rm" }, wantErr: "uid"},
		{name: "no attachment", mutate: func(r *gatepb.AddRequest) { r.Attachment = nil }, wantErr: "attachment"},
		{name: "container id traversal", mutate: func(r *gatepb.AddRequest) { r.Attachment.ContainerId = "../../x" }, wantErr: "container id"},
		{name: "long container id", mutate: func(r *gatepb.AddRequest) { r.Attachment.ContainerId = strings.Repeat("a", 129) }, wantErr: "container id"},
		{name: "ifname too long", mutate: func(r *gatepb.AddRequest) { r.Attachment.Ifname = "eth0123456789abc" }, wantErr: "interface name"},
		{name: "ifname dotdot", mutate: func(r *gatepb.AddRequest) { r.Attachment.Ifname = ".." }, wantErr: "interface name"},
		{name: "ifname slash", mutate: func(r *gatepb.AddRequest) { r.Attachment.Ifname = "a/b" }, wantErr: "interface name"},
		{name: "no network", mutate: func(r *gatepb.AddRequest) { r.Attachment.Network = "" }, wantErr: "network name"},
		{name: "no netns", mutate: func(r *gatepb.AddRequest) { r.NetnsPath = "" }, wantErr: "netns path is missing"},
		{name: "relative netns", mutate: func(r *gatepb.AddRequest) { r.NetnsPath = "proc/self/ns/net" }, wantErr: "absolute"},
		{name: "unclean netns", mutate: func(r *gatepb.AddRequest) { r.NetnsPath = "/proc/self/../self/ns/net" }, wantErr: "clean"},
		{name: "missing netns", mutate: func(r *gatepb.AddRequest) { r.NetnsPath = "/run/netns/does-not-exist-mesh" }, wantErr: "no such file"},
		{name: "regular file netns", mutate: func(r *gatepb.AddRequest) { r.NetnsPath = regular }, wantErr: "not a network namespace"},
		{name: "mount ns", mutate: func(r *gatepb.AddRequest) { r.NetnsPath = "/proc/self/ns/mnt" }, wantErr: "not a network namespace"},
		{name: "bad address", mutate: func(r *gatepb.AddRequest) { r.Interfaces[0].Addresses = []string{"10.1.0.500/24"} }, wantErr: "CIDR"},
		{name: "address without prefix", mutate: func(r *gatepb.AddRequest) { r.Interfaces[0].Addresses = []string{"10.1.0.5"} }, wantErr: "CIDR"},
		{name: "bad mac", mutate: func(r *gatepb.AddRequest) { r.Interfaces[0].Mac = "zz" }, wantErr: "MAC"},
		{name: "too many interfaces", mutate: func(r *gatepb.AddRequest) {
			for i := 0; i < 20; i++ {
				r.Interfaces = append(r.Interfaces, &gatepb.Interface{Name: "eth1"})
			}
		}, wantErr: "limit"},
		{name: "huge label", mutate: func(r *gatepb.AddRequest) { r.Pod.Labels = map[string]string{"a": strings.Repeat("x", 5000)} }, wantErr: "label"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req := validAdd()
			tt.mutate(req)
			err := ValidateAdd(req)
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("ValidateAdd() = %v, want nil", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("ValidateAdd() = %v, want error containing %q", err, tt.wantErr)
			}
			if !errors.Is(err, ErrInvalidRequest) {
				t.Fatalf("error %v does not wrap ErrInvalidRequest", err)
			}
		})
	}
}

func TestValidateDelAllowsGoneNetns(t *testing.T) {
	req := &gatepb.DelRequest{
		Attachment: &gatepb.Attachment{ContainerId: "c0ffee", Ifname: "eth0", Network: "net"},
		NetnsPath:  "/run/netns/already-deleted",
	}
	if err := ValidateDel(req); err != nil {
		t.Fatalf("ValidateDel(gone netns) = %v", err)
	}
	req.NetnsPath = ""
	if err := ValidateDel(req); err != nil {
		t.Fatalf("ValidateDel(no netns) = %v", err)
	}
	req.Attachment.ContainerId = ""
	if err := ValidateDel(req); err == nil {
		t.Fatal("ValidateDel(no container id) succeeded")
	}
}

func TestValidateGC(t *testing.T) {
	ok := &gatepb.GCRequest{Network: "net", Valid: []*gatepb.Attachment{{ContainerId: "a", Ifname: "eth0"}}}
	if err := ValidateGC(ok); err != nil {
		t.Fatal(err)
	}
	bad := &gatepb.GCRequest{Network: "net", Valid: []*gatepb.Attachment{{ContainerId: "a/b", Ifname: "eth0"}}}
	if err := ValidateGC(bad); err == nil {
		t.Fatal("ValidateGC accepted a container id with a slash")
	}
}

func FuzzValidateAdd(f *testing.F) {
	f.Add("shop", "cart", "uid-1", "c0ffee", "eth0", "net", "/proc/self/ns/net", "10.1.0.5/24", "0a:58:0a:01:00:05")
	f.Add("", "", "", "", "", "", "", "", "")
	f.Add("a", "b.c", "x", "../..", "..", "n", "/proc/self/ns/mnt", "::/0", "zz")
	f.Fuzz(func(t *testing.T, ns, name, uid, cid, ifname, network, path, addr, mac string) {
		req := &gatepb.AddRequest{
			Pod:        &gatepb.PodIdentity{Namespace: ns, Name: name, Uid: uid},
			Attachment: &gatepb.Attachment{ContainerId: cid, Ifname: ifname, Network: network},
			NetnsPath:  path,
			Interfaces: []*gatepb.Interface{{Name: ifname, Mac: mac, Addresses: []string{addr}}},
		}
		if err := ValidateAdd(req); err == nil {
			// Whatever passed must be safe to use as a path component and in logs.
			if strings.ContainsAny(cid+ifname+network, "/\x00") {
				t.Fatalf("accepted unsafe identifiers %q %q %q", cid, ifname, network)
			}
		}
	})
}
