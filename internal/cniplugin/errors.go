package cniplugin

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/mesh-cni/mesh-cni/pkg/gate/gateclient"
)

// CNI error codes the released library has no constants for, and mesh-cni's own
// (100 and up are free for plugins).
const (
	// ErrPluginNotAvailable is STATUS's "plugin not available" (spec 1.1).
	ErrPluginNotAvailable uint = 50
	// ErrGateRefused: the agent refused this caller (socket peer not allowed).
	ErrGateRefused uint = 100
	// ErrRequestRejected: the agent rejected the request as invalid.
	ErrRequestRejected uint = 101
	// ErrEnrollFailed: the agent could not put redirection in place.
	ErrEnrollFailed uint = 102
	// ErrNotIntact: CHECK found the pod's redirection broken.
	ErrNotIntact uint = 103
)

// gateError turns a failed gate call into a CNI error an operator can act on.
func gateError(op, socket string, timeout time.Duration, err error) *types.Error {
	st := gateclient.StatusOf(err)
	switch {
	case st.Code == gateclient.Aborted:
		// The agent answered: it cannot admit the pod yet (enrollment source
		// unreachable, node proxy missing). Its reason is the message.
		return types.NewError(types.ErrTryAgainLater,
			fmt.Sprintf("mesh-cni: %s: the mesh agent cannot admit the pod yet, so it must not start; the runtime retries: %s", op, st.Message),
			"")
	case errors.Is(err, context.DeadlineExceeded) || st.Code == gateclient.DeadlineExceeded || st.Code == gateclient.Unavailable:
		return types.NewError(types.ErrTryAgainLater,
			fmt.Sprintf("mesh-cni: %s: mesh-agent is not ready: no answer on gate socket %s within %s; the pod waits for the mesh agent on this node (is the mesh-agent DaemonSet running?)", op, socket, timeout),
			st.Message)
	case st.Code == gateclient.PermissionDenied:
		return types.NewError(ErrGateRefused,
			fmt.Sprintf("mesh-cni: %s: mesh-agent refused this caller on %s (the plugin must run as a user the agent allows)", op, socket),
			st.Message)
	case st.Code == gateclient.InvalidArgument:
		return types.NewError(ErrRequestRejected, fmt.Sprintf("mesh-cni: %s: mesh-agent rejected the request", op), st.Message)
	case st.Code == gateclient.FailedPrecondition:
		return types.NewError(ErrNotIntact, fmt.Sprintf("mesh-cni: %s: mesh redirection is not intact", op), st.Message)
	default:
		return types.NewError(ErrEnrollFailed, fmt.Sprintf("mesh-cni: %s: mesh-agent failed", op), st.Message)
	}
}

// isAgentAway reports errors that mean the agent could not be reached in time.
func isAgentAway(err error) bool {
	if errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	st := gateclient.StatusOf(err)
	if st == nil {
		return false
	}
	switch st.Code {
	case gateclient.Unavailable, gateclient.DeadlineExceeded, gateclient.Canceled:
		return true
	}
	return false
}
