package gaterpc

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
)

// PeerCred is the identity of the process on the other end of a Unix socket, as
// the kernel reports it (SO_PEERCRED); it cannot be forged by the peer.
type PeerCred struct {
	PID, UID, GID int
}

// AuthType implements credentials.AuthInfo.
func (PeerCred) AuthType() string { return "peercred" }

// peerCredentials is a gRPC transport "security" that only learns who the peer is.
// It never rejects a connection itself: rejection happens per call in the
// interceptor, so the caller gets a PermissionDenied status that says why instead
// of an opaque closed connection.
type peerCredentials struct{}

// ServerCredentials returns transport credentials that attach the peer's
// SO_PEERCRED to every connection accepted on a Unix socket.
func ServerCredentials() credentials.TransportCredentials { return peerCredentials{} }

func (peerCredentials) ClientHandshake(_ context.Context, _ string, conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return conn, nil, nil
}

func (peerCredentials) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	cred, err := readPeerCred(conn)
	if err != nil {
		return nil, nil, err
	}
	return conn, cred, nil
}

func (peerCredentials) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: "peercred"}
}
func (p peerCredentials) Clone() credentials.TransportCredentials { return p }
func (peerCredentials) OverrideServerName(string) error           { return nil }

// PeerOf is the identity of the process on the other end of conn, a Unix
// socket: for a client, the process that listens. Its PID is as the caller's
// PID namespace sees it, 0 when the peer is outside it.
func PeerOf(conn net.Conn) (PeerCred, error) { return readPeerCred(conn) }

func readPeerCred(conn net.Conn) (PeerCred, error) {
	sc, ok := conn.(syscall.Conn)
	if !ok {
		return PeerCred{}, fmt.Errorf("peer credentials: connection %T is not a socket", conn)
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return PeerCred{}, fmt.Errorf("peer credentials: %w", err)
	}
	var ucred *unix.Ucred
	var credErr error
	if err := raw.Control(func(fd uintptr) {
		ucred, credErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return PeerCred{}, fmt.Errorf("peer credentials: %w", err)
	}
	if credErr != nil {
		return PeerCred{}, fmt.Errorf("peer credentials: getsockopt SO_PEERCRED: %w", credErr)
	}
	return PeerCred{PID: int(ucred.Pid), UID: int(ucred.Uid), GID: int(ucred.Gid)}, nil
}

// ErrPeerNotAllowed is the cause of a PermissionDenied answer.
var ErrPeerNotAllowed = errors.New("socket peer is not allowed")

// Authorizer admits callers by user id.
type Authorizer struct {
	allowedUIDs []int
}

// NewAuthorizer admits the given user ids; with none given only root (uid 0).
func NewAuthorizer(allowedUIDs []int) Authorizer {
	if len(allowedUIDs) == 0 {
		allowedUIDs = []int{0}
	}
	return Authorizer{allowedUIDs: slices.Clone(allowedUIDs)}
}

// Authorize returns nil when the context's peer is allowed.
func (a Authorizer) Authorize(ctx context.Context) error {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return fmt.Errorf("%w: no peer information", ErrPeerNotAllowed)
	}
	cred, ok := p.AuthInfo.(PeerCred)
	if !ok {
		return fmt.Errorf("%w: peer credentials unknown (not a Unix socket?)", ErrPeerNotAllowed)
	}
	if !slices.Contains(a.allowedUIDs, cred.UID) {
		return fmt.Errorf("%w: uid %d (pid %d) is not in the allowed uids %s", ErrPeerNotAllowed, cred.UID, cred.PID, formatUIDs(a.allowedUIDs))
	}
	return nil
}

func formatUIDs(uids []int) string {
	parts := make([]string, len(uids))
	for i, u := range uids {
		parts[i] = fmt.Sprint(u)
	}
	return "[" + strings.Join(parts, ",") + "]"
}

// UnaryInterceptor rejects calls from peers that are not allowed.
func (a Authorizer) UnaryInterceptor(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if err := a.Authorize(ctx); err != nil {
		return nil, status.Error(codes.PermissionDenied, err.Error())
	}
	return handler(ctx, req)
}

// StreamInterceptor rejects streams (the health Watch) from peers that are not allowed.
func (a Authorizer) StreamInterceptor(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	if err := a.Authorize(ss.Context()); err != nil {
		return status.Error(codes.PermissionDenied, err.Error())
	}
	return handler(srv, ss)
}

// NewServer is a gRPC server for one of the agent's Unix sockets: it learns each
// peer's SO_PEERCRED and refuses calls from users not in allowedUIDs (root only
// when empty) before any other interceptor or handler runs.
func NewServer(allowedUIDs []int, opts ...grpc.ServerOption) *grpc.Server {
	auth := NewAuthorizer(allowedUIDs)
	return grpc.NewServer(append([]grpc.ServerOption{
		grpc.Creds(ServerCredentials()),
		grpc.ChainUnaryInterceptor(auth.UnaryInterceptor),
		grpc.ChainStreamInterceptor(auth.StreamInterceptor),
	}, opts...)...)
}
