// Package kniruntime is a small KNI network runtime for tests: it serves the
// KNI service (proto package "kni") on a Unix socket and implements attach and
// detach the way the KNI proof of concept does for backwards compatibility, by
// running a CNI conflist through libcni (ADD on attach, DEL on detach) in the
// pod network namespace named by isolation.path (or extradata["netns"]).
// StartFromConfDir runs, like libkni, the node's own CNI configuration: the
// conflist the node's CNI directory holds at the time of each call, picked
// as kubelet's runtimes pick it, so a chain entry an installer put there runs
// under the runtime too.
//
// It records every call it gets (method, metadata, deadline) and can be told to
// fail a method with a given error, so tests can check what an interposer in
// front of it forwards and passes back.
package kniruntime

import (
	"context"
	"errors"
	"fmt"
	"net"
	"path"
	"slices"
	"sync"
	"time"

	"github.com/containernetworking/cni/libcni"
	types100 "github.com/containernetworking/cni/pkg/types/100"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/mesh-cni/mesh-cni/internal/kni/knipb"
	"github.com/mesh-cni/mesh-cni/internal/netns"
)

// HeaderRuntime is a response header the runtime sets on every call, with the
// value "kniruntime", so tests can check that headers come back through an
// interposer.
const HeaderRuntime = "x-kni-runtime"

// Config configures a Runtime.
type Config struct {
	// CNI runs the plugins; Network is the conflist it runs, unless Load is
	// set: then each call runs the conflist Load returns at that moment.
	CNI     *libcni.CNIConfig
	Network *libcni.NetworkConfigList
	Load    func() (*libcni.NetworkConfigList, error)
	// PluginNetns is the network namespace the plugins run in (a test node's);
	// empty means the caller's.
	PluginNetns string
	// IfName is the pod interface; default "eth0".
	IfName string
	Log    *zap.Logger
}

// Call is one call the runtime received.
type Call struct {
	Method   string // e.g. "AttachInterface"
	Metadata metadata.MD
	Deadline time.Time // zero without one
	Done     bool      // the handler has returned
	Err      error     // what it returned
}

// Runtime is the test network runtime.
type Runtime struct {
	knipb.UnimplementedKNIServer

	cfg Config

	mu       sync.Mutex
	pods     map[string]*pod // by sandbox id
	failures map[string]error
	calls    []Call
	called   chan struct{} // closed and replaced on every call
}

type pod struct {
	rt        *libcni.RuntimeConf
	list      *libcni.NetworkConfigList
	ipconfigs map[string]*knipb.IPConfig
}

// network is the conflist a call runs.
func (r *Runtime) network() (*libcni.NetworkConfigList, error) {
	if r.cfg.Load == nil {
		return r.cfg.Network, nil
	}
	list, err := r.cfg.Load()
	if err != nil {
		return nil, status.Errorf(codes.Unavailable, "kniruntime: no CNI network configuration: %v", err)
	}
	return list, nil
}

// Networks are the names of the conflists the attaches of the sandboxes
// still attached ran, by sandbox id.
func (r *Runtime) Networks() map[string]string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[string]string{}
	for id, p := range r.pods {
		out[id] = p.list.Name
	}
	return out
}

// New returns a runtime; serve it with Serve.
func New(cfg Config) *Runtime {
	if cfg.IfName == "" {
		cfg.IfName = "eth0"
	}
	if cfg.Log == nil {
		cfg.Log = zap.NewNop()
	}
	return &Runtime{cfg: cfg, pods: map[string]*pod{}, failures: map[string]error{}, called: make(chan struct{})}
}

// Fail makes every call of method (e.g. "AttachInterface") return err, before
// the runtime does anything, until Fail(method, nil).
func (r *Runtime) Fail(method string, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err == nil {
		delete(r.failures, method)
		return
	}
	r.failures[method] = err
}

// Calls returns the calls received so far, oldest first.
func (r *Runtime) Calls() []Call {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.calls)
}

// CallsOf returns the calls of one method.
func (r *Runtime) CallsOf(method string) []Call {
	var out []Call
	for _, c := range r.Calls() {
		if c.Method == method {
			out = append(out, c)
		}
	}
	return out
}

// WaitForCalls waits until the runtime has received n calls of method, or ctx
// ends. A call counts once its handler has returned.
func (r *Runtime) WaitForCalls(ctx context.Context, method string, n int) error {
	for {
		r.mu.Lock()
		got := 0
		for _, c := range r.calls {
			if c.Method == method && c.Done {
				got++
			}
		}
		called := r.called
		r.mu.Unlock()
		if got >= n {
			return nil
		}
		select {
		case <-called:
		case <-ctx.Done():
			return fmt.Errorf("waiting for %d %s calls (got %d): %w", n, method, got, ctx.Err())
		}
	}
}

// Attached lists the sandbox ids currently attached.
func (r *Runtime) Attached() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	ids := make([]string, 0, len(r.pods))
	for id := range r.pods {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids
}

// intercept records the call, sets the response header and applies failures.
func (r *Runtime) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	method := path.Base(info.FullMethod)
	md, _ := metadata.FromIncomingContext(ctx)
	deadline, _ := ctx.Deadline()
	r.mu.Lock()
	idx := len(r.calls)
	r.calls = append(r.calls, Call{Method: method, Metadata: md.Copy(), Deadline: deadline})
	failure := r.failures[method]
	r.mu.Unlock()
	resp, err := func() (any, error) {
		if err := grpc.SetHeader(ctx, metadata.Pairs(HeaderRuntime, "kniruntime")); err != nil {
			return nil, err
		}
		if failure != nil {
			return nil, failure
		}
		return handler(ctx, req)
	}()
	r.mu.Lock()
	r.calls[idx].Done, r.calls[idx].Err = true, err
	close(r.called)
	r.called = make(chan struct{})
	r.mu.Unlock()
	return resp, err
}

// Serve serves the runtime (and grpc.health.v1, SERVING) on l until ctx ends or
// the returned stop function is called; stop waits for Serve to return.
func (r *Runtime) Serve(l net.Listener) (stop func()) {
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(r.intercept))
	knipb.RegisterKNIServer(srv, r)
	hs := health.NewServer()
	healthpb.RegisterHealthServer(srv, hs)
	return r.serve(srv, l)
}

// serve runs srv on l until the returned stop is called.
func (r *Runtime) serve(srv *grpc.Server, l net.Listener) (stop func()) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(l); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
			r.cfg.Log.Error("kniruntime serve", zap.Error(err))
		}
	}()
	return func() {
		srv.Stop()
		<-done
	}
}

func (r *Runtime) AttachInterface(ctx context.Context, req *knipb.AttachInterfaceRequest) (*knipb.AttachInterfaceResponse, error) {
	return r.attach(ctx, req)
}

func (r *Runtime) AttachNetwork(ctx context.Context, req *knipb.AttachInterfaceRequest) (*knipb.AttachInterfaceResponse, error) {
	return r.attach(ctx, req)
}

func (r *Runtime) DetachInterface(ctx context.Context, req *knipb.DetachInterfaceRequest) (*knipb.DetachInterfaceResponse, error) {
	return r.detach(ctx, req)
}

func (r *Runtime) DetachNetwork(ctx context.Context, req *knipb.DetachInterfaceRequest) (*knipb.DetachInterfaceResponse, error) {
	return r.detach(ctx, req)
}

func (r *Runtime) QueryPodNetwork(_ context.Context, req *knipb.QueryPodNetworkRequest) (*knipb.QueryPodNetworkResponse, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	p, ok := r.pods[req.GetId()]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "sandbox %q is not attached", req.GetId())
	}
	return &knipb.QueryPodNetworkResponse{Ipconfigs: p.ipconfigs}, nil
}

func (r *Runtime) SetupNodeNetwork(context.Context, *knipb.SetupNodeNetworkRequest) (*knipb.SetupNodeNetworkResponse, error) {
	return &knipb.SetupNodeNetworkResponse{}, nil
}

func (r *Runtime) QueryNodeNetworks(context.Context, *knipb.QueryNodeNetworksRequest) (*knipb.QueryNodeNetworksResponse, error) {
	list, err := r.network()
	if err != nil {
		return nil, err
	}
	return &knipb.QueryNodeNetworksResponse{Networks: []*knipb.Network{{Name: list.Name, Ready: true}}}, nil
}

func netnsOf(iso *knipb.Isolation, extradata map[string]string) string {
	if p := iso.GetPath(); p != "" {
		return p
	}
	return extradata["netns"]
}

func (r *Runtime) runtimeConf(id, namespace, name, netnsPath string, labels map[string]string) *libcni.RuntimeConf {
	args := [][2]string{
		{"IgnoreUnknown", "1"},
		{"K8S_POD_NAMESPACE", namespace},
		{"K8S_POD_NAME", name},
		{"K8S_POD_INFRA_CONTAINER_ID", id},
	}
	if uid := labels["io.kubernetes.pod.uid"]; uid != "" {
		args = append(args, [2]string{"K8S_POD_UID", uid})
	}
	return &libcni.RuntimeConf{ContainerID: id, NetNS: netnsPath, IfName: r.cfg.IfName, Args: args}
}

// inPluginNetns runs fn where the plugins must run (the bridge plugin makes its
// bridge and host-side veths in the namespace it runs in).
func (r *Runtime) inPluginNetns(fn func() error) error {
	if r.cfg.PluginNetns == "" {
		return fn()
	}
	return netns.Do(r.cfg.PluginNetns, fn)
}

func (r *Runtime) attach(ctx context.Context, req *knipb.AttachInterfaceRequest) (*knipb.AttachInterfaceResponse, error) {
	netnsPath := netnsOf(req.GetIsolation(), req.GetExtradata())
	if req.GetId() == "" || netnsPath == "" {
		return nil, status.Error(codes.InvalidArgument, "kniruntime: attach needs an id and a netns (isolation.path or extradata[netns])")
	}
	rt := r.runtimeConf(req.GetId(), req.GetNamespace(), req.GetName(), netnsPath, req.GetLabels())
	list, err := r.network()
	if err != nil {
		return nil, err
	}
	var res *types100.Result
	err = r.inPluginNetns(func() error {
		out, err := r.cfg.CNI.AddNetworkList(ctx, list, rt)
		if err != nil {
			return err
		}
		res, err = types100.GetResult(out)
		return err
	})
	if err != nil {
		return nil, status.Errorf(codes.Internal, "kniruntime: CNI ADD %s for sandbox %s: %v", list.Name, req.GetId(), err)
	}
	ipconfigs := r.ipconfigs(res)
	r.mu.Lock()
	r.pods[req.GetId()] = &pod{rt: rt, list: list, ipconfigs: ipconfigs}
	r.mu.Unlock()
	r.cfg.Log.Info("attached", zap.String("sandbox", req.GetId()), zap.String("netns", netnsPath))
	return &knipb.AttachInterfaceResponse{Ipconfigs: ipconfigs}, nil
}

// ipconfigs reports the result's addresses per pod interface, as bare IPs (what
// kubelet takes as pod IPs), with the interface's MAC.
func (r *Runtime) ipconfigs(res *types100.Result) map[string]*knipb.IPConfig {
	out := map[string]*knipb.IPConfig{}
	for _, ip := range res.IPs {
		name, mac := r.cfg.IfName, ""
		if ip.Interface != nil && *ip.Interface >= 0 && *ip.Interface < len(res.Interfaces) {
			iface := res.Interfaces[*ip.Interface]
			name, mac = iface.Name, iface.Mac
		}
		cfg, ok := out[name]
		if !ok {
			cfg = &knipb.IPConfig{Mac: mac}
			out[name] = cfg
		}
		cfg.Ip = append(cfg.Ip, ip.Address.IP.String())
	}
	return out
}

func (r *Runtime) detach(ctx context.Context, req *knipb.DetachInterfaceRequest) (*knipb.DetachInterfaceResponse, error) {
	rt := r.runtimeConf(req.GetId(), req.GetNamespace(), req.GetName(), netnsOf(req.GetIsolation(), req.GetExtradata()), req.GetLabels())
	list, err := r.network()
	if err != nil {
		return nil, err
	}
	if err := r.inPluginNetns(func() error { return r.cfg.CNI.DelNetworkList(ctx, list, rt) }); err != nil {
		return nil, status.Errorf(codes.Internal, "kniruntime: CNI DEL %s for sandbox %s: %v", list.Name, req.GetId(), err)
	}
	r.mu.Lock()
	delete(r.pods, req.GetId())
	r.mu.Unlock()
	r.cfg.Log.Info("detached", zap.String("sandbox", req.GetId()))
	return &knipb.DetachInterfaceResponse{}, nil
}

// DetachAll runs DEL for every sandbox still attached, as a runtime cleaning
// up would; it returns the errors joined.
func (r *Runtime) DetachAll(ctx context.Context) error {
	r.mu.Lock()
	pods := make([]*pod, 0, len(r.pods))
	for _, p := range r.pods {
		pods = append(pods, p)
	}
	r.mu.Unlock()
	var errs []error
	for _, p := range pods {
		if err := r.inPluginNetns(func() error { return r.cfg.CNI.DelNetworkList(ctx, p.list, p.rt) }); err != nil {
			errs = append(errs, fmt.Errorf("CNI DEL sandbox %s: %w", p.rt.ContainerID, err))
			continue
		}
		r.mu.Lock()
		delete(r.pods, p.rt.ContainerID)
		r.mu.Unlock()
	}
	return errors.Join(errs...)
}
