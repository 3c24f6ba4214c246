package gateclient

import (
	"fmt"

	"google.golang.org/protobuf/encoding/protowire"
)

// The gate's messages in the protocol-buffer wire format, written and read
// with protowire (the wire format alone, without reflection or generated
// types, which would bring most of the protobuf runtime into the plugin).
// Encoding follows proto3 (zero values are left out); decoding skips fields it
// does not know, as protobuf does, so the agent may add fields without
// breaking this client.

const (
	wireVarint = protowire.VarintType
	wireBytes  = protowire.BytesType
)

type encoder struct{ b []byte }

func (e *encoder) uint(num int, v uint64) {
	if v != 0 {
		e.b = protowire.AppendTag(e.b, protowire.Number(num), protowire.VarintType)
		e.b = protowire.AppendVarint(e.b, v)
	}
}

func (e *encoder) string(num int, s string) {
	if s != "" {
		e.b = protowire.AppendTag(e.b, protowire.Number(num), protowire.BytesType)
		e.b = protowire.AppendString(e.b, s)
	}
}

// repeatedString writes every element, empty ones included (a repeated field
// keeps its empty elements).
func (e *encoder) repeatedString(num int, ss []string) {
	for _, s := range ss {
		e.b = protowire.AppendTag(e.b, protowire.Number(num), protowire.BytesType)
		e.b = protowire.AppendString(e.b, s)
	}
}

// message writes a nested message, present even when empty.
func (e *encoder) message(num int, fn func(*encoder)) {
	var sub encoder
	fn(&sub)
	e.b = protowire.AppendTag(e.b, protowire.Number(num), protowire.BytesType)
	e.b = protowire.AppendBytes(e.b, sub.b)
}

// field is one decoded field: a varint's value, or a length-delimited field's
// bytes (which alias the message).
type field struct {
	num   int
	wt    protowire.Type
	v     uint64
	bytes []byte
}

// each calls fn for every field of msg; fields of other wire types are read
// past with their value unset.
func each(msg []byte, fn func(field) error) error {
	for len(msg) > 0 {
		num, wt, n := protowire.ConsumeTag(msg)
		if n < 0 {
			return fmt.Errorf("protobuf: %w", protowire.ParseError(n))
		}
		msg = msg[n:]
		f := field{num: int(num), wt: wt}
		switch wt {
		case protowire.VarintType:
			f.v, n = protowire.ConsumeVarint(msg)
		case protowire.BytesType:
			f.bytes, n = protowire.ConsumeBytes(msg)
		case protowire.StartGroupType, protowire.EndGroupType:
			// Groups are proto2 only; the gate is proto3.
			return fmt.Errorf("protobuf: unsupported wire type %d in field %d", wt, num)
		default:
			n = protowire.ConsumeFieldValue(num, wt, msg)
		}
		if n < 0 {
			return fmt.Errorf("protobuf: field %d: %w", num, protowire.ParseError(n))
		}
		msg = msg[n:]
		if err := fn(f); err != nil {
			return err
		}
	}
	return nil
}

// want checks that a known field has the wire type its declaration gives it.
func (f field) want(wt protowire.Type) error {
	if f.wt != wt {
		return fmt.Errorf("protobuf: field %d has wire type %d, want %d", f.num, f.wt, wt)
	}
	return nil
}
