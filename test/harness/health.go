package harness

import (
	"context"
	"fmt"
	"net/http"
	"path/filepath"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/mesh-cni/mesh-cni/internal/gaterpc"
)

// healthPoll is the pause between health checks that reached a server that is not
// serving yet. Reaching the socket itself is waited for by gRPC (wait-for-ready),
// with a short reconnect backoff so a socket that appears late is found soon.
const healthPoll = 50 * time.Millisecond

// WaitForHealthy waits until the gRPC server on the Unix socket at socketPath reports
// the overall health service ("") as SERVING, or ctx ends. The socket need not exist
// yet.
func WaitForHealthy(ctx context.Context, socketPath string) error {
	abs, err := filepath.Abs(socketPath)
	if err != nil {
		return fmt.Errorf("health check socket %q: %w", socketPath, err)
	}
	// The gate client the plugin uses: its short reconnect back-off finds a
	// socket that appears late within a fraction of a second.
	conn, err := gaterpc.Dial(abs)
	if err != nil {
		return fmt.Errorf("health client for %s: %w", socketPath, err)
	}
	defer conn.Close()
	client := healthpb.NewHealthClient(conn)
	var last error
	for {
		resp, err := client.Check(ctx, &healthpb.HealthCheckRequest{}, grpc.WaitForReady(true))
		switch {
		case err == nil && resp.GetStatus() == healthpb.HealthCheckResponse_SERVING:
			return nil
		case err == nil:
			last = fmt.Errorf("status %s", resp.GetStatus())
		case status.Code(err) == codes.Unimplemented:
			return fmt.Errorf("health check on %s: server has no health service: %w", socketPath, err)
		case ctx.Err() != nil:
			if last == nil {
				last = err
			}
			return fmt.Errorf("wait for %s to be healthy: %w (last: %v)", socketPath, ctx.Err(), last)
		default:
			last = err
		}
		timer := time.NewTimer(healthPoll)
		select {
		case <-ctx.Done():
			timer.Stop()
			return fmt.Errorf("wait for %s to be healthy: %w (last: %v)", socketPath, ctx.Err(), last)
		case <-timer.C:
		}
	}
}

// GetOK asks url with a GET and fails unless the answer is 200 OK: a peer's
// HTTP health or readiness endpoint.
func GetOK(ctx context.Context, url string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return nil
}
