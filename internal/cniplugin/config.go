package cniplugin

import (
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/mesh-cni/mesh-cni/pkg/gate/gateclient"
)

// Defaults of the plugin's config fields.
const (
	DefaultSocketPath  = "/var/run/mesh-cni/gate.sock"
	DefaultGateTimeout = 30 * time.Second
	DefaultDelTimeout  = 2 * time.Second
	DefaultLogLevel    = "info"
	// MaxGateTimeout bounds gateTimeout: a pod's sandbox is held for at most
	// this long. Runtimes give up on a sandbox well before (kubelet's runtime
	// request timeout is 2 minutes by default), so a longer value would only
	// keep a plugin process and its socket around after the runtime left.
	MaxGateTimeout = 5 * time.Minute
	// MaxDelTimeout bounds delTimeout: DEL, CHECK, GC and STATUS hold a pod's
	// teardown or a runtime's status poll, and DEL succeeds without the agent.
	MaxDelTimeout = time.Minute
	// MaxStdin bounds the network configuration the plugin reads. A conflist
	// entry with its prevResult and a GC list for a full node is a few
	// hundred KiB at most.
	MaxStdin = 4 << 20
)

// NetConf is the plugin's entry in the conflist.
type NetConf struct {
	types.NetConf

	// SocketPath is the agent's gate socket.
	SocketPath string `json:"socketPath,omitempty"`
	// GateTimeout bounds how long ADD waits for the agent (a Go duration string).
	GateTimeout Duration `json:"gateTimeout,omitempty"`
	// DelTimeout bounds how long DEL, CHECK, GC and STATUS wait for the agent.
	DelTimeout Duration `json:"delTimeout,omitempty"`
	// ExcludeNamespaces are passed straight through without contacting the agent.
	// Absent means ["kube-system"]; an empty list excludes nothing.
	ExcludeNamespaces *[]string `json:"excludeNamespaces,omitempty"`
	// LogLevel is debug, info, warn or error.
	LogLevel string `json:"logLevel,omitempty"`
	// LogFile, when set, receives the plugin's logs; otherwise stderr does. Never
	// stdout: it carries the CNI result.
	LogFile string `json:"logFile,omitempty"`
	// Attachments is the GC list under its early name; ValidAttachments (in
	// types.NetConf) is the current one.
	Attachments []types.GCAttachment `json:"cni.dev/attachments,omitempty"`
}

// Duration is a time.Duration written as a Go duration string ("30s").
type Duration time.Duration

// errBadDuration marks a duration field that decodes as JSON but is not a
// valid duration: an invalid network configuration (code 7), not a decoding
// failure (code 6).
var errBadDuration = errors.New("invalid duration")

// UnmarshalJSON implements json.Unmarshaler.
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("%w: want a duration string such as \"30s\", got %s", errBadDuration, truncate(string(b), 40))
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("%w %q: %v", errBadDuration, truncate(s, 40), err)
	}
	if v <= 0 {
		return fmt.Errorf("%w %q: must be positive", errBadDuration, truncate(s, 40))
	}
	*d = Duration(v)
	return nil
}

// MarshalJSON implements json.Marshaler.
func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(time.Duration(d).String()) }

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// Excluded reports whether pods of namespace pass through without the agent.
func (c *NetConf) Excluded(namespace string) bool {
	return slices.Contains(*c.ExcludeNamespaces, namespace)
}

// parseConfig decodes stdin, applies defaults, parses prevResult and validates.
// Its errors are CNI errors with the code the spec assigns.
func parseConfig(stdin []byte) (*NetConf, error) {
	conf, err := parseConfigOnly(stdin)
	if err != nil {
		return nil, err
	}
	if conf.RawPrevResult != nil {
		if err := version.ParsePrevResult(&conf.NetConf); err != nil {
			return nil, types.NewError(types.ErrDecodingFailure, "mesh-cni: cannot parse prevResult", err.Error())
		}
	}
	return conf, nil
}

// ParseEntry reads the plugin's entry of a conflist as the plugin does
// (defaults applied, validated), without prevResult: for the agent's status,
// which says what the entry on disk makes the plugin do.
func ParseEntry(entry []byte) (*NetConf, error) { return parseConfigOnly(entry) }

// parseConfigOnly is parseConfig without prevResult, for the commands that do
// not read it (DEL, GC, STATUS): a prevResult they cannot parse must not fail
// them.
func parseConfigOnly(stdin []byte) (*NetConf, error) {
	conf := &NetConf{}
	if err := json.Unmarshal(stdin, conf); err != nil {
		if errors.Is(err, errBadDuration) {
			return nil, types.NewError(types.ErrInvalidNetworkConfig, "mesh-cni: gateTimeout and delTimeout must be durations such as \"30s\"", err.Error())
		}
		return nil, types.NewError(types.ErrDecodingFailure, "mesh-cni: cannot decode the network configuration", err.Error())
	}
	if conf.SocketPath == "" {
		conf.SocketPath = DefaultSocketPath
	}
	if conf.GateTimeout == 0 {
		conf.GateTimeout = Duration(DefaultGateTimeout)
	}
	if conf.DelTimeout == 0 {
		conf.DelTimeout = Duration(DefaultDelTimeout)
	}
	if conf.ExcludeNamespaces == nil {
		ex := []string{gateclient.DefaultExcludeNamespace}
		conf.ExcludeNamespaces = &ex
	}
	if conf.LogLevel == "" {
		conf.LogLevel = DefaultLogLevel
	}
	if time.Duration(conf.GateTimeout) > MaxGateTimeout {
		return nil, types.NewError(types.ErrInvalidNetworkConfig,
			fmt.Sprintf("mesh-cni: gateTimeout %s is longer than the limit of %s", time.Duration(conf.GateTimeout), MaxGateTimeout), "")
	}
	if time.Duration(conf.DelTimeout) > MaxDelTimeout {
		return nil, types.NewError(types.ErrInvalidNetworkConfig,
			fmt.Sprintf("mesh-cni: delTimeout %s is longer than the limit of %s", time.Duration(conf.DelTimeout), MaxDelTimeout), "")
	}
	if !filepath.IsAbs(conf.SocketPath) {
		return nil, types.NewError(types.ErrInvalidNetworkConfig, "mesh-cni: socketPath must be an absolute path", conf.SocketPath)
	}
	if _, err := parseLevel(conf.LogLevel); err != nil {
		return nil, types.NewError(types.ErrInvalidNetworkConfig, "mesh-cni: logLevel must be debug, info, warn or error", conf.LogLevel)
	}
	if conf.LogFile != "" && !filepath.IsAbs(conf.LogFile) {
		return nil, types.NewError(types.ErrInvalidNetworkConfig, "mesh-cni: logFile must be an absolute path", conf.LogFile)
	}
	for _, ns := range *conf.ExcludeNamespaces {
		if strings.TrimSpace(ns) == "" {
			return nil, types.NewError(types.ErrInvalidNetworkConfig, "mesh-cni: excludeNamespaces contains an empty name", "")
		}
	}
	return conf, nil
}

// attachment is the call's attachment (container, interface, this network)
// as the gate names it.
func (c *NetConf) attachment(args *skel.CmdArgs) gateclient.Attachment {
	return gateclient.Attachment{ContainerID: args.ContainerID, Ifname: args.IfName, Network: c.Name}
}

// validAttachments returns the GC list under either of its names.
func (c *NetConf) validAttachments() []types.GCAttachment {
	if len(c.ValidAttachments) > 0 {
		return c.ValidAttachments
	}
	return c.Attachments
}
