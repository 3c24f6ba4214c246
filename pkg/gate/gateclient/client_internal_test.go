package gateclient

import (
	"context"
	"net"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// The tests of what only the package's insides show: a method the server does
// not know, and servers that refuse or do not speak HTTP/2.

func wantCodeOf(t *testing.T, err error, code Code) *Status {
	t.Helper()
	st := StatusOf(err)
	if st == nil || st.Code != code {
		t.Fatalf("error %v, want code %v", err, code)
	}
	return st
}

func TestUnknownMethod(t *testing.T) {
	path := filepath.Join(t.TempDir(), "gate.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	gatepb.RegisterGateServer(srv, gatepb.UnimplementedGateServer{})
	go srv.Serve(l)
	t.Cleanup(srv.Stop)
	_, err = New(path).invoke(context.Background(), "/meshcni.gate.v1.Gate/Nope", nil, false)
	wantCodeOf(t, err, Unimplemented)
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
	path := filepath.Join(t.TempDir(), "gate.sock")
	n := refusingServer(t, path)
	// Fail fast: one retry of a stream refused unprocessed, then Unavailable.
	if _, err := New(path).Del(context.Background(), &DelRequest{}); StatusOf(err).Code != Unavailable {
		t.Fatalf("Del: %v", err)
	}
	// Wait for ready: refused streams are retried until the deadline, and the
	// error says why, wherever in a retry the deadline falls.
	ctx := fixtures.Context(t, 300*time.Millisecond)
	_, err := New(path).Add(ctx, &AddRequest{Pod: PodIdentity{Namespace: "ns", Name: "p", UID: "u"}, Attachment: Attachment{ContainerID: "c", Ifname: "eth0", Network: "n"}, NetnsPath: "/var/run/netns/p", Source: SourceCNI})
	st := wantCodeOf(t, err, DeadlineExceeded)
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
	path := filepath.Join(t.TempDir(), "gate.sock")
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
	ctx := fixtures.Context(t, 30*time.Second)
	_, err = New(path).Del(ctx, &DelRequest{})
	if st := StatusOf(err); st == nil || st.Code != Unavailable {
		t.Fatalf("Del to a non-gRPC peer: %v, want Unavailable", err)
	}
	if ctx.Err() != nil {
		t.Fatal("the call hung until its deadline")
	}
}
