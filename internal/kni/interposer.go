package kni

import (
	"context"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mesh-cni/mesh-cni/internal/gaterpc"
	"github.com/mesh-cni/mesh-cni/internal/kni/knipb"
)

type (
	attachFunc = func(context.Context, *knipb.AttachInterfaceRequest, ...grpc.CallOption) (*knipb.AttachInterfaceResponse, error)
	detachFunc = func(context.Context, *knipb.DetachInterfaceRequest, ...grpc.CallOption) (*knipb.DetachInterfaceResponse, error)
)

// interposer implements the KNI service by forwarding to the network runtime,
// enrolling after attach and releasing before detach.
type interposer struct {
	knipb.UnimplementedKNIServer

	log      *zap.Logger
	cfg      Config
	upstream knipb.KNIClient
}

// The attach and detach pairs have two names for wire-identical calls: the
// kubelet fork calls AttachNetwork/DetachNetwork, the published reference
// runtime (libkni v0.3.0, on kni-api v0.0.8) serves only
// AttachInterface/DetachInterface, and older runtimes only the former. Each
// call goes to the runtime under the name the caller used and, if the runtime
// answers Unimplemented, once more under the other name, so the interposer
// joins any of them unchanged.

func (i *interposer) AttachInterface(ctx context.Context, req *knipb.AttachInterfaceRequest) (*knipb.AttachInterfaceResponse, error) {
	return i.attach(ctx, "AttachInterface", req,
		orOther(i.log, "AttachInterface", "AttachNetwork", i.upstream.AttachInterface, i.upstream.AttachNetwork),
		orOther(i.log, "DetachInterface", "DetachNetwork", i.upstream.DetachInterface, i.upstream.DetachNetwork))
}

// AttachNetwork is the older name of AttachInterface. A failed one is undone
// with DetachNetwork (or DetachInterface, for a runtime that knows only that).
func (i *interposer) AttachNetwork(ctx context.Context, req *knipb.AttachInterfaceRequest) (*knipb.AttachInterfaceResponse, error) {
	return i.attach(ctx, "AttachNetwork", req,
		orOther(i.log, "AttachNetwork", "AttachInterface", i.upstream.AttachNetwork, i.upstream.AttachInterface),
		orOther(i.log, "DetachNetwork", "DetachInterface", i.upstream.DetachNetwork, i.upstream.DetachInterface))
}

func (i *interposer) DetachInterface(ctx context.Context, req *knipb.DetachInterfaceRequest) (*knipb.DetachInterfaceResponse, error) {
	return i.detach(ctx, "DetachInterface", req,
		orOther(i.log, "DetachInterface", "DetachNetwork", i.upstream.DetachInterface, i.upstream.DetachNetwork))
}

func (i *interposer) DetachNetwork(ctx context.Context, req *knipb.DetachInterfaceRequest) (*knipb.DetachInterfaceResponse, error) {
	return i.detach(ctx, "DetachNetwork", req,
		orOther(i.log, "DetachNetwork", "DetachInterface", i.upstream.DetachNetwork, i.upstream.DetachInterface))
}

// orOther calls first and, when the runtime answers Unimplemented, other: the
// same request under the pair's other method name.
func orOther[Req, Resp any](log *zap.Logger, firstName, otherName string,
	first, other func(context.Context, Req, ...grpc.CallOption) (Resp, error)) func(context.Context, Req, ...grpc.CallOption) (Resp, error) {
	return func(ctx context.Context, req Req, opts ...grpc.CallOption) (Resp, error) {
		resp, err := first(ctx, req, opts...)
		if status.Code(err) != codes.Unimplemented {
			return resp, err
		}
		log.Debug("network runtime does not implement the method; calling it under its other name",
			zap.String("method", firstName), zap.String("as", otherName))
		return other(ctx, req, opts...)
	}
}

func (i *interposer) CreateNetwork(ctx context.Context, req *knipb.CreateNetworkRequest) (*knipb.CreateNetworkResponse, error) {
	return forward(ctx, i.upstream.CreateNetwork, req)
}

func (i *interposer) DeleteNetwork(ctx context.Context, req *knipb.DeleteNetworkRequest) (*knipb.DeleteNetworkResponse, error) {
	return forward(ctx, i.upstream.DeleteNetwork, req)
}

func (i *interposer) QueryPodNetwork(ctx context.Context, req *knipb.QueryPodNetworkRequest) (*knipb.QueryPodNetworkResponse, error) {
	return forward(ctx, i.upstream.QueryPodNetwork, req)
}

func (i *interposer) SetupNodeNetwork(ctx context.Context, req *knipb.SetupNodeNetworkRequest) (*knipb.SetupNodeNetworkResponse, error) {
	return forward(ctx, i.upstream.SetupNodeNetwork, req)
}

func (i *interposer) QueryNodeNetworks(ctx context.Context, req *knipb.QueryNodeNetworksRequest) (*knipb.QueryNodeNetworksResponse, error) {
	return forward(ctx, i.upstream.QueryNodeNetworks, req)
}

// attach forwards an attach and enrolls the pod once the runtime has set it up.
//
// Order and failure handling, thought through:
//   - A request that names no valid pod or sandbox could never be enrolled; it
//     is refused before the runtime does any work (InvalidArgument).
//   - The runtime's error is returned unchanged: nothing was set up by us.
//   - After the runtime's success, the response is held until gate Add
//     returns. Add waits for the agent's readiness; the wait is bounded by the
//     caller's deadline and EnrollTimeout.
//   - If the pod cannot be enrolled (no netns in the request, a runtime
//     response that cannot be understood, Add failing or timing out), the pod
//     must not start unmeshed (fail closed), and kubelet treats a failed attach
//     as a failed sandbox. So the attach is undone: gate Del for anything the
//     agent may hold, then the matching detach to the runtime, on a context of
//     its own (the caller's has often expired by then). The caller gets the
//     enrollment error's code with a message that says the attach was undone,
//     or that undoing it failed too.
func (i *interposer) attach(ctx context.Context, method string, req *knipb.AttachInterfaceRequest, attach attachFunc, detach detachFunc) (*knipb.AttachInterfaceResponse, error) {
	log := i.log.With(zap.String("method", method), zap.String("sandbox", req.GetId()),
		zap.String("pod", req.GetNamespace()+"/"+req.GetName()))
	excluded := i.cfg.Excluded(firstNonEmpty(req.GetNamespace(), req.GetLabels()[LabelPodNamespace]))
	if !excluded {
		gaterpc.LogFittedMetadata(log, req.GetLabels(), req.GetAnnotations())
		if _, _, err := attachIdentity(req, i.cfg.Network); err != nil {
			log.Warn("refused attach: the pod could not be enrolled", zap.Error(err))
			return nil, status.Errorf(codes.InvalidArgument, "mesh-cni: cannot enroll this pod in the mesh, so the attach was not forwarded to the network runtime: %v", err)
		}
	}
	resp, err := forward(ctx, attach, req)
	if err != nil {
		log.Info("network runtime failed the attach", zap.Error(err))
		return nil, err
	}
	if excluded {
		log.Info("namespace is excluded from the mesh; attach passed through")
		return resp, nil
	}

	add, err := AttachToGate(req, resp, i.cfg.Network)
	if err != nil {
		log.Error("cannot enroll the attached pod", zap.Error(err))
		return nil, i.undo(ctx, log, req, detach, codes.FailedPrecondition, err.Error())
	}
	decision, err := i.cfg.Enroll(ctx, log, "attach", add)
	if err != nil {
		st := status.Convert(err)
		log.Error("enrollment failed", zap.Error(err))
		return nil, i.undo(ctx, log, req, detach, st.Code(), st.Message())
	}
	log.Info("attach done", zap.Stringer("decision", decision.GetDecision()), zap.String("reason", decision.GetReason()),
		zap.String("netns", add.GetNetnsPath()), zap.String("ifname", add.GetAttachment().GetIfname()))
	return resp, nil
}

// undo rolls back an attach whose pod could not be enrolled and returns the
// error for the caller.
func (i *interposer) undo(ctx context.Context, log *zap.Logger, req *knipb.AttachInterfaceRequest, detach detachFunc, code codes.Code, why string) error {
	code = gaterpc.FailureCode(code)
	undoCtx, cancel := context.WithTimeout(context.WithoutCancel(outgoing(ctx)), i.cfg.RollbackTimeout)
	defer cancel()
	dreq := detachRequestFor(req)
	if del, err := DetachToGate(dreq, i.cfg.Network); err == nil {
		gaterpc.ReleaseSandbox(undoCtx, log, i.cfg.Gate, del)
	}
	if _, err := detach(undoCtx, dreq); err != nil {
		log.Error("undoing the attach failed; the network runtime may still hold the pod's network", zap.Error(err))
		return status.Errorf(code, "mesh-cni: pod %s/%s was not enrolled in the mesh (%s), and undoing its network attachment failed: %v",
			req.GetNamespace(), req.GetName(), why, err)
	}
	log.Warn("attach undone because the pod was not enrolled")
	return status.Errorf(code, "mesh-cni: pod %s/%s was not enrolled in the mesh, so its network attachment was undone: %s",
		req.GetNamespace(), req.GetName(), why)
}

func detachRequestFor(req *knipb.AttachInterfaceRequest) *knipb.DetachInterfaceRequest {
	return &knipb.DetachInterfaceRequest{
		Name:        req.GetName(),
		Id:          req.GetId(),
		Namespace:   req.GetNamespace(),
		Isolation:   req.GetIsolation(),
		Labels:      req.GetLabels(),
		Annotations: req.GetAnnotations(),
		Extradata:   req.GetExtradata(),
	}
}

// detach releases the pod, then forwards. The release never blocks the
// detach: its errors are logged and the agent's reconciliation cleans up after
// a pod whose network namespace is gone.
func (i *interposer) detach(ctx context.Context, method string, req *knipb.DetachInterfaceRequest, fwd detachFunc) (*knipb.DetachInterfaceResponse, error) {
	log := i.log.With(zap.String("method", method), zap.String("sandbox", req.GetId()),
		zap.String("pod", req.GetNamespace()+"/"+req.GetName()))
	if del, err := DetachToGate(req, i.cfg.Network); err != nil {
		log.Warn("cannot release the pod from the mesh; forwarding the detach anyway", zap.Error(err))
	} else {
		i.cfg.Release(ctx, log, del)
	}
	return forward(ctx, fwd, req)
}
