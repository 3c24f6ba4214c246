package gateclient

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Code is a gRPC status code, numbered as the gRPC protocol numbers them (and
// google.golang.org/grpc/codes, which this package does not import: that
// package alone brings in a good part of grpc-go's start-up).
type Code uint32

// The gRPC status codes.
const (
	OK                 Code = 0
	Canceled           Code = 1
	Unknown            Code = 2
	InvalidArgument    Code = 3
	DeadlineExceeded   Code = 4
	NotFound           Code = 5
	AlreadyExists      Code = 6
	PermissionDenied   Code = 7
	ResourceExhausted  Code = 8
	FailedPrecondition Code = 9
	Aborted            Code = 10
	OutOfRange         Code = 11
	Unimplemented      Code = 12
	Internal           Code = 13
	Unavailable        Code = 14
	DataLoss           Code = 15
	Unauthenticated    Code = 16
)

var codeNames = [...]string{
	"OK", "Canceled", "Unknown", "InvalidArgument", "DeadlineExceeded", "NotFound", "AlreadyExists", "PermissionDenied",
	"ResourceExhausted", "FailedPrecondition", "Aborted", "OutOfRange", "Unimplemented", "Internal", "Unavailable",
	"DataLoss", "Unauthenticated",
}

func (c Code) String() string {
	if int(c) < len(codeNames) {
		return codeNames[c]
	}
	return "Code(" + strconv.FormatUint(uint64(c), 10) + ")"
}

// Status is the outcome of a call that did not succeed: the agent's answer, or
// what the client concluded when there was none (Unavailable, DeadlineExceeded).
type Status struct {
	Code    Code
	Message string
}

// Error is worded as grpc-go words a status error.
func (s *Status) Error() string {
	return fmt.Sprintf("rpc error: code = %s desc = %s", s.Code, s.Message)
}

// StatusOf returns the status an error carries: nil for nil, the Status for a
// *Status (wrapped or not), DeadlineExceeded or Canceled for context errors,
// Unknown otherwise.
func StatusOf(err error) *Status {
	if err == nil {
		return nil
	}
	var st *Status
	if errors.As(err, &st) {
		return st
	}
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return &Status{Code: DeadlineExceeded, Message: err.Error()}
	case errors.Is(err, context.Canceled):
		return &Status{Code: Canceled, Message: err.Error()}
	}
	return &Status{Code: Unknown, Message: err.Error()}
}

// contextStatus is the status of a call whose context ended, with what the
// client knows about why it got no answer.
func contextStatus(ctx context.Context, last error) *Status {
	cerr := ctx.Err()
	if cerr == nil {
		cerr = context.DeadlineExceeded // past its deadline, its timer not run yet
	}
	st := StatusOf(cerr)
	if last != nil {
		st.Message += " (last attempt: " + last.Error() + ")"
	}
	return st
}

// ended reports whether ctx is done or past its deadline. The agent's side of
// the call ends at the same deadline (grpc-timeout), and its reset of the
// stream can arrive before the context's own timer has fired; grpc-go's
// client, too, reads a reset after the deadline as DeadlineExceeded.
func ended(ctx context.Context) bool {
	if ctx.Err() != nil {
		return true
	}
	dl, ok := ctx.Deadline()
	return ok && !time.Now().Before(dl)
}

// httpStatusCode maps a non-200 HTTP status of a response to a gRPC code, as
// the gRPC protocol's HTTP mapping does.
func httpStatusCode(status int) Code {
	switch status {
	case 400:
		return Internal
	case 401:
		return Unauthenticated
	case 403:
		return PermissionDenied
	case 404:
		return Unimplemented
	case 429, 502, 503, 504:
		return Unavailable
	}
	return Unknown
}

// rstStreamCode maps an HTTP/2 RST_STREAM error code to a gRPC code, as
// grpc-go's client does.
func rstStreamCode(code uint32) Code {
	switch code {
	case 0x7: // REFUSED_STREAM
		return Unavailable
	case 0x8: // CANCEL
		return Canceled
	case 0xb: // ENHANCE_YOUR_CALM
		return ResourceExhausted
	case 0xc: // INADEQUATE_SECURITY
		return PermissionDenied
	}
	return Internal
}

// decodeGRPCMessage undoes the percent-encoding of the grpc-message trailer.
// A malformed escape is kept as it is, as the protocol asks.
func decodeGRPCMessage(s string) string {
	if !strings.Contains(s, "%") {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '%' && i+2 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+3], 16, 8); err == nil {
				b.WriteByte(byte(v))
				i += 2
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// encodeTimeout writes a grpc-timeout value: at most 8 digits and a unit,
// rounded up so the server never sees a longer deadline than the caller's.
func encodeTimeout(nanos int64) string {
	if nanos <= 0 {
		return "0n"
	}
	for _, u := range []struct {
		unit string
		ns   int64
	}{{"n", 1}, {"u", 1e3}, {"m", 1e6}, {"S", 1e9}, {"M", 60e9}, {"H", 3600e9}} {
		v := nanos / u.ns
		if nanos%u.ns != 0 {
			v++
		}
		if v < 1e8 {
			return strconv.FormatInt(v, 10) + u.unit
		}
	}
	return "99999999H"
}
