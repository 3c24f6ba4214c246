// Package ztunnel is a ZDS client that behaves as ztunnel's inpod module does,
// written from ztunnel's source (github.com/istio/ztunnel at commit
// 62d826530e5ce85764e309170205b293efcbc80b: proto/zds.proto,
// src/inpod/protocol.rs, src/inpod/workloadmanager.rs,
// src/inpod/statemanager.rs, src/inpod/packet.rs) and not from this
// repository's generated code: it encodes and decodes the messages by field
// number with protowire, so a mismatch between the agent's protobuf and
// ztunnel's would show here.
//
// What it does, as ztunnel does:
//   - connects a SOCK_SEQPACKET socket and sends ZdsHello{version: V1} first;
//   - reads each request with recvmsg into a 1,024-byte buffer and room for one
//     fd's control message, and rejects MSG_TRUNC and MSG_CTRUNC;
//   - accepts exactly one fd with an AddWorkload and none with anything else;
//   - requires workload_info in an AddWorkload;
//   - answers every request with one Ack (an error text for a refusal);
//   - follows the snapshot rules: pods named (Add, Keep) before SnapshotSent
//     are kept, a Del before it un-names a pod, everything else is dropped at
//     SnapshotSent; Keep after the snapshot and a second SnapshotSent are
//     protocol errors;
//   - on a request it cannot read it nacks, hangs up and connects again; on a
//     protocol error (no workload_info, Keep after the snapshot, a second
//     SnapshotSent) it nacks, hangs up and stops for good (Run returns it);
//   - a pod it cannot start is nacked, the connection stays, and the pod is
//     kept pending and tried again every 5 s until it starts, is deleted or
//     the connection ends (workloadmanager.rs RETRY_DURATION);
//   - serves a pod only as a workload istiod has on its node (WDS, wds.go)
//     whose name, namespace and service account are the ones ZDS gave: each
//     of the pod's connections and DNS queries waits up to 5 s for it and is
//     refused without it, and the pod is served under that workload's trust
//     domain with ZDS's namespace and service account as its identity.
//
// Beyond ztunnel, as a conformance check: with RequireServiceAccount an
// AddWorkload whose service_account is empty is a deviation. ztunnel itself
// acks such a pod and then cannot serve it (it finds the workload, and builds
// the SPIFFE identity spiffe://<td>/ns/<ns>/sa/<sa>, from the service
// account), so the agent must never send one to a real ztunnel.
package ztunnel

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/mesh-cni/mesh-cni/test/pbwire"
)

// ReadBuffer is the size of ztunnel's read buffer for one request
// (protocol.rs read_message: vec![0u8; 1024]).
const ReadBuffer = 1024

// ErrDeviation is wrapped by every error about the agent not behaving as
// ztunnel requires.
var ErrDeviation = errors.New("agent deviates from what ztunnel accepts")

func deviationf(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrDeviation, fmt.Sprintf(format, args...))
}

// ErrProtocol is wrapped by the deviations ztunnel takes for a protocol
// mismatch (statemanager.rs Error::ProtocolError): it stops its workload
// manager instead of connecting again, since an agent that speaks another
// protocol would only be sent more of what it cannot read.
var ErrProtocol = fmt.Errorf("%w: protocol error", ErrDeviation)

func protocolErrorf(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrProtocol, fmt.Sprintf(format, args...))
}

// Field numbers of proto/zds.proto.
const (
	helloVersion = 1 // ZdsHello.version (enum Version: V1 = 1)
	versionV1    = 1

	reqAdd          = 1 // WorkloadRequest.payload oneof
	reqDel          = 2
	reqSnapshotSent = 3
	reqKeep         = 5

	addUID          = 1 // AddWorkload
	addWorkloadInfo = 2
	infoName        = 1 // WorkloadInfo; 4 is reserved (trust_domain)
	infoNamespace   = 2
	infoSA          = 3
	keepUID         = 1 // KeepWorkload
	delUID          = 2 // DelWorkload

	respAck  = 1 // WorkloadResponse.payload oneof
	ackError = 1 // Ack.error
)

// Kind is the kind of a request.
type Kind int

// Request kinds.
const (
	Add Kind = iota + 1
	Keep
	Del
	SnapshotSent
)

func (k Kind) String() string {
	switch k {
	case Add:
		return "AddWorkload"
	case Keep:
		return "KeepWorkload"
	case Del:
		return "DelWorkload"
	case SnapshotSent:
		return "SnapshotSent"
	}
	return "unknown"
}

// WorkloadInfo is what an AddWorkload says about the pod.
type WorkloadInfo struct {
	Name, Namespace, ServiceAccount string
}

// Request is one decoded request. Netns is the fd of an Add; the receiver owns
// it.
type Request struct {
	Kind Kind
	UID  string
	Info WorkloadInfo // Add only
	// HasInfo tells an Add with an empty workload_info from one without it.
	HasInfo bool
	Netns   *os.File
}

// Conn is one connection to the agent.
type Conn struct {
	uc *net.UnixConn
}

// Dial connects to the agent's ZDS socket (SOCK_SEQPACKET, as packet.rs does).
func Dial(ctx context.Context, path string) (*Conn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unixpacket", path)
	if err != nil {
		return nil, fmt.Errorf("connect to zds socket %s: %w", path, err)
	}
	return &Conn{uc: c.(*net.UnixConn)}, nil
}

// Close closes the connection.
func (c *Conn) Close() error { return c.uc.Close() }

// Hello announces version V1; ztunnel sends it before reading anything.
func (c *Conn) Hello() error {
	b := protowire.AppendTag(nil, helloVersion, protowire.VarintType)
	b = protowire.AppendVarint(b, versionV1)
	return c.send(b)
}

// Ack answers the current request; a non-empty msg is a refusal.
func (c *Conn) Ack(msg string) error {
	var ack []byte
	if msg != "" {
		ack = protowire.AppendTag(ack, ackError, protowire.BytesType)
		ack = protowire.AppendString(ack, msg)
	}
	// prost writes the oneof's message even when it is empty: 0x0a 0x00.
	b := protowire.AppendTag(nil, respAck, protowire.BytesType)
	b = protowire.AppendBytes(b, ack)
	return c.send(b)
}

func (c *Conn) send(b []byte) error {
	if err := c.uc.SetWriteDeadline(time.Now().Add(5 * time.Second)); err != nil {
		return err
	}
	n, _, err := c.uc.WriteMsgUnix(b, nil, nil)
	if err != nil {
		return fmt.Errorf("send to agent: %w", err)
	}
	if n != len(b) {
		return fmt.Errorf("short write to agent: %d of %d bytes", n, len(b))
	}
	return nil
}

// Recv reads one request until ctx ends. The agent's close is io.EOF. A packet
// ztunnel could not read is an error wrapping ErrDeviation; any fds it carried
// are closed.
func (c *Conn) Recv(ctx context.Context) (*Request, error) {
	if err := c.uc.SetReadDeadline(time.Time{}); err != nil {
		return nil, err
	}
	stop := context.AfterFunc(ctx, func() { _ = c.uc.SetReadDeadline(time.Now()) })
	buf := make([]byte, ReadBuffer)
	// nix::cmsg_space!(RawFd): room for exactly one fd.
	oob := make([]byte, unix.CmsgSpace(4))
	n, oobn, flags, _, err := c.uc.ReadMsgUnix(buf, oob)
	if !stop() && ctx.Err() != nil {
		return nil, ctx.Err()
	}
	if err != nil {
		return nil, err
	}
	if n == 0 {
		return nil, io.EOF
	}
	fds, ferr := rights(oob[:oobn])
	var netns *os.File
	if len(fds) == 1 {
		netns = os.NewFile(uintptr(fds[0]), "zds-netns")
	}
	fail := func(err error) (*Request, error) {
		if netns != nil {
			netns.Close()
		}
		return nil, err
	}
	switch {
	case ferr != nil:
		return fail(ferr)
	case flags&unix.MSG_TRUNC != 0:
		return fail(deviationf("received truncated message (over %d bytes)", ReadBuffer))
	case flags&unix.MSG_CTRUNC != 0:
		return fail(deviationf("received truncated control message (more than one fd)"))
	}
	req, err := decodeRequest(buf[:n])
	if err != nil {
		return fail(err)
	}
	switch {
	case req.Kind == Add && netns == nil:
		return fail(deviationf("AddWorkload %s without a netns fd (No control message)", req.UID))
	case req.Kind != Add && netns != nil:
		return fail(deviationf("%s carries an fd (Unexpected control message)", req.Kind))
	}
	req.Netns = netns
	return req, nil
}

// rights returns the fds in SCM_RIGHTS; more than one in total is an error
// (protocol.rs maybe_get_fd), and they are closed.
func rights(oob []byte) ([]int, error) {
	if len(oob) == 0 {
		return nil, nil
	}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, deviationf("control message: %v", err)
	}
	var fds []int
	for i := range msgs {
		if msgs[i].Header.Level != unix.SOL_SOCKET || msgs[i].Header.Type != unix.SCM_RIGHTS {
			continue
		}
		got, err := unix.ParseUnixRights(&msgs[i])
		if err != nil {
			return nil, deviationf("SCM_RIGHTS: %v", err)
		}
		fds = append(fds, got...)
	}
	if len(fds) > 1 {
		for _, fd := range fds {
			unix.Close(fd)
		}
		return nil, deviationf("expected 1 fd, got %d", len(fds))
	}
	return fds, nil
}

// decodeRequest decodes a WorkloadRequest as prost does: unknown fields are
// skipped, a known field with the wrong wire type is an error, and of the
// oneof's members the last one wins.
func decodeRequest(b []byte) (*Request, error) {
	var req *Request
	err := fields(b, "WorkloadRequest", []protowire.Number{reqAdd, reqDel, reqSnapshotSent, reqKeep}, func(num protowire.Number, v []byte) error {
		var kind Kind
		switch num {
		case reqAdd:
			kind = Add
		case reqDel:
			kind = Del
		case reqSnapshotSent:
			kind = SnapshotSent
		case reqKeep:
			kind = Keep
		default:
			return nil
		}
		r := &Request{Kind: kind}
		known := map[Kind][]protowire.Number{Add: {addUID, addWorkloadInfo}, Keep: {keepUID}, Del: {delUID}}[kind]
		err := fields(v, kind.String(), known, func(num protowire.Number, v []byte) error {
			switch {
			case kind == Add && num == addUID, kind == Keep && num == keepUID, kind == Del && num == delUID:
				r.UID = string(v)
			case kind == Add && num == addWorkloadInfo:
				r.HasInfo = true
				return fields(v, "WorkloadInfo", []protowire.Number{infoName, infoNamespace, infoSA}, func(num protowire.Number, v []byte) error {
					switch num {
					case infoName:
						r.Info.Name = string(v)
					case infoNamespace:
						r.Info.Namespace = string(v)
					case infoSA:
						r.Info.ServiceAccount = string(v)
					}
					return nil
				})
			}
			return nil
		})
		req = r
		return err
	})
	if err != nil {
		return nil, err
	}
	if req == nil {
		return nil, deviationf("no payload")
	}
	return req, nil
}

// fields calls fn for every length-delimited field of the message b. The
// fields named in known are all strings or messages in zds.proto: one of them
// with another wire type is an error, as in prost; unknown fields are skipped.
func fields(b []byte, what string, known []protowire.Number, fn func(protowire.Number, []byte) error) error {
	err := pbwire.Walk(b, func(num protowire.Number, typ protowire.Type, v []byte, _ uint64) error {
		if typ != protowire.BytesType {
			if slices.Contains(known, num) {
				return deviationf("decode %s: field %d has wire type %d, want length-delimited", what, num, typ)
			}
			return nil
		}
		return fn(num, v)
	})
	if err != nil && !errors.Is(err, ErrDeviation) {
		return deviationf("decode %s: %v", what, err)
	}
	return err
}
