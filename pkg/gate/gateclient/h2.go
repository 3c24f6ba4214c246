package gateclient

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"

	"golang.org/x/net/http2/hpack"
)

// HTTP/2 (RFC 9113) as one unary gRPC call needs it: the client preface, the
// settings exchange, one stream (id 1) carrying the request's HEADERS and DATA,
// flow control for what the client sends, and whatever the server sends back
// on the connection (SETTINGS, PING, WINDOW_UPDATE, GOAWAY, RST_STREAM) handled
// as the protocol requires.

const clientPreface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

const (
	frameData         = 0x0
	frameHeaders      = 0x1
	frameRSTStream    = 0x3
	frameSettings     = 0x4
	framePushPromise  = 0x5
	framePing         = 0x6
	frameGoAway       = 0x7
	frameWindowUpdate = 0x8
	frameContinuation = 0x9
)

const (
	flagEndStream  = 0x1
	flagAck        = 0x1
	flagEndHeaders = 0x4
	flagPadded     = 0x8
	flagPriority   = 0x20
)

const (
	settingEnablePush    = 0x2
	settingInitialWindow = 0x4
	settingMaxFrameSize  = 0x5
)

const (
	// defaultWindow is the protocol's initial flow-control window.
	defaultWindow = 65535
	// maxWindow is the largest window the protocol allows; the client
	// grants it to the server, connection and stream, so it never has to
	// send WINDOW_UPDATE for what it receives (maxResponse is far below).
	maxWindow = 1<<31 - 1
	// frameSize is the protocol's default SETTINGS_MAX_FRAME_SIZE. The client
	// never raises its own, so the server's frames are at most this large, and
	// it sends no larger frames whatever the server allows.
	frameSize = 16384
	// maxHeaderBlock bounds a response's header block (HEADERS and its
	// CONTINUATIONs), which grpc-message can make long.
	maxHeaderBlock = 1 << 20
	// streamID is the call's stream: the first a client opens.
	streamID = 1
)

// errStreamRefused marks a stream the server refused before processing it.
var errStreamRefused = errors.New("the agent refused the call before processing it")

type stream struct {
	conn io.ReadWriter
	r    *bufio.Reader
	dec  *hpack.Decoder
	// processed: the server may have seen the request (anything but a clean
	// refusal after the server's first frame).
	processed bool
	heardFrom bool

	connWindow, streamWindow int64 // what the client may still send
	peerInitialWindow        int64

	out         []byte // frames not yet written
	body        []byte // request DATA not yet framed
	writeFailed bool

	headerBlock []byte
	headerEnd   bool // END_STREAM of the HEADERS whose block is being collected
	inHeaders   bool
	gotHeaders  bool
	fields      []hpack.HeaderField
	respData    []byte
}

func newStream(conn io.ReadWriter) *stream {
	s := &stream{
		conn:              conn,
		r:                 bufio.NewReaderSize(conn, 32<<10),
		connWindow:        defaultWindow,
		streamWindow:      defaultWindow,
		peerInitialWindow: defaultWindow,
	}
	s.dec = hpack.NewDecoder(4096, func(f hpack.HeaderField) { s.fields = append(s.fields, f) })
	s.dec.SetMaxStringLength(maxHeaderBlock)
	return s
}

func (s *stream) frame(typ, flags byte, id uint32, payload []byte) {
	n := len(payload)
	s.out = append(s.out, byte(n>>16), byte(n>>8), byte(n), typ, flags)
	s.out = binary.BigEndian.AppendUint32(s.out, id&0x7fffffff)
	s.out = append(s.out, payload...)
}

// tryFlush writes what is queued; after a failed write nothing more is
// written.
func (s *stream) tryFlush() {
	if s.writeFailed {
		s.out = s.out[:0]
		return
	}
	if err := s.flush(); err != nil {
		s.writeFailed = true
	}
}

func (s *stream) flush() error {
	if len(s.out) == 0 {
		return nil
	}
	_, err := s.conn.Write(s.out)
	s.out = s.out[:0]
	if err != nil {
		return fmt.Errorf("write to the gate socket: %w", err)
	}
	return nil
}

// sendBody frames as much of the pending request body as the windows allow;
// the last frame ends the stream.
func (s *stream) sendBody() {
	for len(s.body) > 0 {
		n := min(int64(len(s.body)), int64(frameSize), s.connWindow, s.streamWindow)
		if n <= 0 {
			return
		}
		var flags byte
		if int(n) == len(s.body) {
			flags = flagEndStream
		}
		s.frame(frameData, flags, streamID, s.body[:n])
		s.body = s.body[n:]
		s.connWindow -= n
		s.streamWindow -= n
	}
}

func requestHeaders(method, timeout string) ([]byte, error) {
	var b strings.Builder
	enc := hpack.NewEncoder(&b)
	fields := []hpack.HeaderField{
		{Name: ":method", Value: "POST"},
		{Name: ":scheme", Value: "http"},
		{Name: ":path", Value: method},
		{Name: ":authority", Value: "localhost"},
		{Name: "content-type", Value: "application/grpc"},
		{Name: "te", Value: "trailers"},
		{Name: "user-agent", Value: "mesh-cni"},
	}
	if timeout != "" {
		fields = append(fields, hpack.HeaderField{Name: "grpc-timeout", Value: timeout})
	}
	for _, f := range fields {
		if err := enc.WriteField(f); err != nil {
			return nil, fmt.Errorf("encode request headers: %w", err)
		}
	}
	if b.Len() > frameSize {
		return nil, errors.New("request headers do not fit one frame")
	}
	return []byte(b.String()), nil
}

// unary sends the request and reads the response message. A *Status is the
// server's answer; other errors are the connection's.
func (s *stream) unary(method, timeout string, req []byte) ([]byte, error) {
	hdr, err := requestHeaders(method, timeout)
	if err != nil {
		return nil, &Status{Code: Internal, Message: err.Error()}
	}
	s.out = append(s.out, clientPreface...)
	settings := make([]byte, 0, 12)
	settings = appendSetting(settings, settingEnablePush, 0)
	settings = appendSetting(settings, settingInitialWindow, maxWindow)
	s.frame(frameSettings, 0, 0, settings)
	s.frame(frameWindowUpdate, 0, 0, binary.BigEndian.AppendUint32(nil, maxWindow-defaultWindow))
	s.frame(frameHeaders, flagEndHeaders, streamID, hdr)
	// One gRPC message: uncompressed flag, length, protobuf bytes.
	s.body = make([]byte, 5, 5+len(req))
	binary.BigEndian.PutUint32(s.body[1:], uint32(len(req)))
	s.body = append(s.body, req...)
	s.sendBody()
	s.tryFlush()
	for {
		done, err := s.readFrame()
		if err != nil {
			return nil, err
		}
		// A failed write (the server closed its end) does not end the call
		// here: what the server sent before is still to be read, and it
		// says whether the stream was processed.
		s.tryFlush()
		if done {
			break
		}
	}
	// Done with the connection: say so, as grpc-go's client does on close,
	// so the agent sees a clean shutdown rather than a dropped peer. Best
	// effort; the answer is in.
	s.frame(frameGoAway, 0, 0, make([]byte, 8))
	s.tryFlush()
	return s.result()
}

func appendSetting(b []byte, id uint16, v uint32) []byte {
	b = binary.BigEndian.AppendUint16(b, id)
	return binary.BigEndian.AppendUint32(b, v)
}

// readFrame reads and handles one frame; done reports the stream's end.
func (s *stream) readFrame() (done bool, err error) {
	var h [9]byte
	if _, err := io.ReadFull(s.r, h[:]); err != nil {
		return false, s.connErr(err)
	}
	n := int(h[0])<<16 | int(h[1])<<8 | int(h[2])
	typ, flags := h[3], h[4]
	id := binary.BigEndian.Uint32(h[5:]) & 0x7fffffff
	if n > frameSize {
		return false, fmt.Errorf("the agent sent a %d-byte frame, larger than the %d the client allows", n, frameSize)
	}
	payload := make([]byte, n)
	if _, err := io.ReadFull(s.r, payload); err != nil {
		return false, s.connErr(err)
	}
	if !s.heardFrom {
		// The server's first frame must be its SETTINGS (its connection
		// preface); grpc-go sends it before it serves any stream.
		if typ != frameSettings || flags&flagAck != 0 {
			return false, fmt.Errorf("the agent did not start with its HTTP/2 settings (frame type %d)", typ)
		}
		s.heardFrom = true
		s.processed = true
	}
	if s.inHeaders && typ != frameContinuation {
		return false, errors.New("HTTP/2: header block interrupted")
	}
	switch typ {
	case frameSettings:
		if flags&flagAck != 0 {
			return false, nil
		}
		if n%6 != 0 || id != 0 {
			return false, errors.New("HTTP/2: malformed SETTINGS")
		}
		for i := 0; i < n; i += 6 {
			v := binary.BigEndian.Uint32(payload[i+2:])
			switch binary.BigEndian.Uint16(payload[i:]) {
			case settingInitialWindow:
				if v > maxWindow {
					return false, errors.New("HTTP/2: initial window too large")
				}
				s.streamWindow += int64(v) - s.peerInitialWindow
				s.peerInitialWindow = int64(v)
			case settingMaxFrameSize:
				// The client keeps to the default size, which every
				// server accepts.
			}
		}
		s.frame(frameSettings, flagAck, 0, nil)
		s.sendBody()
	case framePing:
		if n != 8 || id != 0 {
			return false, errors.New("HTTP/2: malformed PING")
		}
		if flags&flagAck == 0 {
			s.frame(framePing, flagAck, 0, payload)
		}
	case frameWindowUpdate:
		if n != 4 {
			return false, errors.New("HTTP/2: malformed WINDOW_UPDATE")
		}
		inc := int64(binary.BigEndian.Uint32(payload) & 0x7fffffff)
		switch id {
		case 0:
			s.connWindow += inc
		case streamID:
			s.streamWindow += inc
		}
		s.sendBody()
	case frameGoAway:
		if n < 8 {
			return false, errors.New("HTTP/2: malformed GOAWAY")
		}
		if last := binary.BigEndian.Uint32(payload) & 0x7fffffff; last < streamID {
			// The server is going away and will not process our stream.
			s.processed = false
			return false, errStreamRefused
		}
		// Our stream is still being processed: its answer follows.
	case frameRSTStream:
		if id != streamID {
			return false, nil
		}
		if n != 4 {
			return false, errors.New("HTTP/2: malformed RST_STREAM")
		}
		code := binary.BigEndian.Uint32(payload)
		if code == 0x7 { // REFUSED_STREAM: not processed
			s.processed = false
			return false, errStreamRefused
		}
		return false, &Status{Code: rstStreamCode(code), Message: fmt.Sprintf("stream terminated by RST_STREAM with error code: %d", code)}
	case framePushPromise:
		return false, errors.New("HTTP/2: PUSH_PROMISE although push is disabled")
	case frameHeaders:
		if id != streamID {
			return false, nil
		}
		frag, err := headersFragment(flags, payload)
		if err != nil {
			return false, err
		}
		s.headerEnd = flags&flagEndStream != 0
		return s.headerFragment(frag, flags&flagEndHeaders != 0)
	case frameContinuation:
		if !s.inHeaders || id != streamID {
			return false, errors.New("HTTP/2: unexpected CONTINUATION")
		}
		return s.headerFragment(payload, flags&flagEndHeaders != 0)
	case frameData:
		if id != streamID {
			return false, nil
		}
		data, err := unpad(flags, payload)
		if err != nil {
			return false, err
		}
		if !s.gotHeaders {
			return false, errors.New("HTTP/2: DATA before the response headers")
		}
		if len(s.respData)+len(data) > maxResponse+5 {
			return false, &Status{Code: ResourceExhausted, Message: fmt.Sprintf("response larger than %d bytes", maxResponse)}
		}
		s.respData = append(s.respData, data...)
		if flags&flagEndStream != 0 {
			return false, &Status{Code: Internal, Message: "server closed the stream without sending trailers"}
		}
	}
	// Unknown frame types and PRIORITY are ignored, as the protocol asks.
	return false, nil
}

// connErr describes a connection that ended (or failed) mid-call.
func (s *stream) connErr(err error) error {
	if !s.heardFrom {
		// Nothing from the server yet: it never saw the request.
		return fmt.Errorf("the gate socket closed before the agent answered: %w", err)
	}
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return &Status{Code: Unavailable, Message: "the agent closed the connection before answering (error reading from server: EOF)"}
	}
	return &Status{Code: Unavailable, Message: "error reading from server: " + err.Error()}
}

func unpad(flags byte, p []byte) ([]byte, error) {
	if flags&flagPadded == 0 {
		return p, nil
	}
	if len(p) == 0 || int(p[0]) >= len(p) {
		return nil, errors.New("HTTP/2: bad padding")
	}
	return p[1 : len(p)-int(p[0])], nil
}

func headersFragment(flags byte, p []byte) ([]byte, error) {
	p, err := unpad(flags, p)
	if err != nil {
		return nil, err
	}
	if flags&flagPriority != 0 {
		if len(p) < 5 {
			return nil, errors.New("HTTP/2: short HEADERS priority")
		}
		p = p[5:]
	}
	return p, nil
}

// headerFragment collects a header block; once complete it is decoded and
// handled as the response's headers or trailers.
func (s *stream) headerFragment(frag []byte, end bool) (done bool, err error) {
	if len(s.headerBlock)+len(frag) > maxHeaderBlock {
		return false, &Status{Code: Internal, Message: "response header block too large"}
	}
	s.headerBlock = append(s.headerBlock, frag...)
	s.inHeaders = !end
	if !end {
		return false, nil
	}
	s.fields = s.fields[:0]
	_, err = s.dec.Write(s.headerBlock)
	s.headerBlock = s.headerBlock[:0]
	if err != nil {
		return false, fmt.Errorf("HTTP/2: decode response headers: %w", err)
	}
	if !s.gotHeaders {
		s.gotHeaders = true
		if err := checkResponseHeaders(s.fields); err != nil {
			return false, err
		}
		if !s.headerEnd {
			return false, nil
		}
		// Trailers-only: the status is in these headers.
	} else if !s.headerEnd {
		return false, errors.New("HTTP/2: trailers without END_STREAM")
	}
	st, err := trailerStatus(s.fields)
	if err != nil {
		return false, err
	}
	if st.Code != OK {
		return false, st
	}
	return true, nil
}

// checkResponseHeaders checks :status and the content type of the response.
func checkResponseHeaders(fields []hpack.HeaderField) error {
	status, ctype := "", ""
	for _, f := range fields {
		switch f.Name {
		case ":status":
			status = f.Value
		case "content-type":
			ctype = f.Value
		}
	}
	if status != "200" {
		code, err := strconv.Atoi(status)
		if err != nil {
			return &Status{Code: Internal, Message: fmt.Sprintf("malformed :status %q in the response", status)}
		}
		return &Status{Code: httpStatusCode(code), Message: fmt.Sprintf("unexpected HTTP status code received from server: %d", code)}
	}
	if ctype != "application/grpc" && !strings.HasPrefix(ctype, "application/grpc+") && !strings.HasPrefix(ctype, "application/grpc;") {
		return &Status{Code: Unknown, Message: fmt.Sprintf("unexpected content-type %q in the response", ctype)}
	}
	return nil
}

func trailerStatus(fields []hpack.HeaderField) (*Status, error) {
	st := &Status{}
	seen := false
	for _, f := range fields {
		switch f.Name {
		case "grpc-status":
			v, err := strconv.ParseUint(f.Value, 10, 32)
			if err != nil {
				return nil, &Status{Code: Internal, Message: fmt.Sprintf("malformed grpc-status %q", f.Value)}
			}
			st.Code, seen = Code(v), true
		case "grpc-message":
			st.Message = decodeGRPCMessage(f.Value)
		}
	}
	if !seen {
		return nil, &Status{Code: Internal, Message: "server closed the stream without a grpc-status"}
	}
	return st, nil
}

// result is the response message of a call that ended with status OK.
func (s *stream) result() ([]byte, error) {
	d := s.respData
	if len(d) < 5 {
		return nil, &Status{Code: Internal, Message: "the agent's answer has no response message"}
	}
	if d[0] != 0 {
		return nil, &Status{Code: Internal, Message: "the agent's answer is compressed, which the client did not ask for"}
	}
	n := binary.BigEndian.Uint32(d[1:5])
	if uint64(n) != uint64(len(d)-5) {
		return nil, &Status{Code: Internal, Message: fmt.Sprintf("the agent's answer is %d bytes for a %d-byte message", len(d)-5, n)}
	}
	return d[5:], nil
}
