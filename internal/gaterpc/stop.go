package gaterpc

import (
	"time"

	"google.golang.org/grpc"
)

// Stop lets a server's in-flight calls finish for up to grace, then cuts the
// rest. A caller cut off mid-call sees the call fail and retries it.
func Stop(srv *grpc.Server, grace time.Duration) {
	done := make(chan struct{})
	go func() {
		srv.GracefulStop()
		close(done)
	}()
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		srv.Stop()
		<-done
	}
}
