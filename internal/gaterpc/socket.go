package gaterpc

import (
	"context"
	"errors"
	"net"
	"sync"

	"github.com/mesh-cni/mesh-cni/internal/unixsock"
)

// Listen creates the gate's Unix socket at path (also used for the KNI and hook
// sockets), mode 0600 from the moment it exists, so only root reaches it
// through the filesystem; SO_PEERCRED checks come on top. A missing parent
// directory is created 0700; an existing one is never changed, and refused if
// anyone may replace entries in it (see unixsock.Listen).
//
// A socket file left behind by a crashed agent is replaced, but only after
// checking that nobody answers on it: a second agent must never steal the socket
// of a running one. A path that exists and is not a socket is never removed.
// Closing the listener removes the socket file while it is still this one.
func Listen(ctx context.Context, path string) (net.Listener, error) {
	l, id, err := unixsock.Listen(ctx, "unix", path)
	if err != nil {
		return nil, err
	}
	return &listener{UnixListener: l, path: path, id: id}, nil
}

// ListenTakingOver is Listen for a server that hands its socket to a
// successor started before it stops: a socket at path is replaced even while
// someone answers on it (see unixsock.ListenTakingOver). The server it
// replaced finds out with Superseded.
func ListenTakingOver(ctx context.Context, path string) (net.Listener, error) {
	l, id, err := unixsock.ListenTakingOver(ctx, "unix", path)
	if err != nil {
		return nil, err
	}
	return &listener{UnixListener: l, path: path, id: id}, nil
}

// Superseded reports whether another listener took l's socket path over (l
// from Listen or ListenTakingOver). A path that was removed is not: nobody
// serves there.
func Superseded(l net.Listener) (bool, error) {
	ours, ok := l.(*listener)
	if !ok {
		return false, errors.New("not a listener of this package")
	}
	return unixsock.Replaced(ours.path, ours.id)
}

// listener reports the socket's final path (it was bound under a temporary
// one) and removes it on Close.
type listener struct {
	*net.UnixListener
	path string
	id   unixsock.ID
	once sync.Once
	err  error
}

func (l *listener) Addr() net.Addr { return &net.UnixAddr{Name: l.path, Net: "unix"} }

func (l *listener) Close() error {
	l.once.Do(func() {
		l.err = l.UnixListener.Close()
		if err := unixsock.RemoveIfOurs(l.path, l.id); err != nil && l.err == nil {
			l.err = err
		}
	})
	return l.err
}
