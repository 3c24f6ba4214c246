package zds

import (
	"errors"
	"testing"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/mesh-cni/mesh-cni/pkg/zds/zdspb"
)

func mustMarshal(t testing.TB, m proto.Message) []byte {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func ackBytes(t testing.TB, msg string) []byte {
	return mustMarshal(t, &zdspb.WorkloadResponse{Payload: &zdspb.WorkloadResponse_Ack{Ack: &zdspb.Ack{Error: msg}}})
}

func helloBytes(t testing.TB, v zdspb.Version) []byte {
	return mustMarshal(t, &zdspb.ZdsHello{Version: v})
}

// TestHandlePacket covers the server's reading of proxy packets. The fds in these
// control messages are plain numbers that are never closed: handlePacket only
// returns them.
func TestHandlePacket(t *testing.T) {
	rights := unix.UnixRights(1000, 1001)
	for _, tc := range []struct {
		name    string
		st      stage
		data    []byte
		oob     []byte
		flags   int
		wantAck string
		wantFds int
		wantErr bool
	}{
		{name: "hello v1", st: expectHello, data: helloBytes(t, zdspb.Version_V1)},
		// Any version is served, as Istio's node agent does (see decodeHello).
		{name: "hello v0", st: expectHello, data: helloBytes(t, zdspb.Version_NOT_USED)},
		{name: "hello v2", st: expectHello, data: helloBytes(t, zdspb.Version(2))},
		{name: "hello garbage", st: expectHello, data: []byte{0xff, 0xff, 0xff}, wantErr: true},
		{name: "hello with fds", st: expectHello, data: helloBytes(t, zdspb.Version_V1), oob: rights, wantFds: 2, wantErr: true},
		{name: "hello truncated", st: expectHello, data: helloBytes(t, zdspb.Version_V1), flags: unix.MSG_TRUNC, wantErr: true},
		{name: "ack", st: expectAck, data: ackBytes(t, "")},
		{name: "nack", st: expectAck, data: ackBytes(t, "no room"), wantAck: "no room"},
		{name: "response without ack", st: expectAck, data: mustMarshal(t, &zdspb.WorkloadResponse{}), wantErr: true},
		{name: "ack garbage", st: expectAck, data: []byte{0x0a, 0x05, 0x01}, wantErr: true},
		{name: "ack with fds", st: expectAck, data: ackBytes(t, ""), oob: rights, wantFds: 2, wantErr: true},
		{name: "ack ctrunc", st: expectAck, data: ackBytes(t, ""), flags: unix.MSG_CTRUNC, wantErr: true},
		{name: "ack bad control data", st: expectAck, data: ackBytes(t, ""), oob: unix.UnixRights(1000)[:18], wantErr: true},
		// A hello is a valid ack message as far as protobuf goes (field 1 varint
		// vs. field 1 message): it must not be taken for one.
		{name: "hello as ack", st: expectAck, data: helloBytes(t, zdspb.Version_V1), wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ack, fds, err := handlePacket(tc.st, tc.data, tc.oob, tc.flags)
			if (err != nil) != tc.wantErr {
				t.Fatalf("err = %v, want error %v", err, tc.wantErr)
			}
			if err != nil && !errors.Is(err, ErrProtocol) {
				t.Errorf("error %v does not wrap ErrProtocol", err)
			}
			if ack != tc.wantAck || len(fds) != tc.wantFds {
				t.Errorf("ack %q fds %v, want %q and %d fds", ack, fds, tc.wantAck, tc.wantFds)
			}
		})
	}
}

func TestParseRequest(t *testing.T) {
	add := mustMarshal(t, &zdspb.WorkloadRequest{Payload: &zdspb.WorkloadRequest_Add{Add: &zdspb.AddWorkload{Uid: "u1"}}})
	req, fds, err := parseRequest(add, unix.UnixRights(1000), 0)
	if err != nil || req.GetAdd().GetUid() != "u1" || len(fds) != 1 || fds[0] != 1000 {
		t.Fatalf("add: %v %v %v", req, fds, err)
	}
	if _, _, err := parseRequest(nil, nil, 0); !errors.Is(err, ErrProtocol) {
		t.Errorf("empty request: %v", err)
	}
	if _, _, err := parseRequest(add, nil, unix.MSG_TRUNC); !errors.Is(err, ErrProtocol) {
		t.Errorf("truncated request: %v", err)
	}
	if _, fds, err := parseRequest([]byte{0xff}, unix.UnixRights(7), 0); err == nil || len(fds) != 1 {
		t.Errorf("garbage request: fds %v, err %v; want the fd returned with the error", fds, err)
	}
}

// FuzzHandlePacket feeds arbitrary packets, control data and flags to the server's
// packet handling: it must never panic, must hand back every fd it parsed, and
// must accept only what the protocol allows.
func FuzzHandlePacket(f *testing.F) {
	f.Add(uint8(expectHello), helloBytes(f, zdspb.Version_V1), []byte(nil), 0)
	f.Add(uint8(expectHello), helloBytes(f, zdspb.Version(7)), []byte(nil), 0)
	f.Add(uint8(expectHello), []byte{0x08}, []byte(nil), 0)
	f.Add(uint8(expectAck), ackBytes(f, ""), []byte(nil), 0)
	f.Add(uint8(expectAck), ackBytes(f, "failed to start proxy"), []byte(nil), 0)
	f.Add(uint8(expectAck), ackBytes(f, ""), unix.UnixRights(3), 0)
	f.Add(uint8(expectAck), ackBytes(f, ""), unix.UnixRights(3, 4, 5), unix.MSG_CTRUNC)
	f.Add(uint8(expectAck), []byte{0x0a, 0x80}, []byte(nil), unix.MSG_TRUNC)
	f.Add(uint8(expectAck), []byte{}, []byte{0xff, 0xff, 0xff, 0xff}, 0)
	f.Fuzz(func(t *testing.T, st uint8, data, oob []byte, flags int) {
		s := stage(st % 2)
		ack, fds, err := handlePacket(s, data, oob, flags)
		want, _ := parseRights(oob)
		if len(fds) != len(want) {
			t.Fatalf("returned %d fds, control data holds %d", len(fds), len(want))
		}
		if err != nil {
			if !errors.Is(err, ErrProtocol) {
				t.Fatalf("error %v does not wrap ErrProtocol", err)
			}
			return
		}
		if len(fds) != 0 || flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0 {
			t.Fatalf("accepted a packet with fds %v / flags %#x", fds, flags)
		}
		switch s {
		case expectHello:
			var h zdspb.ZdsHello
			// Any version is served (decodeHello), but only a decodable hello.
			if proto.Unmarshal(data, &h) != nil || ack != "" {
				t.Fatalf("accepted hello %x", data)
			}
		case expectAck:
			var r zdspb.WorkloadResponse
			if proto.Unmarshal(data, &r) != nil || r.GetAck() == nil || r.GetAck().GetError() != ack {
				t.Fatalf("accepted ack %x as %q", data, ack)
			}
		}
	})
}
