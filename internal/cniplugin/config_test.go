package cniplugin

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/mesh-cni/mesh-cni/pkg/gate/gateclient"
)

const prevResult = `{"cniVersion":"1.1.0","interfaces":[{"name":"cni0","mac":"0a:58:0a:01:00:01"},{"name":"eth0","mac":"0a:58:0a:01:00:05","sandbox":"/run/netns/p"}],
"ips":[{"address":"10.1.0.5/24","gateway":"10.1.0.1","interface":1},{"address":"fd00::5/64","interface":1}]}`

func TestParseConfigDefaults(t *testing.T) {
	conf, err := parseConfig([]byte(`{"cniVersion":"1.1.0","name":"net","type":"mesh-cni","prevResult":` + prevResult + `}`))
	if err != nil {
		t.Fatal(err)
	}
	if conf.SocketPath != DefaultSocketPath || time.Duration(conf.GateTimeout) != 30*time.Second || conf.LogLevel != "info" {
		t.Fatalf("defaults not applied: %+v", conf)
	}
	// The agent's other entry points (KNI, hook) exclude the same namespace by
	// default; the plugin keeps its own copy so that it does not link grpc-go.
	if !conf.Excluded(gateclient.DefaultExcludeNamespace) || conf.Excluded("default") || len(*conf.ExcludeNamespaces) != 1 {
		t.Fatalf("default exclusion %v, want only %s, as the other entry points", *conf.ExcludeNamespaces, gateclient.DefaultExcludeNamespace)
	}
	if conf.PrevResult == nil {
		t.Fatal("prevResult not parsed")
	}
}

func TestParseConfigExplicit(t *testing.T) {
	conf, err := parseConfig([]byte(`{"cniVersion":"1.0.0","name":"net","type":"mesh-cni","socketPath":"/run/x.sock",
		"gateTimeout":"2s","excludeNamespaces":[],"logLevel":"debug","cni.dev/attachments":[{"containerID":"a","ifname":"eth0"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	if conf.SocketPath != "/run/x.sock" || time.Duration(conf.GateTimeout) != 2*time.Second || conf.Excluded("kube-system") {
		t.Fatalf("explicit values not kept: %+v", conf)
	}
	if got := conf.validAttachments(); len(got) != 1 || got[0].ContainerID != "a" {
		t.Fatalf("early attachments key not read: %+v", got)
	}
}

func TestParseConfigErrors(t *testing.T) {
	tests := []struct {
		name, conf string
		code       uint
		msg        string
	}{
		{"not json", `{"cniVersion":`, types.ErrDecodingFailure, "decode"},
		{"timeout number", `{"cniVersion":"1.1.0","name":"n","gateTimeout":30}`, types.ErrInvalidNetworkConfig, "duration"},
		{"timeout garbage", `{"cniVersion":"1.1.0","name":"n","gateTimeout":"soon"}`, types.ErrInvalidNetworkConfig, "duration"},
		{"timeout negative", `{"cniVersion":"1.1.0","name":"n","gateTimeout":"-1s"}`, types.ErrInvalidNetworkConfig, "positive"},
		{"timeout over the limit", `{"cniVersion":"1.1.0","name":"n","gateTimeout":"6m"}`, types.ErrInvalidNetworkConfig, "limit"},
		{"del timeout over the limit", `{"cniVersion":"1.1.0","name":"n","delTimeout":"2m"}`, types.ErrInvalidNetworkConfig, "limit"},
		{"relative socket", `{"cniVersion":"1.1.0","name":"n","socketPath":"gate.sock"}`, types.ErrInvalidNetworkConfig, "absolute"},
		{"bad level", `{"cniVersion":"1.1.0","name":"n","logLevel":"loud"}`, types.ErrInvalidNetworkConfig, "logLevel"},
		{"empty excluded", `{"cniVersion":"1.1.0","name":"n","excludeNamespaces":[""]}`, types.ErrInvalidNetworkConfig, "empty"},
		{"bad prevResult", `{"cniVersion":"1.1.0","name":"n","prevResult":{"ips":"x"}}`, types.ErrDecodingFailure, "prevResult"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := parseConfig([]byte(tt.conf))
			var cniErr *types.Error
			if !errors.As(err, &cniErr) {
				t.Fatalf("parseConfig() = %v, want a CNI error", err)
			}
			if cniErr.Code != tt.code || !strings.Contains(cniErr.Error(), tt.msg) {
				t.Fatalf("parseConfig() = code %d %q, want code %d containing %q", cniErr.Code, cniErr.Error(), tt.code, tt.msg)
			}
		})
	}
}

func TestParseArgs(t *testing.T) {
	pa, err := parseArgs("IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=cart;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=u-1;OTHER=x")
	if err != nil {
		t.Fatal(err)
	}
	if !pa.HasIdentity || pa.Namespace != "shop" || pa.Name != "cart" || pa.UID != "u-1" || pa.InfraID != "abc" {
		t.Fatalf("parseArgs = %+v", pa)
	}
	pa, err = parseArgs("")
	if err != nil || pa.HasIdentity {
		t.Fatalf("empty args: %+v %v", pa, err)
	}
	if err := pa.requireIdentity(); err == nil || !strings.Contains(err.Error(), "K8S_POD_NAMESPACE") {
		t.Fatalf("requireIdentity on empty args = %v", err)
	}
	for _, garbage := range []string{"garbage", "K8S_POD_NAME", "=x", "a=b;;junk"} {
		_, err := parseArgs(garbage)
		var cniErr *types.Error
		if !errors.As(err, &cniErr) || cniErr.Code != types.ErrInvalidEnvironmentVariables {
			t.Errorf("parseArgs(%q) = %v, want code 4", garbage, err)
		}
	}
}

func TestPodInterfaces(t *testing.T) {
	conf, err := parseConfig([]byte(`{"cniVersion":"1.1.0","name":"net","prevResult":` + prevResult + `}`))
	if err != nil {
		t.Fatal(err)
	}
	res, err := resultOf(conf)
	if err != nil {
		t.Fatal(err)
	}
	ifs := podInterfaces(res, "eth0")
	if len(ifs) != 1 || ifs[0].Name != "eth0" || len(ifs[0].Addresses) != 2 || ifs[0].Addresses[0] != "10.1.0.5/24" {
		t.Fatalf("podInterfaces = %v", ifs)
	}
}

func FuzzParseConfig(f *testing.F) {
	f.Add([]byte(`{"cniVersion":"1.1.0","name":"net","type":"mesh-cni","prevResult":` + prevResult + `}`))
	f.Add([]byte(`{"cniVersion":"0.3.1","name":"n","gateTimeout":"1s","excludeNamespaces":["a"]}`))
	f.Add([]byte(`{"prevResult":{"cniVersion":"0.2.0","ip4":{"ip":"10.0.0.1/8"}}}`))
	f.Add([]byte(`null`))
	f.Fuzz(func(t *testing.T, data []byte) {
		conf, err := parseConfig(data)
		if err != nil {
			var cniErr *types.Error
			if !errors.As(err, &cniErr) || cniErr.Code == 0 {
				t.Fatalf("error without a CNI code: %v", err)
			}
			return
		}
		if conf.PrevResult != nil {
			if res, err := resultOf(conf); err == nil {
				podInterfaces(res, "eth0")
			}
		}
	})
}

func FuzzParseArgs(f *testing.F) {
	f.Add("IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=cart")
	f.Add(";;=;")
	f.Fuzz(func(t *testing.T, raw string) {
		pa, err := parseArgs(raw)
		if err == nil && pa.HasIdentity && (pa.Namespace == "" || pa.Name == "") {
			t.Fatalf("identity claimed without namespace and name: %+v", pa)
		}
	})
}
