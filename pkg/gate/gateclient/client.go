// Package gateclient is the CNI plugin's client of the agent's gate: unary gRPC
// calls over the gate's Unix socket, spoken directly over HTTP/2 on one
// connection per call, with the gate's messages in protobuf's wire format (protowire).
//
// Why not grpc-go: the plugin is a process the runtime starts for every pod, and
// its gRPC stack was most of what it cost beyond the no-op chained plugin's
// exec: grpc-go's packages and their dependencies initialize at every start
// (more than a hundred package inits), its client dials through a resolver, a
// balancer and a transport on several goroutines, and closing it waits for
// them. A plugin makes one call and exits, so all it needs is one connection,
// one stream, and the protocol's rules for it. The server side stays grpc-go
// (internal/gaterpc), with its peer-credential check, deadlines and status codes; the
// calls behave as grpc-go's client calls do:
//
//   - WaitForReady (Add): while the socket cannot be reached, or the agent
//     refuses the stream before processing it (a server stopping), the call
//     is retried on a new connection with a short back-off (10 ms, ×1.5,
//     ±20% jitter, at most 50 ms) until the context ends; it then fails with
//     DeadlineExceeded and the last attempt's error.
//   - Fail fast (everything else): one connection attempt; failing it is
//     Unavailable. A stream refused unprocessed is retried once.
//   - The context's deadline goes to the agent as grpc-timeout and bounds
//     every read and write; a call cut off mid-way (the agent stopped) is
//     Unavailable and never retried, since the agent may have acted on it.
//   - The agent's status (code and message) comes back as a *Status.
package gateclient

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"
)

// DefaultExcludeNamespace is the namespace whose pods pass through every
// entry point without contacting the gate, unless told otherwise: the
// cluster's own system pods must never wait on an agent that may itself need
// them to start. The CNI plugin's excludeNamespaces default is the same.
const DefaultExcludeNamespace = "kube-system"

// Methods of the gate and of grpc.health.v1.
const (
	methodAdd    = "/meshcni.gate.v1.Gate/Add"
	methodDel    = "/meshcni.gate.v1.Gate/Del"
	methodCheck  = "/meshcni.gate.v1.Gate/Check"
	methodGC     = "/meshcni.gate.v1.Gate/GC"
	methodHealth = "/grpc.health.v1.Health/Check"
)

// Reconnect back-off while waiting for the agent: short and capped low, so a
// plugin waiting for an agent that is starting notices its socket within a
// fraction of a second (the same parameters the agent's other clients give
// grpc-go in pkg/gate).
const (
	BackoffBase       = 10 * time.Millisecond
	BackoffMultiplier = 1.5
	BackoffJitter     = 0.2
	BackoffMax        = 50 * time.Millisecond
)

// maxResponse bounds a response message; the agent's answers to the plugin
// are small, a GC's list of released attachments the largest.
const maxResponse = 16 << 20

// Client calls the gate on one socket. Its zero value is not usable; make one
// with New. A Client holds no connection between calls.
type Client struct {
	socket string
}

// New returns a client of the gate socket at path.
func New(path string) *Client { return &Client{socket: path} }

// Add asks the agent to admit the pod, waiting until the agent is ready (or
// ctx ends).
func (c *Client) Add(ctx context.Context, req *AddRequest) (*AddResponse, error) {
	return call[AddResponse](ctx, c, methodAdd, req.marshal(), true, "AddResponse")
}

// Del releases the attachment.
func (c *Client) Del(ctx context.Context, req *DelRequest) (*DelResponse, error) {
	return call[DelResponse](ctx, c, methodDel, req.marshal(), false, "DelResponse")
}

// call invokes method and decodes its response, a message R named name;
// waitReady is invoke's waitForReady.
func call[R any, P interface {
	*R
	unmarshal([]byte) error
}](ctx context.Context, c *Client, method string, req []byte, waitReady bool, name string) (*R, error) {
	b, err := c.invoke(ctx, method, req, waitReady)
	if err != nil {
		return nil, err
	}
	resp := P(new(R))
	if err := resp.unmarshal(b); err != nil {
		return nil, &Status{Code: Internal, Message: "decode " + name + ": " + err.Error()}
	}
	return resp, nil
}

// Check asks whether the pod's redirection is intact.
func (c *Client) Check(ctx context.Context, req *CheckRequest) error {
	_, err := c.invoke(ctx, methodCheck, req.marshal(), false)
	return err
}

// GC releases the network's attachments that are not in req.Valid.
func (c *Client) GC(ctx context.Context, req *GCRequest) (*GCResponse, error) {
	return call[GCResponse](ctx, c, methodGC, req.marshal(), false, "GCResponse")
}

// Health asks grpc.health.v1 for the overall status (the agent's readiness).
func (c *Client) Health(ctx context.Context) (HealthStatus, error) {
	// HealthCheckRequest{service: ""} encodes to nothing.
	b, err := c.invoke(ctx, methodHealth, nil, false)
	if err != nil {
		return HealthUnknown, err
	}
	st, err := decodeHealth(b)
	if err != nil {
		return HealthUnknown, &Status{Code: Internal, Message: "decode HealthCheckResponse: " + err.Error()}
	}
	return st, nil
}

// invoke runs one unary call, retrying as the package doc says. Errors are
// *Status.
func (c *Client) invoke(ctx context.Context, method string, req []byte, waitForReady bool) ([]byte, error) {
	delay := BackoffBase
	refusals := 0
	var retried error // why the last attempt was tried again
	for {
		resp, processed, err := c.attempt(ctx, method, req)
		if err == nil {
			return resp, nil
		}
		if retried != nil && ended(ctx) {
			// The deadline fell in a retry: what made it retry says more
			// than the cut-off attempt.
			return nil, contextStatus(ctx, retried)
		}
		var st *Status
		if errors.As(err, &st) || processed {
			if st == nil {
				st = &Status{Code: Unavailable, Message: err.Error()}
			}
			return nil, st
		}
		// The agent never saw the request: safe to try again.
		if ctx.Err() != nil {
			return nil, contextStatus(ctx, err)
		}
		if !waitForReady {
			refusals++
			if refusals > 1 || isDialError(err) {
				return nil, &Status{Code: Unavailable, Message: "connection error: " + err.Error()}
			}
			continue
		}
		retried = err
		wait := time.Duration(float64(delay) * (1 + BackoffJitter*(2*rand.Float64()-1)))
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, contextStatus(ctx, err)
		case <-t.C:
		}
		delay = min(time.Duration(float64(delay)*BackoffMultiplier), BackoffMax)
	}
}

// dialError marks a failure to connect to the socket at all.
type dialError struct{ err error }

func (e dialError) Error() string { return e.err.Error() }
func (e dialError) Unwrap() error { return e.err }

func isDialError(err error) bool {
	var de dialError
	return errors.As(err, &de)
}

// attempt makes the call on a new connection. processed reports whether the
// agent may have seen the request; an error that is not a *Status and not
// processed is safe to retry.
func (c *Client) attempt(ctx context.Context, method string, req []byte) (resp []byte, processed bool, err error) {
	conn, err := dialUnix(ctx, c.socket)
	if err != nil {
		if ctx.Err() != nil {
			return nil, false, dialError{fmt.Errorf("dial %s: %w", c.socket, ctx.Err())}
		}
		return nil, false, dialError{err}
	}
	defer conn.Close()
	// Every read and write ends when ctx does.
	stop := context.AfterFunc(ctx, conn.shutdown)
	defer stop()

	var timeout string
	if dl, ok := ctx.Deadline(); ok {
		timeout = encodeTimeout(int64(time.Until(dl)))
	}
	s := newStream(conn)
	resp, err = s.unary(method, timeout, req)
	if err != nil && ended(ctx) {
		// The context ended the call; its error says why, not the shut
		// down socket or the agent's reset of the stream it caused.
		return nil, s.processed, contextStatus(ctx, nil)
	}
	return resp, s.processed, err
}
