package ztunnel

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// RetryInterval is how often ztunnel tries again to start the proxies of pods
// that failed to start (workloadmanager.rs RETRY_DURATION).
const RetryInterval = 5 * time.Second

// Handler is the proxy behind the client: what ztunnel's state manager does
// with each workload.
type Handler interface {
	// Start starts (or keeps, for the same namespace) the pod's proxy, taking
	// over netns. An error is a pod that could not be started: it is nacked,
	// the connection stays, and the session tries it again every retry
	// interval with a copy of netns while it is pending.
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
	// RetryInterval overrides RetryInterval (tests).
	RetryInterval time.Duration
}

// pendingWorkload is a pod whose proxy failed to start, with its own copy of
// the pod's network namespace for the next try.
type pendingWorkload struct {
	info  WorkloadInfo
	netns *os.File
}

// Session is the state of one connection, as statemanager.rs keeps it.
type Session struct {
	opts    Options
	handler Handler

	mu       sync.Mutex
	synced   bool            // snapshot_received
	snapshot map[string]bool // snapshot_names
	pending  map[string]pendingWorkload
}

// NewSession starts the state of a new connection (reset_snapshot: nothing
// pending from an earlier one).
func NewSession(h Handler, opts Options) *Session {
	return &Session{opts: opts, handler: h, snapshot: map[string]bool{}, pending: map[string]pendingWorkload{}}
}

// Synced reports whether SnapshotSent was handled.
func (s *Session) Synced() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.synced
}

// Pending returns the uids of the pods whose proxies failed to start and are
// tried again; ztunnel is not ready while there are any (statemanager.rs
// ready).
func (s *Session) Pending() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	uids := make([]string, 0, len(s.pending))
	for uid := range s.pending {
		uids = append(uids, uid)
	}
	return uids
}

// start starts a pod's proxy and, when that fails, keeps it pending with a
// copy of its namespace. s.mu is held.
func (s *Session) start(uid string, info WorkloadInfo, netns *os.File) error {
	var spare *os.File
	if fd, err := unix.FcntlInt(netns.Fd(), unix.F_DUPFD_CLOEXEC, 0); err == nil {
		spare = os.NewFile(uintptr(fd), netns.Name())
	}
	s.unpend(uid)
	if err := s.handler.Start(uid, info, netns); err != nil {
		if spare != nil {
			s.pending[uid] = pendingWorkload{info: info, netns: spare}
		}
		return err
	}
	if spare != nil {
		spare.Close()
	}
	return nil
}

// unpend forgets a pending pod. s.mu is held.
func (s *Session) unpend(uid string) {
	if p, ok := s.pending[uid]; ok {
		p.netns.Close()
		delete(s.pending, uid)
	}
}

// retryPending tries the pending pods again every retry interval until ctx
// ends (workloadmanager.rs retry_proxies).
func (s *Session) retryPending(ctx context.Context) {
	every := s.opts.RetryInterval
	if every <= 0 {
		every = RetryInterval
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		s.mu.Lock()
		for uid, p := range s.pending {
			delete(s.pending, uid)
			_ = s.start(uid, p.info, p.netns)
		}
		s.mu.Unlock()
	}
}

// close forgets every pending pod: a new connection starts with none.
func (s *Session) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for uid := range s.pending {
		s.unpend(uid)
	}
}

// Serve says hello and handles requests until the agent closes the connection
// (nil), ctx ends, or the agent deviates (the error wraps ErrDeviation, after
// the nack ztunnel would send).
func (s *Session) Serve(ctx context.Context, c *Conn) error {
	if err := c.Hello(); err != nil {
		return fmt.Errorf("announce to the agent: %w", err)
	}
	retryCtx, stopRetry := context.WithCancel(ctx)
	var retries sync.WaitGroup
	retries.Go(func() { s.retryPending(retryCtx) })
	defer s.close()
	defer retries.Wait()
	defer stopRetry()
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
		s.mu.Lock()
		msg, fatal := s.handle(req)
		s.mu.Unlock()
		if err := c.Ack(msg); err != nil {
			return errors.Join(fatal, err)
		}
		if fatal != nil {
			return fatal
		}
	}
}

// handle applies one request; it returns the ack's error text and, for a
// protocol error, the error that ends the connection. s.mu is held.
func (s *Session) handle(req *Request) (string, error) {
	switch req.Kind {
	case Add:
		if !req.HasInfo {
			req.Netns.Close()
			err := protocolErrorf("AddWorkload %s: workload_info is required but not present", req.UID)
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
		if err := s.start(req.UID, req.Info, req.Netns); err != nil {
			return "failure to start proxy: " + err.Error(), nil
		}
		return "", nil
	case Keep:
		if s.synced {
			err := protocolErrorf("pod keep received after snapshot")
			return "failure to process message: " + err.Error(), err
		}
		s.snapshot[req.UID] = true
		return "", nil
	case Del:
		s.unpend(req.UID)
		if !s.synced {
			delete(s.snapshot, req.UID)
			return "", nil
		}
		s.handler.Stop(req.UID)
		return "", nil
	case SnapshotSent:
		if s.synced {
			err := protocolErrorf("pod snapshot received already")
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
