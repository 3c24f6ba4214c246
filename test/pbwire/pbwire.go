// Package pbwire reads and writes protobuf messages field by field, for the
// doubles that speak a peer's protocol from its .proto files rather than from
// generated code (a field number or wire type that differs from the peer's
// then shows in their tests).
package pbwire

import "google.golang.org/protobuf/encoding/protowire"

// Walk calls fn for every field of the message b with its wire type: v holds
// a length-delimited field's bytes, x a varint's value; for the other types
// both are zero.
func Walk(b []byte, fn func(num protowire.Number, typ protowire.Type, v []byte, x uint64) error) error {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		var (
			v []byte
			x uint64
			m int
		)
		switch typ {
		case protowire.BytesType:
			v, m = protowire.ConsumeBytes(b)
		case protowire.VarintType:
			x, m = protowire.ConsumeVarint(b)
		default:
			m = protowire.ConsumeFieldValue(num, typ, b)
		}
		if m < 0 {
			return protowire.ParseError(m)
		}
		b = b[m:]
		if err := fn(num, typ, v, x); err != nil {
			return err
		}
	}
	return nil
}

// AppendBytes appends a length-delimited field (a string, bytes or an
// encoded message).
func AppendBytes(b []byte, num protowire.Number, v []byte) []byte {
	return protowire.AppendBytes(protowire.AppendTag(b, num, protowire.BytesType), v)
}

// Bytes returns the last length-delimited field num of the message b (the one
// a decoder keeps), nil when there is none.
func Bytes(b []byte, num protowire.Number) ([]byte, error) {
	var out []byte
	err := Walk(b, func(n protowire.Number, typ protowire.Type, v []byte, _ uint64) error {
		if n == num && typ == protowire.BytesType {
			out = v
		}
		return nil
	})
	return out, err
}
