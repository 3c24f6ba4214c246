package kniruntime

import (
	"context"
	"net"

	"google.golang.org/grpc"
)

// libkniService is the KNI service exactly as kni-api v0.0.8 declares it
// (github.com/MikeZappa87/kni-api, tag v0.0.8 = commit
// b7b61d2d455d1c08c9d712d14a2f2e515b723025, pkg/apis/runtime/beta/api.proto:
// package kni, service KNI), which the published reference runtime libkni
// v0.3.0 (github.com/MikeZappa87/libkni, commit
// 81fe78d04cf748697e9cf8adf5461cbea9386d4b) serves. It is written out here,
// not taken from this repository's generated service, because the point is
// the method set: there is no AttachNetwork or DetachNetwork, and a call to
// either is answered Unimplemented by gRPC itself. The messages are
// wire-identical to knipb's (same field numbers), so those types decode them.
var libkniService = grpc.ServiceDesc{
	ServiceName: "kni.KNI",
	HandlerType: (*any)(nil),
	Methods: []grpc.MethodDesc{
		unary("CreateNetwork", (*Runtime).CreateNetwork),
		unary("DeleteNetwork", (*Runtime).DeleteNetwork),
		unary("AttachInterface", (*Runtime).AttachInterface),
		unary("DetachInterface", (*Runtime).DetachInterface),
		unary("QueryPodNetwork", (*Runtime).QueryPodNetwork),
		unary("SetupNodeNetwork", (*Runtime).SetupNodeNetwork),
		unary("QueryNodeNetworks", (*Runtime).QueryNodeNetworks),
	},
	Metadata: "pkg/apis/runtime/beta/api.proto",
}

func unary[Req, Resp any](name string, call func(*Runtime, context.Context, *Req) (*Resp, error)) grpc.MethodDesc {
	return grpc.MethodDesc{
		MethodName: name,
		Handler: func(srv any, ctx context.Context, dec func(any) error, icpt grpc.UnaryServerInterceptor) (any, error) {
			in := new(Req)
			if err := dec(in); err != nil {
				return nil, err
			}
			r := srv.(*Runtime)
			handler := func(ctx context.Context, req any) (any, error) { return call(r, ctx, req.(*Req)) }
			if icpt == nil {
				return handler(ctx, in)
			}
			return icpt(ctx, in, &grpc.UnaryServerInfo{Server: srv, FullMethod: "/kni.KNI/" + name}, handler)
		},
	}
}

// ServeLibkni is Serve with only the method names libkni serves.
func (r *Runtime) ServeLibkni(l net.Listener) (stop func()) {
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(r.intercept))
	srv.RegisterService(&libkniService, r)
	return r.serve(srv, l)
}
