package gateclient

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/mesh-cni/mesh-cni/pkg/gate"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
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

// serve runs the gate's own server (gate.NewServer: peer credentials,
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
	s := &server{grpc: gate.NewServer(allowed), health: health.NewServer(), done: make(chan struct{})}
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

func testAdd() *AddRequest {
	return &AddRequest{
		Pod:        PodIdentity{Namespace: "ns", Name: "p", UID: "u"},
		Attachment: Attachment{ContainerID: "c", Ifname: "eth0", Network: "n"},
		NetnsPath:  "/var/run/netns/p",
		Interfaces: testInterfaces(),
		Source:     SourceCNI,
	}
}

func wantCode(t *testing.T, err error, code Code) *Status {
	t.Helper()
	st := StatusOf(err)
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
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := New(path).Add(ctx, testAdd())
	if err != nil {
		t.Fatal(err)
	}
	if *resp != (AddResponse{Decision: DecisionEnrolled, Reason: "all", NetnsCookie: 42}) {
		t.Errorf("response %+v", resp)
	}
	want := &gatepb.AddRequest{
		Pod:        &gatepb.PodIdentity{Namespace: "ns", Name: "p", Uid: "u"},
		Attachment: &gatepb.Attachment{ContainerId: "c", Ifname: "eth0", Network: "n"},
		NetnsPath:  "/var/run/netns/p",
		Interfaces: pbInterfaces(),
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
	_, err := New(path).Add(context.Background(), testAdd())
	if st := wantCode(t, err, Aborted); st.Message != msg {
		t.Errorf("message %q, want %q", st.Message, msg)
	}
	if err := New(path).Check(context.Background(), &CheckRequest{}); StatusOf(err).Code != FailedPrecondition {
		t.Errorf("Check: %v", err)
	}
}

func TestPeerNotAllowed(t *testing.T) {
	path := socketPath(t)
	serve(t, path, &fakeGate{}, os.Getuid()+1)
	_, err := New(path).Del(context.Background(), &DelRequest{})
	st := wantCode(t, err, PermissionDenied)
	if !strings.Contains(st.Message, fmt.Sprintf("uid %d", os.Getuid())) {
		t.Errorf("message %q does not name the caller's uid", st.Message)
	}
}

func TestUnknownMethod(t *testing.T) {
	path := socketPath(t)
	serve(t, path, &fakeGate{})
	_, err := New(path).invoke(context.Background(), "/meshcni.gate.v1.Gate/Nope", nil, false)
	wantCode(t, err, Unimplemented)
}

// TestWaitForReady: Add waits for a socket that appears later, as for an
// agent that is starting.
func TestWaitForReady(t *testing.T) {
	path := socketPath(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	errc := make(chan error, 1)
	go func() {
		_, err := New(path).Add(ctx, testAdd())
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
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	_, err := New(path).Add(ctx, testAdd())
	st := wantCode(t, err, DeadlineExceeded)
	if !strings.Contains(st.Message, path) {
		t.Errorf("message %q does not say which socket it waited for", st.Message)
	}
}

func TestFailFast(t *testing.T) {
	path := socketPath(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := New(path).Del(ctx, &DelRequest{}); StatusOf(err).Code != Unavailable {
		t.Fatalf("Del without an agent: %v, want Unavailable", err)
	}
	if ctx.Err() != nil {
		t.Fatal("Del without an agent waited for the deadline")
	}
	if _, err := New(path).Health(ctx); StatusOf(err).Code != Unavailable {
		t.Fatalf("Health without an agent: %v, want Unavailable", err)
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
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err := New(path).Add(ctx, testAdd())
	wantCode(t, err, DeadlineExceeded)
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
	_, err := New(path).Add(ctx, testAdd())
	wantCode(t, err, Canceled)
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
		gate.Stop(s.grpc, 50*time.Millisecond)
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := New(path).Add(ctx, testAdd())
	wantCode(t, err, Unavailable)
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
	req := &GCRequest{Network: "n"}
	for i := range n {
		req.Valid = append(req.Valid, Attachment{ContainerID: fmt.Sprintf("%064d", i), Ifname: "eth0", Network: "n"})
	}
	resp, err := New(path).GC(context.Background(), req)
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
	c := New(path)
	var wg sync.WaitGroup
	errs := make(chan error, 16*20)
	for range 16 {
		wg.Go(func() {
			for range 20 {
				resp, err := c.Del(context.Background(), &DelRequest{Attachment: Attachment{Ifname: "eth0"}})
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
	c := New(path)
	for _, want := range []HealthStatus{HealthNotServing, HealthServing} {
		s.health.SetServingStatus("", healthpb.HealthCheckResponse_ServingStatus(want))
		got, err := c.Health(context.Background())
		if err != nil || got != want {
			t.Errorf("Health = %v, %v; want %v", got, err, want)
		}
	}
}

// refusingServer accepts connections, sends its settings and a GOAWAY that
// processes no stream, as a server that is shutting down does, and counts the
// connections.
func refusingServer(t *testing.T, path string) *atomic.Int32 {
	t.Helper()
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	n := new(atomic.Int32)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			n.Add(1)
			frames := []byte{0, 0, 0, frameSettings, 0, 0, 0, 0, 0}
			goAway := make([]byte, 17)
			goAway[2], goAway[3] = 8, frameGoAway
			frames = append(frames, goAway...)
			_, _ = c.Write(frames)
			c.Close()
		}
	}()
	t.Cleanup(func() {
		l.Close()
		<-done
	})
	return n
}

func TestRefusedStreams(t *testing.T) {
	path := socketPath(t)
	n := refusingServer(t, path)
	// Fail fast: one retry of a stream refused unprocessed, then Unavailable.
	if _, err := New(path).Del(context.Background(), &DelRequest{}); StatusOf(err).Code != Unavailable {
		t.Fatalf("Del: %v", err)
	}
	// Wait for ready: refused streams are retried until the deadline, and the
	// error says why, wherever in a retry the deadline falls.
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err := New(path).Add(ctx, testAdd())
	st := wantCode(t, err, DeadlineExceeded)
	if !strings.Contains(st.Message, "refused") {
		t.Errorf("message %q does not say the agent refused", st.Message)
	}
	if got := n.Load(); got < 4 {
		t.Errorf("%d connections, want the fail-fast call's two and the waiting call's retries", got)
	}
}

// TestNotAServer: a peer that does not speak HTTP/2 fails the call rather than
// hanging it.
func TestNotAServer(t *testing.T) {
	path := socketPath(t)
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			_, _ = c.Write([]byte("HTTP/1.1 400 Bad Request\r\n\r\n"))
			c.Close()
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err = New(path).Del(ctx, &DelRequest{})
	if st := StatusOf(err); st == nil || st.Code != Unavailable {
		t.Fatalf("Del to a non-gRPC peer: %v, want Unavailable", err)
	}
	if ctx.Err() != nil {
		t.Fatal("the call hung until its deadline")
	}
}
