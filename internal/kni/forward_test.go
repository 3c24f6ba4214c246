package kni

import (
	"errors"
	"io"
	"net"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// chatDesc is a bidirectional streaming method neither the interposer nor
// this build's KNI knows: the interposer can only pass it through unknown.
var chatDesc = grpc.StreamDesc{StreamName: "Chat", ServerStreams: true, ClientStreams: true}

const chatMethod = "/mesh.test.Echo/Chat"

// echoServer answers each message of a Chat in upper case, with the caller's
// x-caller metadata in its header and the number of messages in its trailer,
// and ends the call with ResourceExhausted so that the status must come back
// through the interposer too.
func echoServer(_ any, ss grpc.ServerStream) error {
	md, _ := metadata.FromIncomingContext(ss.Context())
	if err := ss.SendHeader(metadata.Pairs("x-echo-caller", strings.Join(md.Get("x-caller"), ","))); err != nil {
		return err
	}
	n := 0
	for {
		in := &wrapperspb.StringValue{}
		if err := ss.RecvMsg(in); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			return err
		}
		n++
		if err := ss.SendMsg(wrapperspb.String(strings.ToUpper(in.GetValue()))); err != nil {
			return err
		}
	}
	ss.SetTrailer(metadata.Pairs("x-echo-count", strconv.Itoa(n)))
	return status.Error(codes.ResourceExhausted, "echo: quota of this call used up")
}

func serveUnix(t *testing.T, srv *grpc.Server, path string) {
	t.Helper()
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(srv.Stop)
}

// TestForwardUnknownStreams sends a bidirectional stream through
// forwardUnknown: every message both ways in order, the caller's metadata up,
// the runtime's header, trailer and status back, unchanged.
func TestForwardUnknownStreams(t *testing.T) {
	ctx := fixtures.Context(t, 30*time.Second)
	dir := t.TempDir()

	upstream := grpc.NewServer(grpc.UnknownServiceHandler(echoServer))
	upPath := filepath.Join(dir, "runtime.sock")
	serveUnix(t, upstream, upPath)
	upConn, err := dialUpstream(upPath)
	if err != nil {
		t.Fatal(err)
	}
	defer upConn.Close()

	codec := newRawCodec()
	interposer := grpc.NewServer(grpc.ForceServerCodecV2(codec), grpc.UnknownServiceHandler(forwardUnknown(upConn, codec)))
	frontPath := filepath.Join(dir, "kni.sock")
	serveUnix(t, interposer, frontPath)
	conn, err := grpc.NewClient("unix://"+frontPath, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()

	cs, err := conn.NewStream(metadata.AppendToOutgoingContext(ctx, "x-caller", "kubelet"), &chatDesc, chatMethod)
	if err != nil {
		t.Fatal(err)
	}
	sent := []string{"attach", "query", "detach"}
	for _, s := range sent {
		if err := cs.SendMsg(wrapperspb.String(s)); err != nil {
			t.Fatalf("send %q: %v", s, err)
		}
		// One answer per message before the next is sent: the stream is
		// passed through as it goes, not collected until the caller is done.
		got := &wrapperspb.StringValue{}
		if err := cs.RecvMsg(got); err != nil || got.GetValue() != strings.ToUpper(s) {
			t.Fatalf("answer to %q = %q, %v; want %q", s, got.GetValue(), err, strings.ToUpper(s))
		}
	}
	if err := cs.CloseSend(); err != nil {
		t.Fatal(err)
	}
	err = cs.RecvMsg(&wrapperspb.StringValue{})
	if st := status.Convert(err); st.Code() != codes.ResourceExhausted || st.Message() != "echo: quota of this call used up" {
		t.Fatalf("end of stream = %v, want the runtime's ResourceExhausted", err)
	}
	header, err := cs.Header()
	if err != nil {
		t.Fatal(err)
	}
	if got := header.Get("x-echo-caller"); len(got) != 1 || got[0] != "kubelet" {
		t.Errorf("runtime saw x-caller %q, want the caller's [kubelet]", got)
	}
	if got := cs.Trailer().Get("x-echo-count"); len(got) != 1 || got[0] != "3" {
		t.Errorf("trailer x-echo-count %q, want the runtime's [3]", got)
	}
}
