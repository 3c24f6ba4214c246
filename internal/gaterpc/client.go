package gaterpc

import (
	"fmt"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"
)

// Dial prepares a client connection to the gate socket. It does not connect until
// the first call. Reconnect back-off is short and capped low on purpose: a plugin
// waiting for an agent that is starting must notice the socket within a fraction
// of a second, where gRPC's default back-off grows to minutes.
func Dial(socketPath string) (*grpc.ClientConn, error) {
	conn, err := DialUnix(socketPath, 10*time.Millisecond, 50*time.Millisecond)
	if err != nil {
		return nil, fmt.Errorf("gate client for %s: %w", socketPath, err)
	}
	return conn, nil
}

// DialUnix prepares a client connection to a gRPC server on the Unix socket at
// socketPath, reconnecting with a back-off from firstDelay up to maxDelay
// instead of gRPC's default, which grows to minutes. It does not connect until
// the first call.
func DialUnix(socketPath string, firstDelay, maxDelay time.Duration) (*grpc.ClientConn, error) {
	conn, err := grpc.NewClient("unix://"+socketPath,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff: backoff.Config{
				BaseDelay:  firstDelay,
				Multiplier: 1.5,
				Jitter:     0.2,
				MaxDelay:   maxDelay,
			},
			MinConnectTimeout: time.Second,
		}),
	)
	if err != nil {
		return nil, fmt.Errorf("client for unix socket %s: %w", socketPath, err)
	}
	return conn, nil
}
