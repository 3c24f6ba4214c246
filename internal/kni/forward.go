package kni

import (
	"context"
	"errors"
	"io"
	"slices"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/encoding"
	_ "google.golang.org/grpc/encoding/proto" // registers the "proto" codec rawCodec delegates to
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// hopHeaders are metadata keys that describe one HTTP/2 hop, not the call: gRPC
// sets them afresh on every connection, so they are never copied across.
// Everything else the caller sent (and the runtime answered in headers and
// trailers) is passed on as it is.
var hopHeaders = []string{"content-type", "user-agent", "te", "connection", "host", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade"}

func forwardable(md metadata.MD) metadata.MD {
	out := make(metadata.MD, len(md))
	for k, v := range md {
		if strings.HasPrefix(k, ":") || strings.HasPrefix(k, "grpc-") || slices.Contains(hopHeaders, k) {
			continue
		}
		out[k] = slices.Clone(v)
	}
	return out
}

// outgoing returns ctx (deadline and cancellation included) with the caller's
// metadata set for the call to the network runtime.
func outgoing(ctx context.Context) context.Context {
	md, _ := metadata.FromIncomingContext(ctx)
	return metadata.NewOutgoingContext(ctx, forwardable(md))
}

// forward makes one unary call to the network runtime on behalf of the caller:
// metadata, deadline and cancellation go up, headers and trailers come back,
// and the runtime's error is returned as it is (a gRPC status, which the server
// sends on with the same code, message and details).
func forward[Req, Resp any](ctx context.Context, call func(context.Context, Req, ...grpc.CallOption) (Resp, error), req Req) (Resp, error) {
	var header, trailer metadata.MD
	resp, err := call(outgoing(ctx), req, grpc.Header(&header), grpc.Trailer(&trailer))
	if h := forwardable(header); len(h) > 0 {
		// Fails only outside a server call; nothing to do about it then.
		_ = grpc.SetHeader(ctx, h)
	}
	if t := forwardable(trailer); len(t) > 0 {
		_ = grpc.SetTrailer(ctx, t)
	}
	return resp, err
}

// frame is one message passed through without being decoded.
type frame struct{ data []byte }

// rawCodec passes frames through as bytes and everything else to the proto
// codec, so one server serves the typed KNI methods and forwards unknown ones.
type rawCodec struct{ proto encoding.CodecV2 }

func newRawCodec() rawCodec { return rawCodec{proto: encoding.GetCodecV2("proto")} }

func (c rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	if f, ok := v.(*frame); ok {
		return mem.BufferSlice{mem.SliceBuffer(f.data)}, nil
	}
	return c.proto.Marshal(v)
}

func (c rawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	if f, ok := v.(*frame); ok {
		f.data = data.Materialize()
		return nil
	}
	return c.proto.Unmarshal(data, v)
}

// Name is "proto": the frames are protobuf, only not decoded here.
func (rawCodec) Name() string { return "proto" }

// forwardUnknown forwards a call to a method this build does not know (a newer
// KNI version's, or another service the runtime serves on the same socket, such
// as grpc.health.v1) byte for byte, so the interposer never hides a method of
// the runtime from kubelet. It is grpc's own UnknownServiceHandler with the
// frame codec above: all a transparent-proxy library would add is its own
// copy of both, on grpc's older Codec interface, without the hop-header
// filtering the typed methods share here.
func forwardUnknown(conn *grpc.ClientConn, codec rawCodec) grpc.StreamHandler {
	return func(_ any, ss grpc.ServerStream) error {
		method, ok := grpc.MethodFromServerStream(ss)
		if !ok {
			return status.Error(codes.Internal, "mesh-cni KNI interposer: no method name on the stream")
		}
		ctx, cancel := context.WithCancel(outgoing(ss.Context()))
		defer cancel()
		cs, err := conn.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true, ClientStreams: true}, method, grpc.ForceCodecV2(codec))
		if err != nil {
			return err
		}
		go func() {
			// Caller → runtime. A failed send ends the stream; its status is
			// what cs.RecvMsg returns below.
			for {
				f := &frame{}
				if err := ss.RecvMsg(f); err != nil {
					if errors.Is(err, io.EOF) {
						_ = cs.CloseSend()
					} else {
						cancel()
					}
					return
				}
				if err := cs.SendMsg(f); err != nil {
					return
				}
			}
		}()
		if h, err := cs.Header(); err == nil && len(forwardable(h)) > 0 {
			if err := ss.SendHeader(forwardable(h)); err != nil {
				return err
			}
		}
		for {
			f := &frame{}
			if err := cs.RecvMsg(f); err != nil {
				ss.SetTrailer(forwardable(cs.Trailer()))
				if errors.Is(err, io.EOF) {
					return nil
				}
				return err
			}
			if err := ss.SendMsg(f); err != nil {
				return err
			}
		}
	}
}
