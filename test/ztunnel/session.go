package ztunnel

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
)

// Handler is the proxy behind the client: what ztunnel's state manager does
// with each workload.
type Handler interface {
	// Start starts (or keeps, for the same namespace) the pod's proxy, taking
	// over netns. An error is a pod that could not be started: it is nacked
	// and the connection stays.
	Start(uid string, info WorkloadInfo, netns *os.File) error
	// Stop stops the pod's proxy; an unknown uid is fine.
	Stop(uid string)
	// Reconcile stops every pod not in keep, at SnapshotSent.
	Reconcile(keep map[string]bool)
}

// Options are the conformance checks beyond what ztunnel enforces itself.
type Options struct {
	// RequireServiceAccount makes an AddWorkload with an empty service_account
	// a deviation (nacked, connection closed, Serve returns it).
	RequireServiceAccount bool
	// OnRequest, when set, sees every request before it is handled (tests
	// collect what the agent sent). It must not keep req.Netns.
	OnRequest func(req *Request)
	// Misreport is a fault for tests of the identity check: the
	// service account an AddWorkload of the pod "namespace/name" carries is
	// replaced by this one, as if the agent had sent it.
	Misreport map[string]string
}

// Session is the state of one connection, as statemanager.rs keeps it.
type Session struct {
	opts     Options
	handler  Handler
	synced   bool            // snapshot_received
	snapshot map[string]bool // snapshot_names
}

// NewSession starts the state of a new connection (reset_snapshot).
func NewSession(h Handler, opts Options) *Session {
	return &Session{opts: opts, handler: h, snapshot: map[string]bool{}}
}

// Synced reports whether SnapshotSent was handled.
func (s *Session) Synced() bool { return s.synced }

// Serve says hello and handles requests until the agent closes the connection
// (nil), ctx ends, or the agent deviates (the error wraps ErrDeviation, after
// the nack ztunnel would send).
func (s *Session) Serve(ctx context.Context, c *Conn) error {
	if err := c.Hello(); err != nil {
		return fmt.Errorf("announce to the agent: %w", err)
	}
	for {
		req, err := c.Recv(ctx)
		if errors.Is(err, ErrDeviation) {
			// workloadmanager.rs: "failure to read message", then hang up.
			return errors.Join(err, c.Ack("failure to read message: "+err.Error()))
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		if sa, ok := s.opts.Misreport[req.Info.Namespace+"/"+req.Info.Name]; ok && req.Kind == Add {
			req.Info.ServiceAccount = sa
		}
		if s.opts.OnRequest != nil {
			s.opts.OnRequest(req)
		}
		msg, fatal := s.handle(req)
		if err := c.Ack(msg); err != nil {
			return errors.Join(fatal, err)
		}
		if fatal != nil {
			return fatal
		}
	}
}

// handle applies one request; it returns the ack's error text and, for a
// protocol error, the error that ends the connection.
func (s *Session) handle(req *Request) (string, error) {
	switch req.Kind {
	case Add:
		if !req.HasInfo {
			req.Netns.Close()
			err := deviationf("AddWorkload %s: workload_info is required but not present", req.UID)
			return "failure to process message: " + err.Error(), err
		}
		if s.opts.RequireServiceAccount && req.Info.ServiceAccount == "" {
			req.Netns.Close()
			err := deviationf("AddWorkload %s (%s/%s) has no service_account: ztunnel cannot find the workload or its identity", req.UID, req.Info.Namespace, req.Info.Name)
			return "failure to process message: " + err.Error(), err
		}
		if !s.synced {
			s.snapshot[req.UID] = true
		}
		if err := s.handler.Start(req.UID, req.Info, req.Netns); err != nil {
			return "failure to start proxy: " + err.Error(), nil
		}
		return "", nil
	case Keep:
		if s.synced {
			err := deviationf("pod keep received after snapshot")
			return "failure to process message: " + err.Error(), err
		}
		s.snapshot[req.UID] = true
		return "", nil
	case Del:
		if !s.synced {
			delete(s.snapshot, req.UID)
			return "", nil
		}
		s.handler.Stop(req.UID)
		return "", nil
	case SnapshotSent:
		if s.synced {
			err := deviationf("pod snapshot received already")
			return "failure to process message: " + err.Error(), err
		}
		s.handler.Reconcile(s.snapshot)
		s.snapshot = map[string]bool{}
		s.synced = true
		return "", nil
	}
	err := deviationf("unknown request")
	return err.Error(), err
}
