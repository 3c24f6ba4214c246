// Package containerdhook plays containerd in front of network-plugin hooks,
// written from the containerd fork that carries the PodNetworkLifecycle API
// (github.com/MikeZappa87/containerd, branch mzappa/podapi at commit
// b5dc60445dc9537d5e473bec6b1aef9b3c487be1):
//   - api/services/networking/v1/networking.proto for the wire format, which
//     this package encodes and decodes by field number with protowire, not
//     with this repository's generated code;
//   - core/networking/grpc_plugin.go: each plugin is called in order with the
//     accumulated result as prev_result (nil for the first, the primary); the
//     results are merged by appending interfaces and routes, a later DNS
//     replacing an earlier one (mergeResults); a failed setup tears down the
//     plugins already set up, in reverse order; CheckHealth needs the socket
//     file and a ready answer from every plugin;
//   - internal/cri/server/sandbox_run.go (setupPodNetworkGRPC): the pod's IPs
//     are every address of every interface of the merged result, in order,
//     the first being the pod IP and the rest additional IPs;
//   - internal/cri/server/status.go: a failed CheckHealth makes the runtime's
//     NetworkReady condition false;
//   - internal/cri/server/grpc_plugin_syncer.go, core/networking/
//     plugin_registry.go and NewGRPCPlugin: how the chain is loaded from the
//     plugin directory, dialed and swapped (Loader).
//
// The fork is published only as a git branch, not as a module the Go module
// proxy serves (it refuses the fork's commits: its go.mod names upstream's
// module path), and CI reaches only the module proxy and Debian, so the
// runtime's side is this double. test/e2e's TestHookRealContainerd runs the
// hook's cases against a containerd build with the loader where one is given
// (it passes against the fork built from that commit).
package containerdhook

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
)

// Interface is a NetworkInterface of a result.
type Interface struct {
	Name, MAC string
	RDMA      bool
	MTU       uint32
	State     string
	Addresses []string // CIDR or plain IP
}

// Route is a RouteEntry of a result.
type Route struct {
	Destination, Gateway, InterfaceName string
	Metric                              uint32
	Scope                               string
}

// DNS is a DNSConfig.
type DNS struct{ Servers, Searches, Options []string }

// Result is a SetupPodNetworkResponse, and the chain's accumulated result.
type Result struct {
	Interfaces []Interface
	Routes     []Route
	DNS        *DNS
}

// Pod is what the runtime tells each plugin about the sandbox.
type Pod struct {
	SandboxID, NetnsPath, Name, Namespace, UID string
	Labels, Annotations                        map[string]string
	CgroupParent                               string
}

// Plugin is one network plugin of the chain.
type Plugin interface {
	Setup(ctx context.Context, pod Pod, prev *Result) (*Result, error)
	Teardown(ctx context.Context, pod Pod, prev *Result) error
	CheckHealth(ctx context.Context) error
}

// Done is a plugin whose work is already done: the primary, whose network the
// test set up itself (a real CNI ADD), answering with that result.
type Done struct{ Result *Result }

// Setup implements Plugin.
func (d Done) Setup(context.Context, Pod, *Result) (*Result, error) { return d.Result, nil }

// Teardown implements Plugin.
func (Done) Teardown(context.Context, Pod, *Result) error { return nil }

// CheckHealth implements Plugin.
func (Done) CheckHealth(context.Context) error { return nil }

// Chain is containerd's ChainedPodNetworkPlugin.
type Chain struct {
	Plugins []Plugin
	Names   []string
}

// Setup runs every plugin in order and returns the merged result.
func (c *Chain) Setup(ctx context.Context, pod Pod) (*Result, error) {
	var prev *Result
	for i, p := range c.Plugins {
		res, err := p.Setup(ctx, pod, prev)
		if err != nil {
			for j := i - 1; j >= 0; j-- {
				_ = c.Plugins[j].Teardown(ctx, pod, prev)
			}
			return nil, fmt.Errorf("network plugin %q (index %d) setup failed: %w", c.Names[i], i, err)
		}
		prev = merge(prev, res)
	}
	return prev, nil
}

// Teardown runs every plugin in reverse order with the final result.
func (c *Chain) Teardown(ctx context.Context, pod Pod, final *Result) error {
	var first error
	for i := len(c.Plugins) - 1; i >= 0; i-- {
		if err := c.Plugins[i].Teardown(ctx, pod, final); err != nil && first == nil {
			first = fmt.Errorf("network plugin %q (index %d) teardown failed: %w", c.Names[i], i, err)
		}
	}
	return first
}

// NetworkReady is the runtime's NetworkReady condition: every plugin healthy.
func (c *Chain) NetworkReady(ctx context.Context) error {
	for i, p := range c.Plugins {
		if err := p.CheckHealth(ctx); err != nil {
			return fmt.Errorf("network plugin %q (index %d) health check failed: %w", c.Names[i], i, err)
		}
	}
	return nil
}

func merge(prev, next *Result) *Result {
	if prev == nil {
		return next
	}
	if next == nil {
		return prev
	}
	m := &Result{
		Interfaces: append(append([]Interface{}, prev.Interfaces...), next.Interfaces...),
		Routes:     append(append([]Route{}, prev.Routes...), next.Routes...),
		DNS:        prev.DNS,
	}
	if next.DNS != nil {
		m.DNS = next.DNS
	}
	return m
}

// PodIPs derives the sandbox's IPs from the merged result as the runtime does:
// every parseable address of every interface, the first as the pod IP.
func PodIPs(r *Result) (ip string, additional []string, err error) {
	if r == nil {
		return "", nil, errors.New("no result")
	}
	for _, iface := range r.Interfaces {
		for _, addr := range iface.Addresses {
			parsed, _, err := net.ParseCIDR(addr)
			if err != nil {
				parsed = net.ParseIP(addr)
			}
			if parsed == nil {
				continue
			}
			if ip == "" {
				ip = parsed.String()
			} else {
				additional = append(additional, parsed.String())
			}
		}
	}
	if ip == "" {
		return "", nil, errors.New("gRPC network plugin returned no IP")
	}
	return ip, additional, nil
}

// Service and methods of PodNetworkLifecycle.
const (
	methodSetup    = "/containerd.services.networking.v1.PodNetworkLifecycle/SetupPodNetwork"
	methodTeardown = "/containerd.services.networking.v1.PodNetworkLifecycle/TeardownPodNetwork"
	methodHealth   = "/containerd.services.networking.v1.PodNetworkLifecycle/CheckHealth"
)

// rawCodec sends and receives messages this package encoded itself.
type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error) {
	b, ok := v.(*[]byte)
	if !ok {
		return nil, fmt.Errorf("rawCodec: %T", v)
	}
	return *b, nil
}

func (rawCodec) Unmarshal(data []byte, v any) error {
	b, ok := v.(*[]byte)
	if !ok {
		return fmt.Errorf("rawCodec: %T", v)
	}
	*b = append([]byte(nil), data...)
	return nil
}

func (rawCodec) Name() string { return "proto" }

var _ encoding.Codec = rawCodec{}

// GRPC is a registered hook, called over its Unix socket as the runtime does.
type GRPC struct {
	address string
	conn    *grpc.ClientConn
}

// Close closes the connection.
func (g *GRPC) Close() error { return g.conn.Close() }

// Setup implements Plugin.
func (g *GRPC) Setup(ctx context.Context, pod Pod, prev *Result) (*Result, error) {
	req := encodeSetup(pod, prev)
	var resp []byte
	if err := g.conn.Invoke(ctx, methodSetup, &req, &resp); err != nil {
		return nil, fmt.Errorf("gRPC SetupPodNetwork failed: %w", err)
	}
	return decodeResult(resp)
}

// Teardown implements Plugin.
func (g *GRPC) Teardown(ctx context.Context, pod Pod, prev *Result) error {
	req := encodeTeardown(pod, prev)
	var resp []byte
	if err := g.conn.Invoke(ctx, methodTeardown, &req, &resp); err != nil {
		return fmt.Errorf("gRPC TeardownPodNetwork failed: %w", err)
	}
	return nil
}

// CheckHealth implements Plugin: the socket must exist and the hook answer
// ready.
func (g *GRPC) CheckHealth(ctx context.Context) error {
	if _, err := os.Stat(g.address); err != nil {
		return fmt.Errorf("gRPC network plugin socket %s not available: %w", g.address, err)
	}
	// No deadline of its own: the runtime's status call bounds it.
	var req, resp []byte
	if err := g.conn.Invoke(ctx, methodHealth, &req, &resp); err != nil {
		return fmt.Errorf("gRPC network plugin health check failed at %s: %w", g.address, err)
	}
	ready, msg, err := decodeHealth(resp)
	if err != nil {
		return err
	}
	if !ready {
		if msg == "" {
			msg = "plugin reported not ready"
		}
		return fmt.Errorf("gRPC network plugin at %s is not ready: %s", g.address, msg)
	}
	return nil
}

// Health returns the hook's CheckHealth answer as it is.
func (g *GRPC) Health(ctx context.Context) (ready bool, message string, err error) {
	var req, resp []byte
	if err := g.conn.Invoke(ctx, methodHealth, &req, &resp); err != nil {
		return false, "", err
	}
	return decodeHealth(resp)
}

// Dial connects to a plugin's socket the way the runtime's loader does
// (blocking, within the default dial timeout).
func Dial(address string) (*GRPC, error) {
	return dialBlocking(address, 5*time.Second)
}
