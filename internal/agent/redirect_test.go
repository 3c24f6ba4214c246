package agent

import (
	"net/netip"
	"reflect"
	"testing"

	"github.com/mesh-cni/mesh-cni/internal/podstore"
	"github.com/mesh-cni/mesh-cni/internal/redirect"
)

// A sidecar pod's settings are Istio's sidecar's, whatever the node proxy's
// are, with the node's own exclusions kept (its inbound bypass, an ambient
// setting, is not); until the sidecar container's
// cgroup is known, its uid is the proxy.
func TestSettingsForSidecar(t *testing.T) {
	node := redirect.DefaultSettings()
	node.OutboundPort, node.InboundPort = 15101, 15106
	node.ExcludedCIDRs = []netip.Prefix{netip.MustParsePrefix("169.254.0.0/16")}
	node.DNSCapture = true
	node.BypassInbound = true
	r := RedirectDatapath{Settings: node}
	ports := []uint16{8080}
	sc := &podstore.Sidecar{
		ProxyUID: 1337, ProxyContainer: "abc", CgroupUID: "u-1",
		InboundExcludedPorts: []uint16{15008, 15020}, OutboundExcludedPorts: []uint16{15020},
		ExcludedCIDRs:     []netip.Prefix{netip.MustParsePrefix("10.96.0.0/12")},
		OutboundCIDRsOnly: true, IncludedCIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")},
		OutboundIncludedPorts: []uint16{443},
		DNS:                   true,
	}
	got := r.settingsFor(podstore.Capture{Sidecar: sc, KubeletPorts: &ports})
	uid := uint32(1337)
	want := node
	want.OutboundPort, want.InboundPort, want.DNSPort = 15001, 15006, 15053
	want.InboundExcludedPorts, want.OutboundExcludedPorts = sc.InboundExcludedPorts, sc.OutboundExcludedPorts
	want.ExcludedCIDRs = []netip.Prefix{netip.MustParsePrefix("169.254.0.0/16"), netip.MustParsePrefix("10.96.0.0/12")}
	want.DNSCapture, want.DNSFailClosed = true, true
	want.ProxyUID = &uid
	want.KubeletPortsOnly, want.KubeletPorts = true, ports
	want.Capture = redirect.Capture{LocalToInbound: true, OutboundCIDRsOnly: true, IncludedCIDRs: sc.IncludedCIDRs, OutboundIncludedPorts: []uint16{443}}
	want.BypassInbound = false
	if !reflect.DeepEqual(got, want) {
		t.Errorf("settings:\n got %+v\nwant %+v", got, want)
	}
	if err := got.Validate(); err != nil {
		t.Error(err)
	}
}

// The node proxy is never handed a pod its own sidecar serves.
func TestZDSPodsLeaveSidecarsOut(t *testing.T) {
	recs := []podstore.Record{
		{UID: "ambient", Name: "a"},
		{UID: "sidecar", Name: "s", Capture: podstore.Capture{Sidecar: &podstore.Sidecar{ProxyUID: 1337}}},
		{UID: "", Name: "no-uid"},
	}
	got := zdsPods(recs)
	if len(got) != 1 || got[0].UID != "ambient" {
		t.Errorf("zds pods %+v, want only the ambient one", got)
	}
}
