// Package cniconf reads, merges and writes CNI network configuration files
// without losing anything it does not understand.
//
// A primary CNI (Calico, Cilium, flannel, bridge, ...) owns its config file and
// may carry fields mesh-cni has never heard of, at the top level and inside each
// plugin. Decoding into typed structs and encoding again would drop them, so this
// package keeps every plugin as raw JSON and the top-level keys as an ordered
// list of raw values: only the "plugins" array is rebuilt. Validity is decided by
// libcni itself (ConfListFromBytes / ConfFromBytes), so a file is accepted here
// exactly when a container runtime would accept it.
package cniconf

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"reflect"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/version"
)

// Kind is how a runtime interprets a file in the CNI config directory, decided by
// its extension the way libcni-based runtimes (containerd, CRI-O) do.
type Kind int

const (
	// KindNone is a file a runtime does not load.
	KindNone Kind = iota
	// KindConf is a single plugin config (".conf" or ".json").
	KindConf
	// KindList is a network config list (".conflist").
	KindList
)

func (k Kind) String() string {
	switch k {
	case KindConf:
		return "conf"
	case KindList:
		return "conflist"
	default:
		return "none"
	}
}

// Extensions are the file extensions runtimes load from the CNI config directory.
func Extensions() []string { return []string{".conf", ".conflist", ".json"} }

// KindOf tells how a runtime reads the file called name.
func KindOf(name string) Kind {
	switch filepath.Ext(name) {
	case ".conflist":
		return KindList
	case ".conf", ".json":
		return KindConf
	default:
		return KindNone
	}
}

// ListName is the ".conflist" name a single-plugin config file is converted to.
func ListName(name string) string {
	return name[:len(name)-len(filepath.Ext(name))] + ".conflist"
}

// List is a network config list with its unknown parts kept verbatim.
type List struct {
	// keys are the top-level keys in the order they first appear in the file;
	// "plugins" is among them when the file has it.
	keys []string
	// values holds the raw top-level values other than "plugins". A key that
	// appears twice keeps its last value, which is what libcni sees too.
	values map[string]json.RawMessage
	// Plugins are the inline plugin configs, verbatim.
	Plugins []json.RawMessage

	// Name is the network name.
	Name string
	// CNIVersion is the version libcni runs the list with (the highest usable
	// entry of "cniVersions" when present, else "cniVersion").
	CNIVersion string
	// LoadOnlyInlinedPlugins mirrors the list flag: when false, libcni also
	// loads plugins from <confdir>/<Name>/*.conf and appends them after the
	// inline ones.
	LoadOnlyInlinedPlugins bool
	// Converted is set when the list was made from a single-plugin config.
	Converted bool
}

// Parse reads a config file of the given kind. A KindConf file is converted to a
// list the way libcni's ConfListFromConf does, keeping the plugin verbatim.
func Parse(kind Kind, data []byte) (*List, error) {
	switch kind {
	case KindList:
		return ParseList(data)
	case KindConf:
		return ParseConf(data)
	default:
		return nil, fmt.Errorf("not a CNI config kind: %v", kind)
	}
}

// ParseList reads a ".conflist" file.
func ParseList(data []byte) (*List, error) {
	nc, err := libcni.NetworkConfFromBytes(data)
	if err != nil {
		return nil, err
	}
	keys, values, err := decodeObject(data)
	if err != nil {
		return nil, err
	}
	l := &List{
		keys:                   keys,
		values:                 values,
		Name:                   nc.Name,
		CNIVersion:             nc.CNIVersion,
		LoadOnlyInlinedPlugins: nc.LoadOnlyInlinedPlugins,
	}
	if raw, ok := values["plugins"]; ok {
		delete(values, "plugins")
		if err := json.Unmarshal(raw, &l.Plugins); err != nil {
			return nil, fmt.Errorf("decode plugins: %w", err)
		}
	}
	return l, nil
}

// ParseConf reads a single-plugin ".conf" / ".json" file as a list holding that
// one plugin.
func ParseConf(data []byte) (*List, error) {
	// Runtimes read these files with libcni's (deprecated) ConfFromFile and
	// ConfListFromConf; NetworkPluginConfFromBytes is the same parser.
	conf, err := libcni.NetworkPluginConfFromBytes(data)
	if err != nil {
		return nil, err
	}
	var plugin bytes.Buffer
	if err := json.Compact(&plugin, data); err != nil {
		return nil, fmt.Errorf("error parsing configuration: %w", err)
	}
	name, err := encodeString(conf.Network.Name)
	if err != nil {
		return nil, err
	}
	ver, err := encodeString(conf.Network.CNIVersion)
	if err != nil {
		return nil, err
	}
	l := &List{
		keys:       []string{"cniVersion", "name", "plugins"},
		values:     map[string]json.RawMessage{"cniVersion": ver, "name": name},
		Plugins:    []json.RawMessage{plugin.Bytes()},
		Name:       conf.Network.Name,
		CNIVersion: conf.Network.CNIVersion,
		Converted:  true,
	}
	// The check a runtime makes when it converts the file.
	list, err := l.Marshal()
	if err != nil {
		return nil, err
	}
	if _, err := libcni.NetworkConfFromBytes(list); err != nil {
		return nil, fmt.Errorf("convert to a config list: %w", err)
	}
	return l, nil
}

// Clone returns a copy that shares no slices or maps with l.
func (l *List) Clone() *List {
	c := *l
	c.keys = append([]string(nil), l.keys...)
	c.values = make(map[string]json.RawMessage, len(l.values))
	for k, v := range l.values {
		c.values[k] = v
	}
	c.Plugins = append([]json.RawMessage(nil), l.Plugins...)
	return &c
}

// Count tells how many inline plugins have the given type.
func (l *List) Count(typ string) int {
	n := 0
	for _, p := range l.Plugins {
		if PluginType(p) == typ {
			n++
		}
	}
	return n
}

// HasEntryLast tells whether exactly one inline plugin has e's type, it is the
// last one, and its config equals e's.
func (l *List) HasEntryLast(e Entry) bool {
	if len(l.Plugins) == 0 || l.Count(e.Type) != 1 {
		return false
	}
	return Equal(l.Plugins[len(l.Plugins)-1], e.Raw)
}

// WithEntry returns a copy with every plugin of e's type removed and e appended
// as the last plugin. Replacing rather than editing an existing entry means an
// agent upgrade that changes the entry's fields takes effect, and the entry can
// never appear twice.
func (l *List) WithEntry(e Entry) *List {
	c, _ := l.Without(e.Type)
	c.Plugins = append(c.Plugins, e.Raw)
	return c
}

// Without returns a copy with every plugin of the given type removed, and
// whether there was any. A list left without inline plugins loses its "plugins"
// key (libcni rejects an empty array; without the key it loads plugins from
// files).
func (l *List) Without(typ string) (*List, bool) {
	c := l.Clone()
	c.Plugins = c.Plugins[:0]
	found := false
	for _, p := range l.Plugins {
		if PluginType(p) == typ {
			found = true
			continue
		}
		c.Plugins = append(c.Plugins, p)
	}
	return c, found
}

// Inline appends plugins that libcni would load from files after the inline
// ones and sets "loadOnlyInlinedPlugins", so that a copy of the list written
// under another name runs the same chain without reading those files.
func (l *List) Inline(plugins []json.RawMessage) *List {
	c := l.Clone()
	c.Plugins = append(c.Plugins, plugins...)
	c.set("loadOnlyInlinedPlugins", json.RawMessage("true"))
	c.LoadOnlyInlinedPlugins = true
	return c
}

func (l *List) set(key string, v json.RawMessage) {
	if _, ok := l.values[key]; !ok {
		l.keys = append(l.keys, key)
	}
	l.values[key] = v
}

// Marshal encodes the list: top-level keys in their original order with their
// original values, "plugins" where it was (last when it was not there), two-space
// indentation and a final newline. The same list always gives the same bytes.
func (l *List) Marshal() ([]byte, error) {
	var buf bytes.Buffer
	buf.WriteByte('{')
	first := true
	writeKey := func(k string) error {
		if !first {
			buf.WriteByte(',')
		}
		first = false
		ks, err := encodeString(k)
		if err != nil {
			return err
		}
		buf.Write(ks)
		buf.WriteByte(':')
		return nil
	}
	writePlugins := func() error {
		if err := writeKey("plugins"); err != nil {
			return err
		}
		buf.WriteByte('[')
		for i, p := range l.Plugins {
			if i > 0 {
				buf.WriteByte(',')
			}
			buf.Write(p)
		}
		buf.WriteByte(']')
		return nil
	}
	wrotePlugins := false
	for _, k := range l.keys {
		if k == "plugins" {
			if len(l.Plugins) == 0 {
				continue
			}
			if err := writePlugins(); err != nil {
				return nil, err
			}
			wrotePlugins = true
			continue
		}
		if err := writeKey(k); err != nil {
			return nil, err
		}
		buf.Write(l.values[k])
	}
	if !wrotePlugins && len(l.Plugins) > 0 {
		if err := writePlugins(); err != nil {
			return nil, err
		}
	}
	buf.WriteByte('}')
	var out bytes.Buffer
	if err := json.Indent(&out, buf.Bytes(), "", "  "); err != nil {
		return nil, fmt.Errorf("encode config list: %w", err)
	}
	out.WriteByte('\n')
	return out.Bytes(), nil
}

// Entry is the plugin config mesh-cni adds to a chain.
type Entry struct {
	// Type is the entry's "type" field; plugins of this type are "ours".
	Type string
	// Raw is the entry's JSON object, compact.
	Raw json.RawMessage
}

// NewEntry makes an Entry from a JSON-marshalable value (a struct, a map, or
// json.RawMessage). It must be an object with a non-empty string "type".
func NewEntry(v any) (Entry, error) {
	var raw []byte
	switch t := v.(type) {
	case json.RawMessage:
		raw = t
	case []byte:
		raw = t
	default:
		b, err := json.Marshal(v)
		if err != nil {
			return Entry{}, fmt.Errorf("encode chain entry: %w", err)
		}
		raw = b
	}
	var buf bytes.Buffer
	if err := json.Compact(&buf, raw); err != nil {
		return Entry{}, fmt.Errorf("chain entry is not JSON: %w", err)
	}
	conf, err := libcni.NetworkPluginConfFromBytes(buf.Bytes())
	if err != nil {
		return Entry{}, fmt.Errorf("chain entry: %w", err)
	}
	return Entry{Type: conf.Network.Type, Raw: buf.Bytes()}, nil
}

// Merge adds e as the last plugin of the config in data (of the given kind) and
// returns the resulting config list.
func Merge(kind Kind, data []byte, e Entry) ([]byte, error) {
	l, err := Parse(kind, data)
	if err != nil {
		return nil, err
	}
	return l.WithEntry(e).Marshal()
}

// PluginType returns the "type" of a plugin config the way libcni reads it
// (encoding/json field matching), or "" when there is none.
func PluginType(raw json.RawMessage) string {
	var p struct {
		Type string `json:"type"`
	}
	if err := json.Unmarshal(raw, &p); err != nil {
		return ""
	}
	return p.Type
}

// Equal reports whether two JSON documents have the same value, ignoring
// whitespace and object key order. Numbers compare by their text.
func Equal(a, b []byte) bool {
	va, err := decodeValue(a)
	if err != nil {
		return false
	}
	vb, err := decodeValue(b)
	if err != nil {
		return false
	}
	return reflect.DeepEqual(va, vb)
}

func decodeValue(b []byte) (any, error) {
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	var v any
	if err := d.Decode(&v); err != nil {
		return nil, err
	}
	return v, nil
}

// CheckVersion fails unless lowest <= v <= highest.
func CheckVersion(v, lowest, highest string) error {
	if v == "" {
		return fmt.Errorf("config has no cniVersion")
	}
	lt, err := version.GreaterThan(lowest, v)
	if err != nil {
		return fmt.Errorf("cniVersion %q: %w", v, err)
	}
	gt, err := version.GreaterThan(v, highest)
	if err != nil {
		return fmt.Errorf("cniVersion %q: %w", v, err)
	}
	if lt || gt {
		return fmt.Errorf("cniVersion %s is outside the range mesh-cni supports (%s to %s)", v, lowest, highest)
	}
	return nil
}

// decodeObject splits a JSON object into its keys (in order of first
// appearance) and raw values (last one wins for a repeated key).
func decodeObject(data []byte) ([]string, map[string]json.RawMessage, error) {
	d := json.NewDecoder(bytes.NewReader(data))
	tok, err := d.Token()
	if err != nil {
		return nil, nil, fmt.Errorf("error parsing configuration list: %w", err)
	}
	if delim, ok := tok.(json.Delim); !ok || delim != '{' {
		return nil, nil, errors.New("error parsing configuration list: not a JSON object")
	}
	var keys []string
	values := map[string]json.RawMessage{}
	for d.More() {
		tok, err := d.Token()
		if err != nil {
			return nil, nil, fmt.Errorf("error parsing configuration list: %w", err)
		}
		key, ok := tok.(string)
		if !ok {
			return nil, nil, fmt.Errorf("error parsing configuration list: unexpected %v", tok)
		}
		var raw json.RawMessage
		if err := d.Decode(&raw); err != nil {
			return nil, nil, fmt.Errorf("error parsing configuration list: key %q: %w", key, err)
		}
		if _, seen := values[key]; !seen {
			keys = append(keys, key)
		}
		values[key] = raw
	}
	if _, err := d.Token(); err != nil {
		return nil, nil, fmt.Errorf("error parsing configuration list: %w", err)
	}
	if _, err := d.Token(); err != io.EOF {
		return nil, nil, errors.New("error parsing configuration list: data after the top-level object")
	}
	return keys, values, nil
}

// encodeString encodes s as a JSON string without HTML escaping, so keys and
// names keep the spelling they had.
func encodeString(s string) (json.RawMessage, error) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(s); err != nil {
		return nil, fmt.Errorf("encode %q: %w", s, err)
	}
	return bytes.TrimRight(buf.Bytes(), "\n"), nil
}
