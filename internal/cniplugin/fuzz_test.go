package cniplugin

import (
	"encoding/json"
	"net/netip"
	"testing"

	"github.com/containernetworking/cni/pkg/types"
)

// FuzzPrevResult feeds ADD what a primary plugin of any spec version could have
// put in prevResult, under any conflist version. Whenever ADD would go on to
// call the agent (the config parses and prevResult converts), then:
//   - the interfaces sent to the agent are never empty, each is one the primary
//     reported inside the pod (or the CNI_IFNAME fallback), and every address
//     sent is a valid prefix of that interface;
//   - the pass-through result can be printed at the conflist's version, so ADD
//     never enrolls a pod and then fails for a reason it knew beforehand.
func FuzzPrevResult(f *testing.F) {
	f.Add("1.1.0", []byte(prevResult))
	f.Add("0.3.1", []byte(prevResult))
	f.Add("1.0.0", []byte(`{"cniVersion":"0.3.1","interfaces":[{"name":"eth0","sandbox":"/x"}],"ips":[{"version":"4","address":"10.0.0.2/8","interface":0}]}`))
	f.Add("0.4.0", []byte(`{"cniVersion":"0.2.0","ip4":{"ip":"10.0.0.1/8"}}`))
	f.Add("1.1.0", []byte(`{"cniVersion":"1.1.0","ips":[{"address":"10.0.0.2/8","interface":7}]}`))
	f.Add("1.1.0", []byte(`{"cniVersion":"1.1.0","interfaces":[null,{"name":"","sandbox":"/x"}],"ips":[null]}`))
	f.Add("0.3.0", []byte(`{"cniVersion":"1.0.0","interfaces":[{"name":"eth0","sandbox":"/x"}],"ips":[{"address":"::1/128","interface":0}]}`))

	f.Fuzz(func(t *testing.T, cniVersion string, prev []byte) {
		v, err := json.Marshal(cniVersion)
		if err != nil {
			return
		}
		stdin := []byte(`{"cniVersion":` + string(v) + `,"name":"n","type":"mesh-cni","prevResult":` + string(prev) + `}`)
		conf, err := parseConfig(stdin)
		if err != nil || conf.PrevResult == nil {
			return
		}
		res, err := resultOf(conf)
		if err != nil {
			return
		}
		ifs := podInterfaces(res, "eth0")
		if len(ifs) == 0 {
			t.Fatal("no interface for the agent")
		}
		inPod := map[string]bool{}
		for _, i := range res.Interfaces {
			if i != nil && i.Sandbox != "" {
				inPod[i.Name] = true
			}
		}
		for _, gi := range ifs {
			if !inPod[gi.Name] && !(len(ifs) == 1 && gi.Name == "eth0" && len(gi.Addresses) == 0) {
				t.Fatalf("interface %q is neither in the pod nor the fallback", gi.Name)
			}
			for _, a := range gi.Addresses {
				if _, err := netip.ParsePrefix(a); err != nil {
					t.Fatalf("address %q for %s is not a prefix: %v", a, gi.Name, err)
				}
			}
		}
		if _, err := conf.PrevResult.GetAsVersion(conf.CNIVersion); err != nil {
			t.Fatalf("ADD would enroll the pod and then fail to print prevResult as %q: %v", conf.CNIVersion, err)
		}
	})
}

// FuzzGCConfig feeds GC's config, with the valid attachments under either name
// the spec has used: parsing never panics, fails only with a CNI error code, and
// the list sent to the agent is the one the runtime gave.
func FuzzGCConfig(f *testing.F) {
	f.Add([]byte(`{"cniVersion":"1.1.0","name":"n","type":"mesh-cni","cni.dev/valid-attachments":[{"containerID":"a","ifname":"eth0"}]}`))
	f.Add([]byte(`{"cniVersion":"1.1.0","name":"n","type":"mesh-cni","cni.dev/attachments":[{"containerID":"a","ifname":"eth0"}]}`))
	f.Add([]byte(`{"cniVersion":"1.1.0","name":"n","cni.dev/valid-attachments":[],"cni.dev/attachments":[{"containerID":"b"}]}`))
	f.Add([]byte(`{"cniVersion":"1.1.0","name":"n","cni.dev/valid-attachments":null}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		conf, err := parseConfigOnly(data)
		if err != nil {
			if e, ok := err.(*types.Error); !ok || e.Code == 0 {
				t.Fatalf("error without a CNI code: %v", err)
			}
			return
		}
		var raw struct {
			Valid []types.GCAttachment `json:"cni.dev/valid-attachments"`
			Early []types.GCAttachment `json:"cni.dev/attachments"`
		}
		if err := json.Unmarshal(data, &raw); err != nil {
			t.Fatalf("parseConfig accepted what plain decoding rejects: %v", err)
		}
		want := raw.Valid
		if len(want) == 0 {
			want = raw.Early
		}
		got := conf.validAttachments()
		if len(got) != len(want) {
			t.Fatalf("valid attachments %v, want %v", got, want)
		}
		for i := range got {
			if got[i] != want[i] {
				t.Fatalf("valid attachment %d = %v, want %v", i, got[i], want[i])
			}
		}
	})
}
