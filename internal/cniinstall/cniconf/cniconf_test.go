package cniconf

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"github.com/containernetworking/cni/libcni"
)

func testEntry(t testing.TB) Entry {
	t.Helper()
	e, err := NewEntry(map[string]any{
		"type":              "mesh-cni",
		"socketPath":        "/var/run/mesh-cni/gate.sock",
		"gateTimeout":       "30s",
		"excludeNamespaces": []string{"kube-system"},
	})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func TestKindOf(t *testing.T) {
	for name, want := range map[string]Kind{
		"10-bridge.conf":     KindConf,
		"10-bridge.json":     KindConf,
		"10-bridge.conflist": KindList,
		"10-bridge.conf.bak": KindNone,
		".mesh-cni-x.tmp":    KindNone,
		"conflist":           KindNone,
	} {
		if got := KindOf(name); got != want {
			t.Errorf("KindOf(%q) = %v, want %v", name, got, want)
		}
	}
	if got := ListName("10-bridge.conf"); got != "10-bridge.conflist" {
		t.Errorf("ListName = %q", got)
	}
}

func TestNewEntry(t *testing.T) {
	if _, err := NewEntry(map[string]any{"socketPath": "x"}); err == nil {
		t.Error("entry without type accepted")
	}
	if _, err := NewEntry(json.RawMessage(`[1]`)); err == nil {
		t.Error("array entry accepted")
	}
	if _, err := NewEntry(json.RawMessage(`{"type":`)); err == nil {
		t.Error("truncated entry accepted")
	}
	e, err := NewEntry(json.RawMessage(" {\"type\": \"mesh-cni\", \"a\": \"<&>\"}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if e.Type != "mesh-cni" || string(e.Raw) != `{"type":"mesh-cni","a":"<&>"}` {
		t.Errorf("entry = %+v", e)
	}
}

func TestMergeKeepsOrderAndUnknownFields(t *testing.T) {
	in := []byte(`{"name":"k8s","x-vendor":{"b":1,"a":[1,2.50,"<>"]},"plugins":[{"type":"calico","zz":1e3,"aa":null},{"type":"mesh-cni","old":true},{"type":"portmap","capabilities":{"portMappings":true}}],"cniVersion":"0.4.0"}`)
	e := testEntry(t)
	out, err := Merge(KindList, in, e)
	if err != nil {
		t.Fatal(err)
	}
	want := `{
  "name": "k8s",
  "x-vendor": {
    "b": 1,
    "a": [
      1,
      2.50,
      "<>"
    ]
  },
  "plugins": [
    {
      "type": "calico",
      "zz": 1e3,
      "aa": null
    },
    {
      "type": "portmap",
      "capabilities": {
        "portMappings": true
      }
    },
    ` + indentEntry(t, e) + `
  ],
  "cniVersion": "0.4.0"
}
`
	if string(out) != want {
		t.Errorf("merged:\n%s\nwant:\n%s", out, want)
	}
	again, err := Merge(KindList, out, e)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(again, out) {
		t.Errorf("second merge changed the bytes:\n%s", again)
	}
}

func indentEntry(t *testing.T, e Entry) string {
	var buf bytes.Buffer
	if err := json.Indent(&buf, e.Raw, "    ", "  "); err != nil {
		t.Fatal(err)
	}
	return buf.String()
}

func TestParseRejectsWhatLibcniRejects(t *testing.T) {
	for name, tc := range map[string]struct {
		kind Kind
		data string
	}{
		"empty":         {KindList, ``},
		"truncated":     {KindList, `{"name":"a","plugins":[{"type":"b"}`},
		"no name":       {KindList, `{"cniVersion":"1.0.0","plugins":[{"type":"b"}]}`},
		"no plugins":    {KindList, `{"name":"a","plugins":[]}`},
		"plugin type":   {KindList, `{"name":"a","plugins":[{"x":1}]}`},
		"plugins str":   {KindList, `{"name":"a","plugins":"b"}`},
		"trailing":      {KindList, `{"name":"a","plugins":[{"type":"b"}]} x`},
		"array":         {KindList, `[]`},
		"conf no type":  {KindConf, `{"name":"a","cniVersion":"1.0.0"}`},
		"conf garbage":  {KindConf, `{"name":`},
		"conf is array": {KindConf, `[{"type":"a"}]`},
	} {
		t.Run(name, func(t *testing.T) {
			if _, err := Parse(tc.kind, []byte(tc.data)); err == nil {
				t.Errorf("accepted %q", tc.data)
			}
		})
	}
}

func TestWithoutDropsEmptyPlugins(t *testing.T) {
	e := testEntry(t)
	l, err := ParseList([]byte(`{"name":"a","cniVersion":"1.0.0"}`))
	if err != nil {
		t.Fatal(err)
	}
	merged := l.WithEntry(e)
	if !merged.HasEntryLast(e) {
		t.Fatal("entry missing")
	}
	back, found := merged.Without(e.Type)
	if !found {
		t.Fatal("entry not found")
	}
	b, err := back.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if !Equal(b, []byte(`{"name":"a","cniVersion":"1.0.0"}`)) {
		t.Errorf("stripped = %s", b)
	}
}

func TestCheckVersion(t *testing.T) {
	for v, ok := range map[string]bool{
		"0.3.0": true, "0.3.1": true, "0.4.0": true, "1.0.0": true, "1.1.0": true,
		"0.2.0": false, "1.2.0": false, "": false, "banana": false,
	} {
		err := CheckVersion(v, "0.3.0", "1.1.0")
		if (err == nil) != ok {
			t.Errorf("CheckVersion(%q) = %v", v, err)
		}
	}
}

// FuzzMergeConflist checks the merge on arbitrary input: whatever libcni accepts
// merges into a list libcni accepts, with every original plugin kept in order,
// the top level unchanged, the entry exactly once and last, and a second merge
// changing nothing.
func FuzzMergeConflist(f *testing.F) {
	f.Add([]byte(`{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"bridge"}]}`), true)
	f.Add([]byte(`{"cniVersion":"0.3.1","name":"n","type":"bridge","ipam":{"type":"host-local"}}`), false)
	e := testEntry(f)
	f.Fuzz(func(t *testing.T, data []byte, isList bool) {
		kind := KindConf
		if isList {
			kind = KindList
		}
		orig, err := Parse(kind, data)
		if err != nil {
			if _, err := Merge(kind, data, e); err == nil {
				t.Fatal("Merge accepted what Parse rejected")
			}
			return
		}
		out, err := Merge(kind, data, e)
		if err != nil {
			t.Fatalf("merge: %v", err)
		}
		nc, err := libcni.ConfListFromBytes(out)
		if err != nil {
			t.Fatalf("libcni rejects the merged list: %v\n%s", err, out)
		}
		if nc.Name != orig.Name || nc.CNIVersion != orig.CNIVersion {
			t.Fatalf("name/version changed: %q %q -> %q %q", orig.Name, orig.CNIVersion, nc.Name, nc.CNIVersion)
		}
		merged, err := ParseList(out)
		if err != nil {
			t.Fatalf("reparse: %v", err)
		}
		if merged.Count(e.Type) != 1 || !merged.HasEntryLast(e) {
			t.Fatalf("entry not exactly once and last:\n%s", out)
		}
		var kept []json.RawMessage
		for _, p := range orig.Plugins {
			if PluginType(p) != e.Type {
				kept = append(kept, p)
			}
		}
		if len(merged.Plugins) != len(kept)+1 {
			t.Fatalf("got %d plugins, want %d", len(merged.Plugins), len(kept)+1)
		}
		for i, p := range kept {
			if !Equal(p, merged.Plugins[i]) {
				t.Fatalf("plugin %d changed: %s -> %s", i, p, merged.Plugins[i])
			}
		}
		if len(merged.keys) < len(orig.keys) {
			t.Fatalf("top-level keys lost: %q -> %q", orig.keys, merged.keys)
		}
		for i, k := range orig.keys {
			if merged.keys[i] != k {
				t.Fatalf("top-level key order changed: %q -> %q", orig.keys, merged.keys)
			}
			if k != "plugins" && !Equal(orig.values[k], merged.values[k]) {
				t.Fatalf("top-level %q changed: %s -> %s", k, orig.values[k], merged.values[k])
			}
		}
		again, err := Merge(KindList, out, e)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(again, out) {
			t.Fatalf("merge is not idempotent:\n%s\n%s", out, again)
		}
		if strings.Count(string(out), "\n") == 0 {
			t.Fatal("output is not indented")
		}
	})
}
