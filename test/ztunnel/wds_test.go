package ztunnel

import (
	"context"
	"errors"
	"net/netip"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protowire"

	"github.com/mesh-cni/mesh-cni/test/pbwire"
)

// workloadResource is a DeltaDiscoveryResponse resource holding an Address
// that is the workload, encoded as istiod encodes it.
func workloadResource(name string, w Workload) []byte {
	var wl []byte
	wl = pbwire.AppendBytes(wl, wlUID, []byte(w.UID))
	wl = pbwire.AppendBytes(wl, wlName, []byte(w.Name))
	wl = pbwire.AppendBytes(wl, wlNamespace, []byte(w.Namespace))
	for _, a := range w.Addresses {
		wl = pbwire.AppendBytes(wl, wlAddresses, a.AsSlice())
	}
	if w.HBONE {
		wl = protowire.AppendTag(wl, wlTunnelProtocol, protowire.VarintType)
		wl = protowire.AppendVarint(wl, tunnelHBONE)
	}
	if w.ServiceAccount != "" {
		wl = pbwire.AppendBytes(wl, wlServiceAccount, []byte(w.ServiceAccount))
	}
	wl = pbwire.AppendBytes(wl, wlNode, []byte(w.Node))
	addr := pbwire.AppendBytes(nil, addressWorkload, wl)
	anyMsg := pbwire.AppendBytes(pbwire.AppendBytes(nil, 1, []byte(addressType)), anyValue, addr)
	return pbwire.AppendBytes(pbwire.AppendBytes(nil, resName, []byte(name)), resResource, anyMsg)
}

func response(nonce string, resources [][]byte, removed ...string) []byte {
	b := pbwire.AppendBytes(nil, ddrsTypeURL, []byte(addressType))
	b = pbwire.AppendBytes(b, ddrsNonce, []byte(nonce))
	for _, r := range resources {
		b = pbwire.AppendBytes(b, ddrsResources, r)
	}
	for _, r := range removed {
		b = pbwire.AppendBytes(b, ddrsRemoved, []byte(r))
	}
	return b
}

// A pod's workload is found only on the double's node and only when name,
// namespace and service account all agree; an absent service account is
// "default", an absent trust domain cluster.local, as ztunnel reads them; a
// workload arriving while a connection waits is found; a removed one is gone,
// and a new stream's first response replaces what was known.
func TestWDSLocalWorkload(t *testing.T) {
	w := &WDS{byName: map[string]Workload{}, changed: make(chan struct{})}
	ip := netip.MustParseAddr("10.0.0.7")
	app := Workload{UID: "Kubernetes//Pod/ns/app", Name: "app", Namespace: "ns", ServiceAccount: "app-sa", Node: "node-1",
		Addresses: []netip.Addr{ip}, HBONE: true}
	other := Workload{UID: "Kubernetes//Pod/ns/bare", Name: "bare", Namespace: "ns", Node: "node-1"}
	if _, _, err := w.apply(response("1", [][]byte{workloadResource(app.UID, app), workloadResource(other.UID, other)}), true); err != nil {
		t.Fatal(err)
	}
	quick := func(node string, info WorkloadInfo) (Workload, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		defer cancel()
		return w.Local(ctx, node, info)
	}
	got, err := quick("node-1", WorkloadInfo{Name: "app", Namespace: "ns", ServiceAccount: "app-sa"})
	if err != nil || got.Identity() != "spiffe://cluster.local/ns/ns/sa/app-sa" || !got.HBONE {
		t.Errorf("the pod's own workload: %+v, %v", got, err)
	}
	if d, ok := w.Lookup(ip); !ok || d.Name != "app" {
		t.Errorf("lookup of %s: %+v %v", ip, d, ok)
	}
	if _, err := quick("node-1", WorkloadInfo{Name: "bare", Namespace: "ns", ServiceAccount: "default"}); err != nil {
		t.Errorf("a workload without a service account is \"default\"'s: %v", err)
	}
	for _, tc := range []struct {
		node string
		info WorkloadInfo
	}{
		{"node-1", WorkloadInfo{Name: "app", Namespace: "ns", ServiceAccount: "other-sa"}},
		{"node-1", WorkloadInfo{Name: "app", Namespace: "other", ServiceAccount: "app-sa"}},
		{"node-1", WorkloadInfo{Name: "other", Namespace: "ns", ServiceAccount: "app-sa"}},
		{"node-2", WorkloadInfo{Name: "app", Namespace: "ns", ServiceAccount: "app-sa"}},
		{"node-1", WorkloadInfo{Name: "bare", Namespace: "ns"}},
	} {
		if got, err := quick(tc.node, tc.info); !errors.Is(err, ErrUnknownWorkload) {
			t.Errorf("%s on %s: %+v, %v; want unknown", tc.info, tc.node, got, err)
		}
	}

	late := Workload{UID: "Kubernetes//Pod/ns/late", Name: "late", Namespace: "ns", ServiceAccount: "late-sa", Node: "node-1"}
	found := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := w.Local(ctx, "node-1", WorkloadInfo{Name: "late", Namespace: "ns", ServiceAccount: "late-sa"})
		found <- err
	}()
	if _, _, err := w.apply(response("2", [][]byte{workloadResource(late.UID, late)}, app.UID), false); err != nil {
		t.Fatal(err)
	}
	if err := <-found; err != nil {
		t.Errorf("a workload arriving while waited for: %v", err)
	}
	if _, err := quick("node-1", WorkloadInfo{Name: "app", Namespace: "ns", ServiceAccount: "app-sa"}); err == nil {
		t.Error("a removed workload is still found")
	}
	if _, _, err := w.apply(response("3", [][]byte{workloadResource(app.UID, app)}), true); err != nil {
		t.Fatal(err)
	}
	if _, err := quick("node-1", WorkloadInfo{Name: "late", Namespace: "ns", ServiceAccount: "late-sa"}); err == nil {
		t.Error("a new stream's first response kept a workload it does not name")
	}
}
