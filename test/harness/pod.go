package harness

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
	types100 "github.com/containernetworking/cni/pkg/types/100"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// cleanupTimeout bounds each CNI DEL the harness issues from a test's cleanup, where
// the test's own context is already gone.
const cleanupTimeout = 30 * time.Second

// Pod is a test "pod": a network namespace with the identity a runtime hands to CNI.
type Pod struct {
	Node        *Node
	Namespace   string
	Name        string
	UID         string
	ContainerID string // the sandbox (infra container) id, 64 hex digits
	NetNSPath   string
	IfName      string // "eth0"

	mu       sync.Mutex
	attached map[string]attachment // by network name: what cleanup must DEL
	result   *types100.Result      // last successful ADD
}

type attachment struct {
	list *libcni.NetworkConfigList
	rt   *libcni.RuntimeConf
}

// NewPod makes a pod network namespace on this node. In the test's cleanup every
// network the pod was ADDed to (successfully or not) is DELeted the way a runtime
// would, errors ignored since the test may have deleted it already, then the
// namespace is removed.
func (n *Node) NewPod(tb testing.TB, namespace, name string) *Pod {
	tb.Helper()
	u := fixtures.RandomBytes(16)
	p := &Pod{
		Node:        n,
		Namespace:   namespace,
		Name:        name,
		UID:         fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16]),
		ContainerID: fixtures.RandomHex(32),
		NetNSPath:   filepath.Join(NetnsDir, NetnsPrefix()+"pod-"+fixtures.RandomHex(4)),
		IfName:      "eth0",
		attached:    map[string]attachment{},
	}
	// Removed after the DELs below: cleanups run last registered first.
	fixtures.NewNetns(tb, p.NetNSPath)
	tb.Cleanup(func() {
		p.mu.Lock()
		pending := make([]attachment, 0, len(p.attached))
		for _, a := range p.attached {
			pending = append(pending, a)
		}
		p.mu.Unlock()
		for _, a := range pending {
			ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
			if err := n.del(ctx, a.list, a.rt); err != nil {
				tb.Logf("cleanup: DEL pod %s/%s from %s: %v", namespace, name, a.list.Name, err)
			}
			cancel()
		}
	})
	return p
}

// CNIArgs are the CNI_ARGS kubelet passes for this pod.
func (p *Pod) CNIArgs() [][2]string {
	return [][2]string{
		{"IgnoreUnknown", "1"},
		{"K8S_POD_NAMESPACE", p.Namespace},
		{"K8S_POD_NAME", p.Name},
		{"K8S_POD_INFRA_CONTAINER_ID", p.ContainerID},
		{"K8S_POD_UID", p.UID},
	}
}

// Attachment is the pod's (container id, ifname) pair as GC's valid-attachments
// list names it.
func (p *Pod) Attachment() types.GCAttachment {
	return types.GCAttachment{ContainerID: p.ContainerID, IfName: p.IfName}
}

// RuntimeOption changes the runtime config of one CNI call, e.g. to send bad input.
type RuntimeOption func(*libcni.RuntimeConf)

// WithArgs replaces the pod's CNI_ARGS (nil sends none).
func WithArgs(args [][2]string) RuntimeOption {
	return func(rt *libcni.RuntimeConf) { rt.Args = args }
}

// WithNetNS replaces the netns path sent to the plugins.
func WithNetNS(path string) RuntimeOption {
	return func(rt *libcni.RuntimeConf) { rt.NetNS = path }
}

// WithCapabilityArgs sets runtimeConfig capability arguments (e.g. "portMappings").
func WithCapabilityArgs(args map[string]any) RuntimeOption {
	return func(rt *libcni.RuntimeConf) { rt.CapabilityArgs = args }
}

// RuntimeConf is what a runtime passes to libcni for this pod.
func (n *Node) RuntimeConf(pod *Pod, opts ...RuntimeOption) *libcni.RuntimeConf {
	rt := &libcni.RuntimeConf{
		ContainerID: pod.ContainerID,
		NetNS:       pod.NetNSPath,
		IfName:      pod.IfName,
		Args:        pod.CNIArgs(),
	}
	for _, opt := range opts {
		opt(rt)
	}
	return rt
}

// Add runs CNI ADD of list for pod, as a runtime does, with the plugins running in the
// node netns (the bridge plugin makes its bridge in the namespace it runs in). The
// pod is DELeted from list in cleanup even if ADD fails, as a runtime would.
func (n *Node) Add(ctx context.Context, pod *Pod, list *libcni.NetworkConfigList, opts ...RuntimeOption) (types.Result, error) {
	rt := n.RuntimeConf(pod, opts...)
	pod.mu.Lock()
	pod.attached[list.Name] = attachment{list: list, rt: rt}
	pod.mu.Unlock()

	var res types.Result
	err := netns.Do(n.NetNSPath, func() error {
		var err error
		res, err = n.CNI.AddNetworkList(ctx, list, rt)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("CNI ADD %s for pod %s/%s: %w", list.Name, pod.Namespace, pod.Name, err)
	}
	// Kept in the current result format for Addrs; a result that cannot be
	// converted is the plugins' business and shows up as a pod without addresses.
	r100, err := types100.GetResult(res)
	if err != nil {
		r100 = nil
	}
	pod.mu.Lock()
	pod.result = r100
	pod.mu.Unlock()
	return res, nil
}

// Del runs CNI DEL of list for pod.
func (n *Node) Del(ctx context.Context, pod *Pod, list *libcni.NetworkConfigList, opts ...RuntimeOption) error {
	if err := n.del(ctx, list, n.RuntimeConf(pod, opts...)); err != nil {
		return fmt.Errorf("CNI DEL %s for pod %s/%s: %w", list.Name, pod.Namespace, pod.Name, err)
	}
	pod.mu.Lock()
	delete(pod.attached, list.Name)
	pod.result = nil
	pod.mu.Unlock()
	return nil
}

func (n *Node) del(ctx context.Context, list *libcni.NetworkConfigList, rt *libcni.RuntimeConf) error {
	return netns.Do(n.NetNSPath, func() error {
		return n.CNI.DelNetworkList(ctx, list, rt)
	})
}

// Check runs CNI CHECK of list for pod (libcni supplies the cached ADD result).
func (n *Node) Check(ctx context.Context, pod *Pod, list *libcni.NetworkConfigList, opts ...RuntimeOption) error {
	rt := n.RuntimeConf(pod, opts...)
	err := netns.Do(n.NetNSPath, func() error {
		return n.CNI.CheckNetworkList(ctx, list, rt)
	})
	if err != nil {
		return fmt.Errorf("CNI CHECK %s for pod %s/%s: %w", list.Name, pod.Namespace, pod.Name, err)
	}
	return nil
}

// GC runs CNI GC of list through libcni: attachments cached on this node that are not
// in valid are DELeted, then every plugin gets GC with the valid list.
func (n *Node) GC(ctx context.Context, list *libcni.NetworkConfigList, valid []types.GCAttachment) error {
	err := netns.Do(n.NetNSPath, func() error {
		return n.CNI.GCNetworkList(ctx, list, &libcni.GCArgs{ValidAttachments: valid})
	})
	if err != nil {
		return fmt.Errorf("CNI GC %s: %w", list.Name, err)
	}
	return nil
}

// Status runs CNI STATUS of list.
func (n *Node) Status(ctx context.Context, list *libcni.NetworkConfigList) error {
	err := netns.Do(n.NetNSPath, func() error {
		return n.CNI.GetStatusNetworkList(ctx, list)
	})
	if err != nil {
		return fmt.Errorf("CNI STATUS %s: %w", list.Name, err)
	}
	return nil
}

// Result is the result of the pod's last successful ADD through the harness, nil if
// none (or after DEL).
func (p *Pod) Result() *types100.Result {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.result
}

// Addrs are the pod's addresses from its last successful ADD.
func (p *Pod) Addrs() []netip.Addr {
	return ResultAddrs(p.Result())
}

// IPv4 returns the pod's IPv4 address, failing the test if it has none.
func (p *Pod) IPv4(tb testing.TB) netip.Addr {
	tb.Helper()
	return p.addrOf(tb, netip.Addr.Is4, "IPv4")
}

// IPv6 returns the pod's IPv6 address, failing the test if it has none.
func (p *Pod) IPv6(tb testing.TB) netip.Addr {
	tb.Helper()
	return p.addrOf(tb, netip.Addr.Is6, "IPv6")
}

func (p *Pod) addrOf(tb testing.TB, match func(netip.Addr) bool, family string) netip.Addr {
	tb.Helper()
	for _, a := range p.Addrs() {
		if match(a) {
			return a
		}
	}
	tb.Fatalf("pod %s/%s has no %s address (addresses %v)", p.Namespace, p.Name, family, p.Addrs())
	return netip.Addr{}
}

// ResultAddrs returns the addresses in a CNI result (nil-safe).
func ResultAddrs(r *types100.Result) []netip.Addr {
	if r == nil {
		return nil
	}
	var out []netip.Addr
	for _, ip := range r.IPs {
		if a, ok := netip.AddrFromSlice(ip.Address.IP); ok {
			out = append(out, a.Unmap())
		}
	}
	return out
}

// Do runs fn with the calling thread inside the pod's netns (see netns.Do).
func (p *Pod) Do(fn func() error) error {
	return netns.Do(p.NetNSPath, fn)
}

// Exec runs a command inside the pod's netns and returns its combined output.
func (p *Pod) Exec(ctx context.Context, name string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	// The child inherits the namespace of the thread that starts it.
	if err := p.Do(cmd.Start); err != nil {
		return nil, fmt.Errorf("start %s in pod %s/%s: %w", name, p.Namespace, p.Name, err)
	}
	if err := cmd.Wait(); err != nil {
		return out.Bytes(), fmt.Errorf("%s in pod %s/%s: %w\n%s", name, p.Namespace, p.Name, err, out.Bytes())
	}
	return out.Bytes(), nil
}

// Start starts a process inside the pod's netns (opts.NetNSPath is set to the pod's).
func (p *Pod) Start(tb testing.TB, opts ProcessOptions) *Process {
	tb.Helper()
	opts.NetNSPath = p.NetNSPath
	return StartProcess(tb, opts)
}

// Listen opens a listener inside the pod's netns, closed in cleanup.
func (p *Pod) Listen(tb testing.TB, network, address string) net.Listener {
	tb.Helper()
	return p.Netns().Listen(tb, network, address)
}

// Dial connects from inside the pod's netns. The connection may be used from any
// goroutine afterwards.
func (p *Pod) Dial(ctx context.Context, network, address string) (net.Conn, error) {
	return p.Netns().Dial(ctx, nil, network, address)
}

// ServeEcho runs an echo server in the pod on the wildcard address (IPv4 and
// IPv6) at port until tb's cleanup (fixtures.ServeEcho).
func (p *Pod) ServeEcho(tb testing.TB, port int) *fixtures.EchoServer {
	tb.Helper()
	return fixtures.ServeEcho(tb, p.Listen(tb, "tcp", fmt.Sprintf(":%d", port)))
}

// roundTripLimit bounds one EchoRoundTrip: a round trip is a connect and a few
// kilobytes each way, so one that takes longer has lost its way.
const roundTripLimit = 5 * time.Second

// EchoRoundTrip connects from inside the pod to addr, an echo server, and
// checks that payload comes back (fixtures.EchoRoundTrip), within five
// seconds.
func (p *Pod) EchoRoundTrip(ctx context.Context, addr netip.AddrPort, payload []byte) error {
	ctx, cancel := context.WithTimeout(ctx, roundTripLimit)
	defer cancel()
	c, err := p.Dial(ctx, "tcp", addr.String())
	if err != nil {
		return err
	}
	if err := fixtures.EchoRoundTrip(ctx, c, payload); err != nil {
		return fmt.Errorf("pod %s to %s: %w", p.Name, addr, err)
	}
	return nil
}

// refproxyReady bounds how long StartRefproxy waits for the proxy's "ready".
const refproxyReady = 30 * time.Second

// StartRefproxy runs the reference proxy (test/cmd/refproxy) inside the pod,
// the way a sidecar runs, with args added to its flags, and waits until it is
// ready. It records each connection it proxies in the returned file (read it
// with test/proxy's ReadRecords).
func (p *Pod) StartRefproxy(ctx context.Context, tb testing.TB, args ...string) (proc *Process, records string) {
	tb.Helper()
	records = filepath.Join(tb.TempDir(), p.Name+"-records.jsonl")
	proc = p.Start(tb, ProcessOptions{
		Path: Bins(tb).Path("refproxy"),
		Args: append([]string{"-record", records}, args...),
		Name: "refproxy-" + p.Name,
	})
	ctx, cancel := context.WithTimeout(ctx, refproxyReady)
	defer cancel()
	if _, err := proc.WaitForLine(ctx, "ready"); err != nil {
		tb.Fatalf("proxy in %s: %v", p.Name, err)
	}
	return proc, records
}

// Netns is the pod's namespace, for what fixtures.Netns does there (Dial
// with a dialer of the test's own, for one).
func (p *Pod) Netns() *fixtures.Netns { return &fixtures.Netns{Path: p.NetNSPath} }
