// Package zds is the node agent's side of ZDS, the protocol with which a node
// proxy such as Istio's ztunnel receives the pods it serves (see zdspb/zds.proto):
// the agent listens on a SOCK_SEQPACKET Unix socket, the proxy connects and says
// hello, and the agent hands it each enrolled pod's network namespace as a file
// descriptor, so the proxy can open its listeners inside the pod.
//
// Each new connection gets a snapshot of every enrolled pod, then SnapshotSent;
// after that, new pods go to the newest connection (the proxy that replaced an
// older one during an upgrade) and deletions to every connection that has the
// pod. Every request waits for the proxy's ack under a deadline. A connection
// that misbehaves (garbage, fds where none belong, a missed
// deadline, an early close) is closed on its own; the others carry on.
package zds

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/mesh-cni/mesh-cni/internal/unixsock"
	"github.com/mesh-cni/mesh-cni/pkg/zds/zdspb"
)

const (
	// DefaultSocketPath is where ztunnel looks for the agent.
	DefaultSocketPath = "/var/run/ztunnel/ztunnel.sock"
	// DefaultAckTimeout bounds the hello, each write and each ack (ztunnel's
	// reference agent uses the same).
	DefaultAckTimeout = 5 * time.Second
	// DefaultLivenessInterval is how often an idle connection is checked.
	DefaultLivenessInterval = 5 * time.Second
)

var (
	// ErrNoProxy is returned by AddPod when no proxy is connected.
	ErrNoProxy = errors.New("no proxy connected to the zds socket")
	// ErrServerClosed is returned once the server has been closed.
	ErrServerClosed = errors.New("zds server closed")
)

// Pod is an enrolled pod as the proxy is told about it.
type Pod struct {
	// UID is the pod's Kubernetes UID, the proxy's key for it. Required.
	UID string
	// Name, Namespace and ServiceAccount identify the workload to the proxy.
	Name, Namespace, ServiceAccount string
	// NetnsPath is the pod's network namespace (a bind mount or /proc/PID/ns/net).
	NetnsPath string
	// NetnsCookie, when set, is the cookie of the namespace the agent enrolled:
	// the server hands over the namespace at NetnsPath only while it is that
	// one, so a path reused by another pod's namespace (after a node crash, or
	// swapped) is never given to the proxy as this pod's.
	NetnsCookie uint64
	// Netns, when set, is the namespace at NetnsPath already opened by the
	// caller for the request it is part of: AddPod and AddPodWait hand over a
	// duplicate of it instead of opening the path again (the cookie check
	// applies to it all the same). The caller keeps and closes it.
	Netns *os.File
	// Keep, in a snapshot, sends the pod as KeepWorkload: the proxy keeps
	// whatever it runs for the uid (a pod another node agent handed it, which
	// this one is about to take over) instead of dropping it at
	// SnapshotSent, and the pod's AddWorkload follows. Only UID is used.
	Keep bool
}

func (p Pod) check() error {
	if p.UID == "" {
		return errors.New("pod has no uid")
	}
	return nil
}

// Snapshotter lists the pods currently enrolled, for the snapshot every new
// connection starts with. The agent supplies it. A pod must appear in the list
// before AddPod is called for it and be gone from it before DelPod is called, so
// that a proxy connecting at any moment misses nothing.
type Snapshotter interface {
	EnrolledPods(ctx context.Context) ([]Pod, error)
}

// SnapshotFunc adapts a function to Snapshotter.
type SnapshotFunc func(ctx context.Context) ([]Pod, error)

// EnrolledPods calls f.
func (f SnapshotFunc) EnrolledPods(ctx context.Context) ([]Pod, error) { return f(ctx) }

// AckError is a proxy's refusal of a request: an Ack with a non-empty error.
type AckError struct {
	UID     string
	Request string // "add", "keep" or "delete"
	Msg     string
}

func (e *AckError) Error() string {
	return fmt.Sprintf("proxy refused %s of pod %s: %s", e.Request, e.UID, e.Msg)
}

// Config configures a Server.
type Config struct {
	// SocketPath is the socket to listen on; empty means DefaultSocketPath.
	SocketPath string
	// AckTimeout bounds a proxy's hello and each request's write plus ack; 0 means
	// DefaultAckTimeout. A proxy that misses it is disconnected.
	AckTimeout time.Duration
	// LivenessInterval is how often an idle connection is checked for a closed
	// peer; 0 means DefaultLivenessInterval.
	LivenessInterval time.Duration
	// Snapshot lists the enrolled pods. Required.
	Snapshot Snapshotter
	// Logger receives the server's logs; nil discards them.
	Logger *zap.Logger
	// AllowedUIDs are the user ids a proxy may connect as (checked with
	// SO_PEERCRED before anything is sent): every connection is handed the network
	// namespace of every enrolled pod. Empty means root only.
	AllowedUIDs []int
	// ProxiesChanged, when set, is called with the process ids of the connected
	// proxies whenever they change: after a proxy is accepted and before it is
	// sent any pod (so it can be told apart from the pods before it acts in
	// them), and after one disconnects. It runs on the connection's goroutine;
	// an error refuses the new proxy.
	ProxiesChanged func(pids []int32) error
}

// Server is the agent's ZDS server. Its methods are safe for concurrent use.
type Server struct {
	cfg    Config
	log    *zap.Logger
	ln     *net.UnixListener
	sockID unixsock.ID

	// ctx ends with Close and bounds every connection's work.
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex
	conns   []*conn // past their hello, oldest first
	nextID  uint64
	ever    bool
	serving bool
	closed  bool
	changed chan struct{} // closed and replaced whenever conns or their readiness change

	proxiesMu sync.Mutex // serializes ProxiesChanged calls

	closeOnce sync.Once
	closeErr  error
}

// NewServer creates the socket (see Serve for what happens on it). The socket's
// parent directory is created 0700 if missing, the socket is 0600, and a socket
// left by a dead agent is replaced, a live one never. ctx bounds only this setup.
func NewServer(ctx context.Context, cfg Config) (*Server, error) {
	if cfg.Snapshot == nil {
		return nil, errors.New("zds: Config.Snapshot is required")
	}
	if cfg.SocketPath == "" {
		cfg.SocketPath = DefaultSocketPath
	}
	if cfg.AckTimeout <= 0 {
		cfg.AckTimeout = DefaultAckTimeout
	}
	if cfg.LivenessInterval <= 0 {
		cfg.LivenessInterval = DefaultLivenessInterval
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	// Socket 0600 and directory 0700 (or as found), both root's: ztunnel as
	// Istio's chart runs it is uid 0 with only NET_ADMIN, SYS_ADMIN and
	// NET_RAW (no CAP_DAC_OVERRIDE), so it connects as their owner
	// (test/ztunnel checks an agent-made and a kubelet-made directory).
	ln, id, err := unixsock.Listen(ctx, "unixpacket", cfg.SocketPath)
	if err != nil {
		return nil, err
	}
	s := &Server{
		cfg:     cfg,
		log:     cfg.Logger.With(zap.String("socket", cfg.SocketPath)),
		ln:      ln,
		sockID:  id,
		changed: make(chan struct{}),
	}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	return s, nil
}

// Serve accepts proxy connections until ctx ends or Close is called, then closes
// the server and returns. Connections are served concurrently.
func (s *Server) Serve(ctx context.Context) error {
	s.mu.Lock()
	switch {
	case s.closed:
		s.mu.Unlock()
		return ErrServerClosed
	case s.serving:
		s.mu.Unlock()
		return errors.New("zds: Serve called twice")
	}
	s.serving = true
	s.mu.Unlock()

	stop := context.AfterFunc(ctx, func() { _ = s.Close() })
	defer stop()
	s.log.Info("zds server listening")
	// Accept errors (out of fds and the like) are waited out rather than spun
	// on: doubling from 5 ms up to a second, afresh after each accept.
	acceptRetry := wait.Backoff{Duration: 5 * time.Millisecond, Factor: 2, Cap: time.Second, Steps: math.MaxInt32}
	delay := acceptRetry.DelayFunc()
	for {
		uc, err := s.ln.AcceptUnix()
		if err != nil {
			if s.isClosed() {
				break
			}
			s.log.Warn("accept proxy connection", zap.Error(err))
			select {
			case <-s.ctx.Done():
			case <-time.After(delay()):
			}
			continue
		}
		delay = acceptRetry.DelayFunc()
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			uc.Close()
			break
		}
		s.nextID++
		id := s.nextID
		s.wg.Add(1)
		s.mu.Unlock()
		go s.handle(id, uc)
	}
	return s.Close()
}

// Close stops accepting, closes every connection, waits for their handlers and
// removes the socket file if it is still this server's. Proxies keep their
// workloads and reconnect to the next server. Close is safe to call more than once.
func (s *Server) Close() error {
	s.closeOnce.Do(func() {
		s.mu.Lock()
		s.closed = true
		conns := slices.Clone(s.conns)
		s.notifyLocked()
		s.mu.Unlock()
		s.cancel()
		var errs []error
		if err := s.ln.Close(); err != nil && !errors.Is(err, net.ErrClosed) {
			errs = append(errs, fmt.Errorf("close zds listener: %w", err))
		}
		for _, c := range conns {
			c.close()
		}
		s.wg.Wait()
		errs = append(errs, unixsock.RemoveIfOurs(s.cfg.SocketPath, s.sockID))
		s.closeErr = errors.Join(errs...)
	})
	return s.closeErr
}

// Connected returns the number of connected proxies that have received their
// snapshot.
func (s *Server) Connected() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, c := range s.conns {
		if c.ready && !c.isClosed() {
			n++
		}
	}
	return n
}

// EverConnected reports whether any proxy has ever received its snapshot from
// this server. The agent uses it to decide whether pod starts wait for the proxy.
func (s *Server) EverConnected() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ever
}

// WaitForProxy waits until a connected proxy has received its snapshot.
func (s *Server) WaitForProxy(ctx context.Context) error {
	for {
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			return ErrServerClosed
		}
		for _, c := range s.conns {
			if c.ready && !c.isClosed() {
				s.mu.Unlock()
				return nil
			}
		}
		changed := s.changed
		s.mu.Unlock()
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for a proxy on %s: %w", s.cfg.SocketPath, ctx.Err())
		case <-changed:
		}
	}
}

// AddPod hands pod to the newest proxy connection and returns once that proxy
// acked it. With no proxy connected it returns ErrNoProxy at once. If the chosen
// connection breaks (a missed ack deadline, say), the next newest is tried, and
// when none is left the error wraps both ErrNoProxy and what broke. A proxy's refusal is an *AckError.
// A connection still receiving its snapshot counts: AddPod then waits for the
// snapshot to finish, and skips the send when the snapshot already carried the
// pod. ctx bounds waiting for the connection; a request already sent is bounded
// by the ack deadline instead, to keep the connection's pairing intact.
func (s *Server) AddPod(ctx context.Context, pod Pod) error {
	return s.addPod(ctx, pod, false)
}

// AddPodWait is AddPod that, when no proxy is connected or the connection breaks,
// waits (bounded by ctx) for the next proxy instead of failing. A pod enrolled
// before the proxy connects is in that connection's snapshot, so it is not sent
// twice. The agent uses it to hold a pod's start until its proxy listeners exist.
func (s *Server) AddPodWait(ctx context.Context, pod Pod) error {
	return s.addPod(ctx, pod, true)
}

func (s *Server) addPod(ctx context.Context, pod Pod, wait bool) error {
	if err := pod.check(); err != nil {
		return err
	}
	req := addRequest(pod)
	if size := proto.Size(req); size > MaxRequestSize {
		return fmt.Errorf("pod %s: AddWorkload would be %d bytes, over the %d a proxy accepts", pod.UID, size, MaxRequestSize)
	}
	fd, id, err := openPodNetns(pod)
	if err != nil {
		return fmt.Errorf("pod %s: %w", pod.UID, err)
	}
	defer unix.Close(fd)
	var lost error // the last connection that broke under this add
	for {
		c, changed, err := s.newest()
		if err != nil {
			return err
		}
		if c == nil {
			if !wait {
				return errors.Join(ErrNoProxy, lost)
			}
			select {
			case <-ctx.Done():
				err := fmt.Errorf("pod %s: waiting for a proxy on %s: %w", pod.UID, s.cfg.SocketPath, ctx.Err())
				if lost != nil {
					// Say why there was no proxy left: the operator's clue.
					err = fmt.Errorf("%w; the proxy it was sent to broke: %w", err, lost)
				}
				return err
			case <-changed:
				continue
			}
		}
		err = s.addTo(ctx, c, pod, req, fd, id)
		var ce *connError
		if errors.As(err, &ce) && ctx.Err() == nil {
			s.log.Info("proxy connection lost while adding pod, trying the next", zap.String("uid", pod.UID), zap.Error(err))
			lost = err
			continue
		}
		return err
	}
}

func (s *Server) addTo(ctx context.Context, c *conn, pod Pod, req *zdspb.WorkloadRequest, fd int, id NetnsID) error {
	if err := c.acquire(ctx); err != nil {
		return err
	}
	defer c.release()
	if err := c.addPod(pod, req, fd, id); err != nil {
		return err
	}
	c.log.Debug("proxy acked pod", zap.String("uid", pod.UID))
	return nil
}

// DelPod tells every connected proxy that has the pod to release it and returns
// once they acked. With no proxy connected, or none that has the pod, it returns
// nil at once. A connection that breaks meanwhile is not an error: its proxy's
// next snapshot no longer lists the pod. Refusals are returned as *AckError;
// the agent should log them, not fail the pod's deletion.
func (s *Server) DelPod(ctx context.Context, uid string) error {
	if uid == "" {
		return errors.New("pod has no uid")
	}
	s.mu.Lock()
	conns := slices.Clone(s.conns)
	s.mu.Unlock()
	errs := make([]error, len(conns))
	var wg sync.WaitGroup
	for i, c := range conns {
		wg.Go(func() {
			err := c.delPod(ctx, uid)
			var ce *connError
			if errors.As(err, &ce) {
				c.log.Info("proxy connection lost while deleting pod", zap.String("uid", uid), zap.Error(err))
				err = nil
			}
			errs[i] = err
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// newest returns the newest open connection, or nil and a channel that is closed
// at the next change.
func (s *Server) newest() (*conn, <-chan struct{}, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, nil, ErrServerClosed
	}
	for i := len(s.conns) - 1; i >= 0; i-- {
		if !s.conns[i].isClosed() {
			return s.conns[i], nil, nil
		}
	}
	return nil, s.changed, nil
}

func (s *Server) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

func (s *Server) notifyLocked() {
	close(s.changed)
	s.changed = make(chan struct{})
}

func (s *Server) handle(id uint64, uc *net.UnixConn) {
	defer s.wg.Done()
	log := s.log.With(zap.Uint64("conn", id))
	c := newConn(id, uc, s.cfg.AckTimeout, log)
	defer c.close()
	stop := context.AfterFunc(s.ctx, c.close)
	defer stop()
	cred, err := peerCred(uc)
	if err != nil {
		log.Warn("rejected proxy connection: peer credentials unknown", zap.Error(err))
		return
	}
	log = log.With(zap.Int32("peer_pid", cred.Pid), zap.Uint32("peer_uid", cred.Uid))
	c.log = log
	if !s.uidAllowed(int(cred.Uid)) {
		log.Warn("rejected proxy connection: peer uid is not allowed", zap.Ints("allowedUIDs", s.allowedUIDs()))
		return
	}
	version, err := c.readHello()
	if err != nil {
		log.Warn("rejected proxy connection", zap.Error(err))
		return
	}
	log = log.With(zap.Stringer("version", version))
	c.log = log
	if version != zdspb.Version_V1 {
		log.Info("proxy announced a ZDS version other than V1; serving it V1, as Istio's node agent does")
	}
	log.Info("proxy connected")
	c.pid = cred.Pid
	if !s.register(c) {
		return
	}
	defer s.unregister(c)
	if err := s.proxiesChanged(); err != nil {
		log.Error("proxy refused: it cannot be told apart from the pods", zap.Error(err))
		return
	}
	if err := s.sendSnapshot(c); err != nil {
		log.Warn("snapshot to proxy failed, closing its connection", zap.Error(err))
		return
	}
	c.watch(s.ctx, s.cfg.LivenessInterval)
	log.Info("proxy disconnected")
}

// register makes c the newest connection. It happens before the snapshot is
// listed, so a pod enrolled at any moment is either in the snapshot or sent by an
// AddPod that chose c (and queued behind the snapshot).
func (s *Server) register(c *conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.conns = append(s.conns, c)
	s.notifyLocked()
	return true
}

func (s *Server) unregister(c *conn) {
	c.close()
	s.mu.Lock()
	s.conns = slices.DeleteFunc(s.conns, func(x *conn) bool { return x == c })
	s.notifyLocked()
	closed := s.closed || s.ctx.Err() != nil
	s.mu.Unlock()
	if closed {
		// The agent is stopping, not the proxy: the proxy keeps serving its
		// pods, so its identity stays where it was last reported until the
		// next agent learns it again.
		return
	}
	if err := s.proxiesChanged(); err != nil {
		s.log.Warn("update the proxies after a disconnect", zap.Error(err))
	}
}

// proxiesChanged reports the connected proxies' process ids to ProxiesChanged.
// Calls are serialized so that the last set reported is the current one.
func (s *Server) proxiesChanged() error {
	if s.cfg.ProxiesChanged == nil {
		return nil
	}
	s.proxiesMu.Lock()
	defer s.proxiesMu.Unlock()
	s.mu.Lock()
	pids := make([]int32, 0, len(s.conns))
	for _, c := range s.conns {
		pids = append(pids, c.pid)
	}
	s.mu.Unlock()
	return s.cfg.ProxiesChanged(pids)
}

func (s *Server) markReady(c *conn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c.ready = true
	s.ever = true
	s.notifyLocked()
}

// sendSnapshot sends every enrolled pod, then SnapshotSent, and marks c ready
// when the proxy acked that. A pod whose netns
// cannot be opened is sent as KeepWorkload (the proxy keeps what it has for it);
// a pod the proxy refuses is logged and the snapshot goes on, as a broken pod must
// not keep the proxy from the others.
func (s *Server) sendSnapshot(c *conn) error {
	if err := c.acquire(s.ctx); err != nil {
		return err
	}
	defer c.release()
	pods, err := s.cfg.Snapshot.EnrolledPods(s.ctx)
	if err != nil {
		return fmt.Errorf("list enrolled pods: %w", err)
	}
	var added, kept, refused int
	for _, pod := range pods {
		log := c.log.With(zap.String("uid", pod.UID), zap.String("pod", pod.Namespace+"/"+pod.Name))
		if err := pod.check(); err != nil {
			log.Error("enrolled pod left out of the snapshot", zap.Error(err))
			continue
		}
		var err error
		if pod.Keep {
			err = c.keepPod(pod.UID)
			if err == nil {
				err = errKept
			}
		} else {
			err = s.snapshotPod(c, pod)
		}
		var ae *AckError
		switch {
		case errors.As(err, &ae):
			refused++
			log.Error("proxy refused pod in snapshot", zap.Error(err))
		case errors.Is(err, errKept):
			kept++
		case err != nil && isConnErr(err):
			return err
		case err != nil:
			log.Error("enrolled pod left out of the snapshot", zap.Error(err))
		default:
			added++
		}
	}
	ackErr, err := c.request(&zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_SnapshotSent{SnapshotSent: &zdspb.SnapshotSent{}}}, -1)
	if err != nil {
		return err
	}
	if ackErr != "" {
		return fmt.Errorf("proxy refused SnapshotSent: %s", ackErr)
	}
	c.log.Info("snapshot sent", zap.Int("added", added), zap.Int("kept", kept), zap.Int("refused", refused))
	// Ready before the connection is released: once an AddPod can use it, it
	// counts as connected, however late this goroutine runs again.
	s.markReady(c)
	return nil
}

// errKept reports that a snapshot pod went out as KeepWorkload.
var errKept = errors.New("sent as keep")

func (s *Server) snapshotPod(c *conn, pod Pod) error {
	req := addRequest(pod)
	if size := proto.Size(req); size > MaxRequestSize {
		return fmt.Errorf("AddWorkload would be %d bytes, over the %d a proxy accepts", size, MaxRequestSize)
	}
	fd, id, err := openPodNetns(pod)
	if err != nil {
		c.log.Warn("cannot open pod netns, sending KeepWorkload", zap.String("uid", pod.UID), zap.Error(err))
		if err := c.keepPod(pod.UID); err != nil {
			return err
		}
		return errKept
	}
	defer unix.Close(fd)
	return c.addPod(pod, req, fd, id)
}

func isConnErr(err error) bool {
	var ce *connError
	return errors.As(err, &ce)
}

func addRequest(pod Pod) *zdspb.WorkloadRequest {
	return &zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Add{Add: &zdspb.AddWorkload{
		Uid: pod.UID,
		WorkloadInfo: &zdspb.WorkloadInfo{
			Name:           pod.Name,
			Namespace:      pod.Namespace,
			ServiceAccount: pod.ServiceAccount,
		},
	}}}
}

func (s *Server) allowedUIDs() []int {
	if len(s.cfg.AllowedUIDs) == 0 {
		return []int{0}
	}
	return s.cfg.AllowedUIDs
}

func (s *Server) uidAllowed(uid int) bool {
	for _, u := range s.allowedUIDs() {
		if u == uid {
			return true
		}
	}
	return false
}
