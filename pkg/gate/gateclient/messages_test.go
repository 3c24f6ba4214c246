package gateclient

import (
	"bytes"
	"net"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

func testInterfaces() []Interface {
	return []Interface{
		{Name: "eth0", MAC: "aa:bb:cc:dd:ee:ff", Addresses: []string{"10.0.0.5/24", "fd00::5/64"}},
		{Name: "net1"},
		{Name: "net2", Addresses: []string{""}},
	}
}

func pbInterfaces() []*gatepb.Interface {
	return []*gatepb.Interface{
		{Name: "eth0", Mac: "aa:bb:cc:dd:ee:ff", Addresses: []string{"10.0.0.5/24", "fd00::5/64"}},
		{Name: "net1"},
		{Name: "net2", Addresses: []string{""}},
	}
}

// TestMessagesMatchGatepb: what this package encodes is what the generated
// code decodes, field for field, and the other way round.
func TestMessagesMatchGatepb(t *testing.T) {
	long := string(bytes.Repeat([]byte("ü"), 300)) // multi-byte varint lengths
	for _, c := range []struct {
		name string
		ours []byte
		into proto.Message
		want proto.Message
	}{
		{
			"AddRequest",
			(&AddRequest{
				Pod:        PodIdentity{Namespace: "ns", Name: long, UID: "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"},
				Attachment: Attachment{ContainerID: "c0ffee", Ifname: "eth0", Network: "net"},
				NetnsPath:  "/var/run/netns/p",
				Interfaces: testInterfaces(),
				Source:     SourceCNI,
			}).marshal(),
			&gatepb.AddRequest{},
			&gatepb.AddRequest{
				Pod:        &gatepb.PodIdentity{Namespace: "ns", Name: long, Uid: "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"},
				Attachment: &gatepb.Attachment{ContainerId: "c0ffee", Ifname: "eth0", Network: "net"},
				NetnsPath:  "/var/run/netns/p",
				Interfaces: pbInterfaces(),
				Source:     gatepb.Source_SOURCE_CNI,
			},
		},
		{
			"AddRequest empty",
			(&AddRequest{}).marshal(),
			&gatepb.AddRequest{},
			// Present but empty nested messages, as the plugin always sends them.
			&gatepb.AddRequest{Pod: &gatepb.PodIdentity{}, Attachment: &gatepb.Attachment{}},
		},
		{
			"DelRequest",
			(&DelRequest{Pod: &PodIdentity{Namespace: "ns", Name: "p"}, Attachment: Attachment{ContainerID: "c", Ifname: "eth0", Network: "n"}, NetnsPath: "/x", Source: SourceCNI}).marshal(),
			&gatepb.DelRequest{},
			&gatepb.DelRequest{Pod: &gatepb.PodIdentity{Namespace: "ns", Name: "p"}, Attachment: &gatepb.Attachment{ContainerId: "c", Ifname: "eth0", Network: "n"}, NetnsPath: "/x", Source: gatepb.Source_SOURCE_CNI},
		},
		{
			"DelRequest without pod",
			(&DelRequest{Attachment: Attachment{ContainerID: "c"}}).marshal(),
			&gatepb.DelRequest{},
			&gatepb.DelRequest{Attachment: &gatepb.Attachment{ContainerId: "c"}},
		},
		{
			"CheckRequest",
			(&CheckRequest{Pod: PodIdentity{Namespace: "ns", Name: "p", UID: "u"}, Attachment: Attachment{ContainerID: "c", Ifname: "eth0", Network: "n"}, NetnsPath: "/x", Interfaces: testInterfaces()}).marshal(),
			&gatepb.CheckRequest{},
			&gatepb.CheckRequest{Pod: &gatepb.PodIdentity{Namespace: "ns", Name: "p", Uid: "u"}, Attachment: &gatepb.Attachment{ContainerId: "c", Ifname: "eth0", Network: "n"}, NetnsPath: "/x", Interfaces: pbInterfaces()},
		},
		{
			"GCRequest",
			(&GCRequest{Network: "n", Valid: []Attachment{{ContainerID: "a", Ifname: "eth0", Network: "n"}, {}}}).marshal(),
			&gatepb.GCRequest{},
			&gatepb.GCRequest{Network: "n", Valid: []*gatepb.Attachment{{ContainerId: "a", Ifname: "eth0", Network: "n"}, {}}},
		},
	} {
		if err := proto.Unmarshal(c.ours, c.into); err != nil {
			t.Errorf("%s: gatepb cannot decode it: %v", c.name, err)
			continue
		}
		if !proto.Equal(c.into, c.want) {
			t.Errorf("%s: gatepb decodes %v, want %v", c.name, c.into, c.want)
		}
	}
}

// unknownFields are fields a newer agent might add: every wire type.
func unknownFields() []byte {
	var b []byte
	b = protowire.AppendTag(b, 90, protowire.VarintType)
	b = protowire.AppendVarint(b, 1<<60)
	b = protowire.AppendTag(b, 91, protowire.BytesType)
	b = protowire.AppendBytes(b, []byte("later"))
	b = protowire.AppendTag(b, 92, protowire.Fixed32Type)
	b = protowire.AppendFixed32(b, 7)
	b = protowire.AppendTag(b, 93, protowire.Fixed64Type)
	b = protowire.AppendFixed64(b, 7)
	return b
}

func marshal(t *testing.T, m proto.Message) []byte {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return append(unknownFields(), append(b, unknownFields()...)...)
}

func TestResponsesFromGatepb(t *testing.T) {
	var add AddResponse
	if err := add.unmarshal(marshal(t, &gatepb.AddResponse{Decision: gatepb.Decision_DECISION_SKIPPED, Reason: "policy", NetnsCookie: 1<<63 + 5})); err != nil {
		t.Fatal(err)
	}
	if add != (AddResponse{Decision: DecisionSkipped, Reason: "policy", NetnsCookie: 1<<63 + 5}) {
		t.Errorf("AddResponse = %+v", add)
	}
	if got, want := add.Decision.String(), gatepb.Decision_DECISION_SKIPPED.String(); got != want {
		t.Errorf("decision name %q, want %q", got, want)
	}
	var del DelResponse
	if err := del.unmarshal(marshal(t, &gatepb.DelResponse{Released: true})); err != nil || !del.Released {
		t.Errorf("DelResponse = %+v, %v", del, err)
	}
	var gc GCResponse
	if err := gc.unmarshal(marshal(t, &gatepb.GCResponse{Released: []*gatepb.Attachment{{ContainerId: "a", Ifname: "eth0", Network: "n"}, {}}})); err != nil {
		t.Fatal(err)
	}
	if len(gc.Released) != 2 || gc.Released[0] != (Attachment{ContainerID: "a", Ifname: "eth0", Network: "n"}) || gc.Released[1] != (Attachment{}) {
		t.Errorf("GCResponse = %+v", gc)
	}
	st, err := decodeHealth(marshal(t, &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_NOT_SERVING}))
	if err != nil || st != HealthNotServing || st.String() != healthpb.HealthCheckResponse_NOT_SERVING.String() {
		t.Errorf("health = %v (%s), %v", st, st, err)
	}
	// A field of the wrong wire type is an error, not a silent zero.
	bad := protowire.AppendTag(nil, 1, protowire.BytesType)
	bad = protowire.AppendBytes(bad, []byte("x"))
	if err := (&DelResponse{}).unmarshal(bad); err == nil {
		t.Error("DelResponse with a string in its bool field decoded")
	}
	for _, trunc := range [][]byte{{0x0a}, {0x0a, 0x05, 'a'}, {0x80}, {0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f}} {
		if err := (&GCResponse{}).unmarshal(trunc); err == nil {
			t.Errorf("malformed %x decoded", trunc)
		}
	}
}

func TestCodesMatchGRPC(t *testing.T) {
	for c := OK; c <= Unauthenticated; c++ {
		if got, want := c.String(), codes.Code(c).String(); got != want {
			t.Errorf("code %d is %q here, %q in grpc-go", c, got, want)
		}
	}
	if Code(99).String() != "Code(99)" {
		t.Errorf("unknown code: %s", Code(99))
	}
}

func TestEncodeTimeout(t *testing.T) {
	for _, c := range []struct {
		d    time.Duration
		want string
	}{
		{0, "0n"}, {-time.Second, "0n"}, {time.Nanosecond, "1n"}, {99999999, "99999999n"},
		{100 * time.Millisecond, "100000u"}, {30 * time.Second, "30000000u"}, {1500 * time.Microsecond, "1500000n"}, {2 * time.Minute, "120000m"},
		{200000 * time.Second, "200000S"}, {time.Duration(1<<63 - 1), "2562048H"},
	} {
		if got := encodeTimeout(int64(c.d)); got != c.want {
			t.Errorf("encodeTimeout(%v) = %q, want %q", c.d, got, c.want)
		}
	}
}

func TestDecodeGRPCMessage(t *testing.T) {
	for in, want := range map[string]string{
		"plain":              "plain",
		"100%25 sure":        "100% sure",
		"%C3%BC%0Aline":      "ü\nline",
		"bad %zz and end %4": "bad %zz and end %4",
	} {
		if got := decodeGRPCMessage(in); got != want {
			t.Errorf("decodeGRPCMessage(%q) = %q, want %q", in, got, want)
		}
	}
}

// fakeConn is a server that sends fixed bytes and swallows what it is sent.
type fakeConn struct {
	net.Conn
	r *bytes.Reader
}

func (c fakeConn) Read(p []byte) (int, error)  { return c.r.Read(p) }
func (c fakeConn) Write(p []byte) (int, error) { return len(p), nil }

// FuzzServerFrames feeds arbitrary server bytes to a call: it must end, with
// an answer or an error, and never panic.
func FuzzServerFrames(f *testing.F) {
	settings := []byte{0, 0, 0, frameSettings, 0, 0, 0, 0, 0}
	f.Add(settings)
	f.Add(append(settings, 0, 0, 8, framePing, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8))
	f.Add(append(settings, 0, 0, 8, frameGoAway, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0))
	f.Add(append(settings, 0, 0, 4, frameRSTStream, 0, 0, 0, 0, 1, 0, 0, 0, 2))
	f.Add(append(settings, 0, 0, 1, frameHeaders, flagEndHeaders|flagEndStream, 0, 0, 0, 1, 0x88))
	f.Fuzz(func(t *testing.T, server []byte) {
		s := newStream(fakeConn{r: bytes.NewReader(server)})
		_, _ = s.unary(methodAdd, "1S", []byte("request"))
	})
}

// FuzzResponses: the decoders return an error for what is not a message.
func FuzzResponses(f *testing.F) {
	f.Add([]byte{0x08, 0x01, 0x12, 0x01, 'x', 0x18, 0x05})
	f.Add([]byte{0x0a, 0x02, 0x0a, 0x00})
	f.Fuzz(func(t *testing.T, b []byte) {
		_ = (&AddResponse{}).unmarshal(b)
		_ = (&DelResponse{}).unmarshal(b)
		_ = (&GCResponse{}).unmarshal(b)
		_, _ = decodeHealth(b)
	})
}
