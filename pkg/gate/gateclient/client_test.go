package gateclient_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/mesh-cni/mesh-cni/internal/gaterpc"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gateclient"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// fakeGate is a gate server whose answers the test chooses.
type fakeGate struct {
	gatepb.UnimplementedGateServer
	add func(context.Context, *gatepb.AddRequest) (*gatepb.AddResponse, error)
	del func(context.Context, *gatepb.DelRequest) (*gatepb.DelResponse, error)
	gc  func(context.Context, *gatepb.GCRequest) (*gatepb.GCResponse, error)
}

func (f *fakeGate) Add(ctx context.Context, r *gatepb.AddRequest) (*gatepb.AddResponse, error) {
	return f.add(ctx, r)
}

func (f *fakeGate) Del(ctx context.Context, r *gatepb.DelRequest) (*gatepb.DelResponse, error) {
	return f.del(ctx, r)
}

func (f *fakeGate) Check(context.Context, *gatepb.CheckRequest) (*gatepb.CheckResponse, error) {
	return nil, status.Error(codes.FailedPrecondition, "not intact")
}

func (f *fakeGate) GC(ctx context.Context, r *gatepb.GCRequest) (*gatepb.GCResponse, error) {
	return f.gc(ctx, r)
}

type server struct {
	grpc   *grpc.Server
	health *health.Server
	done   chan struct{}
}

// serve runs the gate's own server (gaterpc.NewServer: peer credentials,
// allowed uids) with g and a health service on a Unix socket at path.
func serve(t *testing.T, path string, g *fakeGate, allowed ...int) *server {
	t.Helper()
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	if len(allowed) == 0 {
		allowed = []int{os.Getuid()}
	}
	s := &server{grpc: gaterpc.NewServer(allowed), health: health.NewServer(), done: make(chan struct{})}
	gatepb.RegisterGateServer(s.grpc, g)
	healthpb.RegisterHealthServer(s.grpc, s.health)
	go func() {
		defer close(s.done)
		_ = s.grpc.Serve(l)
	}()
	t.Cleanup(func() {
		s.grpc.Stop()
		<-s.done
	})
	return s
}

func socketPath(t *testing.T) string { return filepath.Join(t.TempDir(), "gate.sock") }

func testAdd() *gateclient.AddRequest {
	return &gateclient.AddRequest{
		Pod:        gateclient.PodIdentity{Namespace: "ns", Name: "p", UID: "u"},
		Attachment: gateclient.Attachment{ContainerID: "c", Ifname: "eth0", Network: "n"},
		NetnsPath:  "/var/run/netns/p",
		Interfaces: gateclient.TestInterfaces(),
		Source:     gateclient.SourceCNI,
	}
}

func wantCode(t *testing.T, err error, code gateclient.Code) *gateclient.Status {
	t.Helper()
	st := gateclient.StatusOf(err)
	if st == nil || st.Code != code {
		t.Fatalf("error %v, want code %s", err, code)
	}
	return st
}

func TestAdd(t *testing.T) {
	path := socketPath(t)
	var got *gatepb.AddRequest
	var deadline time.Time
	serve(t, path, &fakeGate{add: func(ctx context.Context, r *gatepb.AddRequest) (*gatepb.AddResponse, error) {
		got = r
		deadline, _ = ctx.Deadline()
		return &gatepb.AddResponse{Decision: gatepb.Decision_DECISION_ENROLLED, Reason: "all", NetnsCookie: 42}, nil
	}})
	ctx := fixtures.Context(t, 30*time.Second)
	resp, err := gateclient.New(path).Add(ctx, testAdd())
	if err != nil {
		t.Fatal(err)
	}
	if *resp != (gateclient.AddResponse{Decision: gateclient.DecisionEnrolled, Reason: "all", NetnsCookie: 42}) {
		t.Errorf("response %+v", resp)
	}
	want := &gatepb.AddRequest{
		Pod:        &gatepb.PodIdentity{Namespace: "ns", Name: "p", Uid: "u"},
		Attachment: &gatepb.Attachment{ContainerId: "c", Ifname: "eth0", Network: "n"},
		NetnsPath:  "/var/run/netns/p",
		Interfaces: gateclient.PBInterfaces(),
		Source:     gatepb.Source_SOURCE_CNI,
	}
	if !proto.Equal(got, want) {
		t.Errorf("server got %v, want %v", got, want)
	}
	// The caller's deadline reached the server (grpc-timeout), never later.
	if mine, _ := ctx.Deadline(); deadline.IsZero() || deadline.After(mine.Add(time.Second)) {
		t.Errorf("server's deadline %v, the caller's %v", deadline, mine)
	}
}

func TestStatusFromServer(t *testing.T) {
	path := socketPath(t)
	msg := "the policy could not decide: 100% unknown, ü\nsecond line"
	serve(t, path, &fakeGate{add: func(context.Context, *gatepb.AddRequest) (*gatepb.AddResponse, error) {
		return nil, status.Error(codes.Aborted, msg)
	}})
	_, err := gateclient.New(path).Add(context.Background(), testAdd())
	if st := wantCode(t, err, gateclient.Aborted); st.Message != msg {
		t.Errorf("message %q, want %q", st.Message, msg)
	}
	if err := gateclient.New(path).Check(context.Background(), &gateclient.CheckRequest{}); gateclient.StatusOf(err).Code != gateclient.FailedPrecondition {
		t.Errorf("Check: %v", err)
	}
}

func TestPeerNotAllowed(t *testing.T) {
	path := socketPath(t)
	serve(t, path, &fakeGate{}, os.Getuid()+1)
	_, err := gateclient.New(path).Del(context.Background(), &gateclient.DelRequest{})
	st := wantCode(t, err, gateclient.PermissionDenied)
	if !strings.Contains(st.Message, fmt.Sprintf("uid %d", os.Getuid())) {
		t.Errorf("message %q does not name the caller's uid", st.Message)
	}
}

// TestWaitForReady: Add waits for a socket that appears later, as for an
// agent that is starting.
func TestWaitForReady(t *testing.T) {
	path := socketPath(t)
	ctx := fixtures.Context(t, 30*time.Second)
	errc := make(chan error, 1)
	go func() {
		_, err := gateclient.New(path).Add(ctx, testAdd())
		errc <- err
	}()
	// Part of the scenario: the agent is away while the call waits.
	time.Sleep(200 * time.Millisecond)
	serve(t, path, &fakeGate{add: func(context.Context, *gatepb.AddRequest) (*gatepb.AddResponse, error) {
		return &gatepb.AddResponse{Decision: gatepb.Decision_DECISION_ENROLLED}, nil
	}})
	if err := <-errc; err != nil {
		t.Fatalf("Add after the agent came up: %v", err)
	}
}

func TestWaitForReadyDeadline(t *testing.T) {
	path := socketPath(t)
	ctx := fixtures.Context(t, 200*time.Millisecond)
	_, err := gateclient.New(path).Add(ctx, testAdd())
	st := wantCode(t, err, gateclient.DeadlineExceeded)
	if !strings.Contains(st.Message, path) {
		t.Errorf("message %q does not say which socket it waited for", st.Message)
	}
}

func TestFailFast(t *testing.T) {
	path := socketPath(t)
	ctx := fixtures.Context(t, time.Minute)
	if _, err := gateclient.New(path).Del(ctx, &gateclient.DelRequest{}); gateclient.StatusOf(err).Code != gateclient.Unavailable {
		t.Fatalf("Del without an agent: %v, want gateclient.Unavailable", err)
	}
	if ctx.Err() != nil {
		t.Fatal("Del without an agent waited for the deadline")
	}
	if _, err := gateclient.New(path).Health(ctx); gateclient.StatusOf(err).Code != gateclient.Unavailable {
		t.Fatalf("Health without an agent: %v, want gateclient.Unavailable", err)
	}
}

func TestDeadlineWhileAgentWorks(t *testing.T) {
	path := socketPath(t)
	serverSaw := make(chan error, 1)
	serve(t, path, &fakeGate{add: func(ctx context.Context, _ *gatepb.AddRequest) (*gatepb.AddResponse, error) {
		<-ctx.Done()
		serverSaw <- ctx.Err()
		return nil, ctx.Err()
	}})
	ctx := fixtures.Context(t, 300*time.Millisecond)
	_, err := gateclient.New(path).Add(ctx, testAdd())
	wantCode(t, err, gateclient.DeadlineExceeded)
	if err := <-serverSaw; !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled) {
		t.Errorf("the agent's handler saw %v", err)
	}
}

func TestCancel(t *testing.T) {
	path := socketPath(t)
	entered := make(chan struct{})
	serve(t, path, &fakeGate{add: func(ctx context.Context, _ *gatepb.AddRequest) (*gatepb.AddResponse, error) {
		close(entered)
		<-ctx.Done()
		return nil, ctx.Err()
	}})
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		<-entered
		cancel()
	}()
	_, err := gateclient.New(path).Add(ctx, testAdd())
	wantCode(t, err, gateclient.Canceled)
}

// TestAgentStopsMidCall: a call the agent was working on when it stopped is
// Unavailable (the runtime retries the ADD), never retried by the client.
func TestAgentStopsMidCall(t *testing.T) {
	path := socketPath(t)
	entered := make(chan struct{})
	var calls sync.WaitGroup
	calls.Add(1)
	s := serve(t, path, &fakeGate{add: func(ctx context.Context, _ *gatepb.AddRequest) (*gatepb.AddResponse, error) {
		defer calls.Done()
		close(entered)
		<-ctx.Done()
		return nil, ctx.Err()
	}})
	go func() {
		<-entered
		gaterpc.Stop(s.grpc, 50*time.Millisecond)
	}()
	ctx := fixtures.Context(t, 30*time.Second)
	_, err := gateclient.New(path).Add(ctx, testAdd())
	wantCode(t, err, gateclient.Unavailable)
	calls.Wait() // one call only: not retried
}

// TestLargeMessages: requests and responses past the flow-control windows and
// the frame size go through whole.
func TestLargeMessages(t *testing.T) {
	path := socketPath(t)
	const n = 20000
	serve(t, path, &fakeGate{gc: func(_ context.Context, r *gatepb.GCRequest) (*gatepb.GCResponse, error) {
		if len(r.GetValid()) != n || r.GetValid()[n-1].GetContainerId() != fmt.Sprintf("%064d", n-1) {
			return nil, status.Errorf(codes.InvalidArgument, "got %d attachments", len(r.GetValid()))
		}
		return &gatepb.GCResponse{Released: r.GetValid()}, nil
	}})
	req := &gateclient.GCRequest{Network: "n"}
	for i := range n {
		req.Valid = append(req.Valid, gateclient.Attachment{ContainerID: fmt.Sprintf("%064d", i), Ifname: "eth0", Network: "n"})
	}
	resp, err := gateclient.New(path).GC(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Released) != n || resp.Released[n-1] != req.Valid[n-1] {
		t.Fatalf("released %d attachments, want %d", len(resp.Released), n)
	}
}

func TestConcurrentCalls(t *testing.T) {
	path := socketPath(t)
	serve(t, path, &fakeGate{del: func(_ context.Context, r *gatepb.DelRequest) (*gatepb.DelResponse, error) {
		return &gatepb.DelResponse{Released: r.GetAttachment().GetIfname() == "eth0"}, nil
	}})
	c := gateclient.New(path)
	var wg sync.WaitGroup
	errs := make(chan error, 16*20)
	for range 16 {
		wg.Go(func() {
			for range 20 {
				resp, err := c.Del(context.Background(), &gateclient.DelRequest{Attachment: gateclient.Attachment{Ifname: "eth0"}})
				if err == nil && !resp.Released {
					err = errors.New("not released")
				}
				if err != nil {
					errs <- err
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func TestHealth(t *testing.T) {
	path := socketPath(t)
	s := serve(t, path, &fakeGate{})
	c := gateclient.New(path)
	for _, want := range []gateclient.HealthStatus{gateclient.HealthNotServing, gateclient.HealthServing} {
		s.health.SetServingStatus("", healthpb.HealthCheckResponse_ServingStatus(want))
		got, err := c.Health(context.Background())
		if err != nil || got != want {
			t.Errorf("Health = %v, %v; want %v", got, err, want)
		}
	}
}
