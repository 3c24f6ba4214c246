package containerdhook

import (
	"context"
	"slices"
	"testing"
)

// TestChainMergesAndDerivesIPs (containerd fork commit
// b5dc60445dc9537d5e473bec6b1aef9b3c487be1: mergeResults, setupPodNetworkGRPC):
// the chain's merge and IP derivation, on the two
// answers a non-primary hook can give. Echoing prev_result lists each pod IP
// twice (the bug the empty answer avoids); an empty answer lists each once.
func TestChainMergesAndDerivesIPs(t *testing.T) {
	primary := &Result{
		Interfaces: []Interface{{Name: "cni0"}, {Name: "eth0", Addresses: []string{"10.22.0.5/16", "fd00::5/64"}}},
		Routes:     []Route{{Destination: "0.0.0.0/0", Gateway: "10.22.0.1"}},
		DNS:        &DNS{Servers: []string{"10.96.0.10"}},
	}
	echo := echoPlugin{}
	for _, tc := range []struct {
		name   string
		second Plugin
		want   []string
	}{
		{"empty answer", Done{Result: &Result{}}, []string{"10.22.0.5", "fd00::5"}},
		{"prev_result echoed", echo, []string{"10.22.0.5", "fd00::5", "10.22.0.5", "fd00::5"}},
	} {
		c := &Chain{Plugins: []Plugin{Done{Result: primary}, tc.second}, Names: []string{"primary", "hook"}}
		merged, err := c.Setup(context.Background(), Pod{})
		if err != nil {
			t.Fatal(err)
		}
		ip, more, err := PodIPs(merged)
		if err != nil {
			t.Fatal(err)
		}
		if got := append([]string{ip}, more...); !slices.Equal(got, tc.want) {
			t.Errorf("%s: pod IPs %v, want %v", tc.name, got, tc.want)
		}
		if merged.DNS == nil || merged.DNS.Servers[0] != "10.96.0.10" {
			t.Errorf("%s: DNS %+v, want the primary's kept", tc.name, merged.DNS)
		}
	}
}

// TestWireRoundTrip: a result survives this package's encoding and decoding.
func TestWireRoundTrip(t *testing.T) {
	r := &Result{
		Interfaces: []Interface{{Name: "eth0", MAC: "aa:bb:cc:dd:ee:ff", MTU: 1500, State: "up", Addresses: []string{"10.0.0.2/24", "fd00::2/64"}}, {Name: "rdma0", RDMA: true}},
		Routes:     []Route{{Destination: "0.0.0.0/0", Gateway: "10.0.0.1", InterfaceName: "eth0", Metric: 100, Scope: "global"}},
		DNS:        &DNS{Servers: []string{"10.96.0.10"}, Searches: []string{"svc.cluster.local"}, Options: []string{"ndots:5"}},
	}
	got, err := decodeResult(encodeResult(r))
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Interfaces) != 2 || !slices.Equal(got.Interfaces[0].Addresses, r.Interfaces[0].Addresses) || got.Interfaces[0].MTU != 1500 ||
		!got.Interfaces[1].RDMA || got.Routes[0] != r.Routes[0] || !slices.Equal(got.DNS.Options, r.DNS.Options) {
		t.Fatalf("round trip changed the result:\n%+v\nwant\n%+v", got, r)
	}
}

type echoPlugin struct{}

func (echoPlugin) Setup(_ context.Context, _ Pod, prev *Result) (*Result, error) { return prev, nil }
func (echoPlugin) Teardown(context.Context, Pod, *Result) error                  { return nil }
func (echoPlugin) CheckHealth(context.Context) error                             { return nil }
