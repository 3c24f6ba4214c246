package containerdhook

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	types100 "github.com/containernetworking/cni/pkg/types/100"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// Primary is a primary network plugin for the runtime's chain: a
// PodNetworkLifecycle server on a Unix socket that runs a CNI conflist (the
// node's real bridge) in the sandbox's network namespace, as a primary that
// kept CNI plugins underneath would. It answers with the CNI result's
// interfaces, addresses, routes and DNS. No primary gRPC plugin is published
// for the fork; this one exists so the chain the runtime builds has a real
// network in front of the hook.
type Primary struct {
	// Socket is the server's Unix socket, Name its registration name.
	Socket, Name string

	node *harness.Node
	list *libcni.NetworkConfigList

	mu      sync.Mutex
	results map[string]*Result
	rts     map[string]*libcni.RuntimeConf
}

// StartPrimary serves a primary for node's list and registers it in
// pluginDir as primary (priority 10). In cleanup the server stops, every
// sandbox still set up is torn down (CNI DEL) and the registration removed.
func StartPrimary(tb testing.TB, node *harness.Node, list *libcni.NetworkConfigList, pluginDir string) *Primary {
	tb.Helper()
	dir, err := os.MkdirTemp("", "primary-")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { os.RemoveAll(dir) })
	p := &Primary{
		Socket: filepath.Join(dir, "primary.sock"), Name: "primary-" + list.Name,
		node: node, list: list, results: map[string]*Result{}, rts: map[string]*libcni.RuntimeConf{},
	}
	l, err := net.Listen("unix", p.Socket)
	if err != nil {
		tb.Fatal(err)
	}
	srv := grpc.NewServer(grpc.ForceServerCodec(rawCodec{}))
	srv.RegisterService(&primaryService, p)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(l)
	}()
	reg := filepath.Join(pluginDir, "10-"+p.Name+".json")
	if err := os.MkdirAll(pluginDir, 0o755); err != nil {
		tb.Fatal(err)
	}
	data := fmt.Sprintf(`{"name": %q, "address": %q, "primary": true, "priority": 10}`, p.Name, p.Socket)
	if err := writeRename(reg, []byte(data)); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		os.Remove(reg)
		srv.Stop()
		<-done
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := p.teardownAll(ctx); err != nil {
			tb.Errorf("primary cleanup: %v", err)
		}
	})
	return p
}

// writeRename writes data to path through a temporary name without the .json
// suffix, as a plugin registering itself should.
func writeRename(path string, data []byte) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// Result is what the primary answered for the sandbox, nil if it is not set
// up.
func (p *Primary) Result(sandboxID string) *Result {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.results[sandboxID]
}

// SetUp lists the sandboxes the primary has set up and not torn down.
func (p *Primary) SetUp() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var ids []string
	for id := range p.results {
		ids = append(ids, id)
	}
	return ids
}

func (p *Primary) runtimeConf(pod Pod) *libcni.RuntimeConf {
	return &libcni.RuntimeConf{ContainerID: pod.SandboxID, NetNS: pod.NetnsPath, IfName: "eth0", Args: [][2]string{
		{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", pod.Namespace}, {"K8S_POD_NAME", pod.Name},
		{"K8S_POD_INFRA_CONTAINER_ID", pod.SandboxID}, {"K8S_POD_UID", pod.UID},
	}}
}

func (p *Primary) setup(ctx context.Context, pod Pod) (*Result, error) {
	if pod.SandboxID == "" || pod.NetnsPath == "" {
		return nil, status.Error(codes.InvalidArgument, "primary: setup needs a sandbox id and a netns")
	}
	rt := p.runtimeConf(pod)
	var res *types100.Result
	err := netns.Do(p.node.NetNSPath, func() error {
		out, err := p.node.CNI.AddNetworkList(ctx, p.list, rt)
		if err != nil {
			return err
		}
		res, err = types100.GetResult(out)
		return err
	})
	if err != nil {
		return nil, status.Errorf(codes.Internal, "primary: CNI ADD %s for sandbox %s: %v", p.list.Name, pod.SandboxID, err)
	}
	r, err := FromCNI(res)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "primary: %v", err)
	}
	p.mu.Lock()
	p.results[pod.SandboxID], p.rts[pod.SandboxID] = r, rt
	p.mu.Unlock()
	return r, nil
}

func (p *Primary) teardown(ctx context.Context, pod Pod) error {
	rt := p.runtimeConf(pod)
	if err := netns.Do(p.node.NetNSPath, func() error { return p.node.CNI.DelNetworkList(ctx, p.list, rt) }); err != nil {
		return status.Errorf(codes.Internal, "primary: CNI DEL %s for sandbox %s: %v", p.list.Name, pod.SandboxID, err)
	}
	p.mu.Lock()
	delete(p.results, pod.SandboxID)
	delete(p.rts, pod.SandboxID)
	p.mu.Unlock()
	return nil
}

func (p *Primary) teardownAll(ctx context.Context) error {
	p.mu.Lock()
	rts := make([]*libcni.RuntimeConf, 0, len(p.rts))
	for _, rt := range p.rts {
		rts = append(rts, rt)
	}
	p.mu.Unlock()
	var errs []error
	for _, rt := range rts {
		if err := netns.Do(p.node.NetNSPath, func() error { return p.node.CNI.DelNetworkList(ctx, p.list, rt) }); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// primaryService is PodNetworkLifecycle with raw messages, decoded by field
// number like the rest of this package.
var primaryService = grpc.ServiceDesc{
	ServiceName: "containerd.services.networking.v1.PodNetworkLifecycle",
	HandlerType: (*any)(nil),
	Methods: []grpc.MethodDesc{
		rawMethod("SetupPodNetwork", func(ctx context.Context, p *Primary, req []byte) ([]byte, error) {
			pod, err := decodePod(req)
			if err != nil {
				return nil, status.Error(codes.InvalidArgument, err.Error())
			}
			r, err := p.setup(ctx, pod)
			if err != nil {
				return nil, err
			}
			return encodeResult(r), nil
		}),
		rawMethod("TeardownPodNetwork", func(ctx context.Context, p *Primary, req []byte) ([]byte, error) {
			pod, err := decodePod(req)
			if err != nil {
				return nil, status.Error(codes.InvalidArgument, err.Error())
			}
			return nil, p.teardown(ctx, pod)
		}),
		rawMethod("CheckHealth", func(context.Context, *Primary, []byte) ([]byte, error) {
			return encodeHealth(true, "primary ready"), nil
		}),
	},
}

func rawMethod(name string, call func(context.Context, *Primary, []byte) ([]byte, error)) grpc.MethodDesc {
	return grpc.MethodDesc{
		MethodName: name,
		Handler: func(srv any, ctx context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
			var in []byte
			if err := dec(&in); err != nil {
				return nil, err
			}
			out, err := call(ctx, srv.(*Primary), in)
			if err != nil {
				return nil, err
			}
			return &out, nil
		},
	}
}
