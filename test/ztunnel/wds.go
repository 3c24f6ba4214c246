package ztunnel

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/mesh-cni/mesh-cni/test/pbwire"
)

// WDS as ztunnel subscribes to it (src/xds/client.rs, src/xds.rs,
// src/state/workload.rs): one delta ADS stream to istiod, a wildcard
// subscription to istio.workload.Address (no names subscribed: every address
// istiod has), each response acked with its nonce, the node identified as
// ztunnel~<ip>~<pod>.<ns>~<ns>.svc.cluster.local with NODE_NAME in its
// metadata. The double speaks it on istiod's plaintext xDS port, which istiod
// serves without authentication; ztunnel uses the mTLS one. Messages are
// encoded and decoded by field number (envoy's discovery.proto, istio's
// workload.proto), as the ZDS side is.

const (
	addressType  = "type.googleapis.com/istio.workload.Address"
	deltaADS     = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources"
	defaultTrust = "cluster.local"
	// LocalWorkloadWait is how long ztunnel waits for the workload of one of
	// its pods to arrive over WDS before it refuses a connection
	// (proxy.rs get_workload: wait_for_workload(.., 5s)).
	LocalWorkloadWait = 5 * time.Second
)

// Field numbers.
const (
	ddrqNode         = 1 // DeltaDiscoveryRequest
	ddrqTypeURL      = 2
	ddrqNonce        = 6
	nodeID           = 1 // config.core.v3.Node
	nodeMetadata     = 3
	ddrsResources    = 2 // DeltaDiscoveryResponse
	ddrsTypeURL      = 4
	ddrsNonce        = 5
	ddrsRemoved      = 6
	resName          = 3 // discovery.v3.Resource
	resResource      = 2
	anyValue         = 2 // google.protobuf.Any
	addressWorkload  = 1 // istio.workload.Address oneof
	wlName           = 1 // istio.workload.Workload
	wlNamespace      = 2
	wlAddresses      = 3
	wlTunnelProtocol = 5
	wlTrustDomain    = 6
	wlServiceAccount = 7
	wlNode           = 9
	wlUID            = 20
	tunnelHBONE      = 1 // TunnelProtocol.HBONE
)

// WDS is istiod's workloads as a ztunnel holds them.
type WDS struct {
	mu sync.Mutex
	// byName is every workload istiod sent, by resource name (its uid).
	byName map[string]Workload
	// changed is closed and replaced on every update (ztunnel's
	// insert_notifier).
	changed chan struct{}
}

// WatchWDS subscribes to istiod's WDS at addr (host:port of its plaintext
// xDS listener) as the ztunnel of node, reconnecting until ctx ends.
func WatchWDS(ctx context.Context, log *zap.Logger, addr, node string) (*WDS, error) {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("istiod xds %s: %w", addr, err)
	}
	w := &WDS{byName: map[string]Workload{}, changed: make(chan struct{})}
	go func() {
		defer conn.Close()
		backoff := 10 * time.Millisecond
		for ctx.Err() == nil {
			err := w.stream(ctx, conn, node)
			if ctx.Err() != nil {
				return
			}
			log.Info("istiod xds stream ended, reconnecting", zap.Duration("in", backoff), zap.Error(err))
			select {
			case <-ctx.Done():
				return
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, 15*time.Second)
		}
	}()
	return w, nil
}

// wire carries a message this package encodes and decodes itself through
// grpc's proto codec: an empty message keeps every field it is given as an
// unknown field, byte for byte, both ways.
func wire(b []byte) *emptypb.Empty {
	m := &emptypb.Empty{}
	m.ProtoReflect().SetUnknown(b)
	return m
}

func (w *WDS) stream(ctx context.Context, conn *grpc.ClientConn, node string) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	s, err := conn.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true, ClientStreams: true}, deltaADS)
	if err != nil {
		return err
	}
	first, err := initialRequest(node)
	if err != nil {
		return err
	}
	if err := s.SendMsg(wire(first)); err != nil {
		return err
	}
	// Without initial_resource_versions istiod sends everything again: what
	// was known before is replaced, not merged (removals while away).
	fresh := true
	for {
		m := &emptypb.Empty{}
		if err := s.RecvMsg(m); err != nil {
			return err
		}
		typeURL, nonce, err := w.apply(m.ProtoReflect().GetUnknown(), fresh)
		if err != nil {
			return err
		}
		fresh = false
		ack := pbwire.AppendBytes(pbwire.AppendBytes(nil, ddrqTypeURL, []byte(typeURL)), ddrqNonce, []byte(nonce))
		if err := s.SendMsg(wire(ack)); err != nil {
			return err
		}
	}
}

// initialRequest is ztunnel's first DeltaDiscoveryRequest for addresses: its
// node and the type, nothing subscribed by name (wildcard).
func initialRequest(node string) ([]byte, error) {
	const ip, pod, ns = "127.0.0.1", "ztunnel-double", "istio-system"
	meta, err := structpb.NewStruct(map[string]any{"NAME": pod, "NAMESPACE": ns, "INSTANCE_IPS": ip, "NODE_NAME": node})
	if err != nil {
		return nil, err
	}
	metaBytes, err := proto.Marshal(meta)
	if err != nil {
		return nil, err
	}
	n := pbwire.AppendBytes(nil, nodeID, fmt.Appendf(nil, "ztunnel~%s~%s.%s~%s.svc.cluster.local", ip, pod, ns, ns))
	n = pbwire.AppendBytes(n, nodeMetadata, metaBytes)
	b := pbwire.AppendBytes(nil, ddrqNode, n)
	return pbwire.AppendBytes(b, ddrqTypeURL, []byte(addressType)), nil
}

// apply takes one DeltaDiscoveryResponse into the store and returns its type
// and nonce for the ack.
func (w *WDS) apply(b []byte, fresh bool) (typeURL, nonce string, err error) {
	added := map[string]Workload{}
	others := map[string]bool{} // addresses that are services
	var removed []string
	err = pbwire.Walk(b, func(num protowire.Number, _ protowire.Type, v []byte, _ uint64) error {
		switch num {
		case ddrsTypeURL:
			typeURL = string(v)
		case ddrsNonce:
			nonce = string(v)
		case ddrsRemoved:
			removed = append(removed, string(v))
		case ddrsResources:
			name, wl, ok, err := decodeResource(v)
			if err != nil {
				return err
			}
			if ok {
				added[name] = wl
			} else {
				others[name] = true
			}
		}
		return nil
	})
	if err != nil {
		return "", "", fmt.Errorf("decode DeltaDiscoveryResponse: %w", err)
	}
	if typeURL != addressType {
		return typeURL, nonce, nil
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if fresh {
		w.byName = map[string]Workload{}
	}
	for _, name := range removed {
		delete(w.byName, name)
	}
	for name := range others {
		delete(w.byName, name)
	}
	for name, wl := range added {
		w.byName[name] = wl
	}
	close(w.changed)
	w.changed = make(chan struct{})
	return typeURL, nonce, nil
}

// decodeResource returns a Resource's name and, when it holds an Address
// that is a workload, the workload.
func decodeResource(b []byte) (string, Workload, bool, error) {
	name, err := pbwire.Bytes(b, resName)
	if err != nil {
		return "", Workload{}, false, err
	}
	// Resource.resource is an Any, its value an Address, whose workload
	// member is set for a workload.
	v := b
	for _, num := range []protowire.Number{resResource, anyValue, addressWorkload} {
		if v, err = pbwire.Bytes(v, num); err != nil {
			return "", Workload{}, false, err
		}
	}
	if v == nil {
		return string(name), Workload{}, false, nil
	}
	wl, err := decodeWorkload(v)
	return string(name), wl, err == nil, err
}

// decodeWorkload reads the fields of istio.workload.Workload the double
// uses, with ztunnel's defaults: an empty trust domain is cluster.local, an
// empty service account "default".
func decodeWorkload(b []byte) (Workload, error) {
	var wl Workload
	err := pbwire.Walk(b, func(num protowire.Number, _ protowire.Type, v []byte, x uint64) error {
		switch num {
		case wlUID:
			wl.UID = string(v)
		case wlName:
			wl.Name = string(v)
		case wlNamespace:
			wl.Namespace = string(v)
		case wlServiceAccount:
			wl.ServiceAccount = string(v)
		case wlTrustDomain:
			wl.TrustDomain = string(v)
		case wlNode:
			wl.Node = string(v)
		case wlTunnelProtocol:
			wl.HBONE = x == tunnelHBONE
		case wlAddresses:
			if a, ok := netip.AddrFromSlice(v); ok {
				wl.Addresses = append(wl.Addresses, a.Unmap())
			}
		}
		return nil
	})
	if wl.TrustDomain == "" {
		wl.TrustDomain = defaultTrust
	}
	if wl.ServiceAccount == "" {
		wl.ServiceAccount = "default"
	}
	return wl, err
}

// Lookup implements Directory: the workload holding the address, as
// ztunnel's by_addr finds a destination.
func (w *WDS) Lookup(a netip.Addr) (Workload, bool) {
	a = a.Unmap()
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, wl := range w.byName {
		for _, have := range wl.Addresses {
			if have == a {
				return wl, true
			}
		}
	}
	return Workload{}, false
}

// ErrUnknownWorkload is what a pod's proxy gets when istiod has no workload on
// its node with the name, namespace and service account ZDS gave it.
var ErrUnknownWorkload = errors.New("unknown source workload")

// Local implements Directory: it waits, until ctx ends, for a workload of node
// whose name, namespace and service account are info's (state.rs
// wait_for_workload, find_by_info, WorkloadInfo::matches). The pod's uid in
// ZDS plays no part: WDS names workloads by istiod's own uid.
func (w *WDS) Local(ctx context.Context, node string, info WorkloadInfo) (Workload, error) {
	for {
		w.mu.Lock()
		changed := w.changed
		for _, wl := range w.byName {
			if wl.Node == node && wl.Name == info.Name && wl.Namespace == info.Namespace && wl.ServiceAccount == info.ServiceAccount {
				w.mu.Unlock()
				return wl, nil
			}
		}
		w.mu.Unlock()
		select {
		case <-ctx.Done():
			return Workload{}, fmt.Errorf("%w %s.%s (%s) on node %s", ErrUnknownWorkload, info.ServiceAccount, info.Namespace, info.Name, node)
		case <-changed:
		}
	}
}
