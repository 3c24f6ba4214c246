package gateclient

import (
	"errors"
	"fmt"
	"math"
)

// Protocol-buffer wire format, the few parts the gate's messages use: varints
// and length-delimited fields. Encoding follows proto3 (zero values are left
// out); decoding skips fields it does not know, as protobuf does, so the agent
// may add fields without breaking this client.

const (
	wireVarint = 0
	wire64     = 1
	wireBytes  = 2
	wire32     = 5
)

type encoder struct{ b []byte }

func (e *encoder) varint(v uint64) {
	for v >= 0x80 {
		e.b = append(e.b, byte(v)|0x80)
		v >>= 7
	}
	e.b = append(e.b, byte(v))
}

func (e *encoder) tag(num, wt int) { e.varint(uint64(num)<<3 | uint64(wt)) }

func (e *encoder) uint(num int, v uint64) {
	if v != 0 {
		e.tag(num, wireVarint)
		e.varint(v)
	}
}

func (e *encoder) string(num int, s string) {
	if s != "" {
		e.tag(num, wireBytes)
		e.varint(uint64(len(s)))
		e.b = append(e.b, s...)
	}
}

// repeatedString writes every element, empty ones included (a repeated field
// keeps its empty elements).
func (e *encoder) repeatedString(num int, ss []string) {
	for _, s := range ss {
		e.tag(num, wireBytes)
		e.varint(uint64(len(s)))
		e.b = append(e.b, s...)
	}
}

// message writes a nested message, present even when empty.
func (e *encoder) message(num int, fn func(*encoder)) {
	var sub encoder
	fn(&sub)
	e.tag(num, wireBytes)
	e.varint(uint64(len(sub.b)))
	e.b = append(e.b, sub.b...)
}

var errTruncated = errors.New("protobuf: truncated message")

type decoder struct{ b []byte }

func (d *decoder) varint() (uint64, error) {
	var v uint64
	for i := 0; i < 10; i++ {
		if len(d.b) == 0 {
			return 0, errTruncated
		}
		c := d.b[0]
		d.b = d.b[1:]
		if i == 9 && c > 1 {
			return 0, errors.New("protobuf: varint overflows 64 bits")
		}
		v |= uint64(c&0x7f) << (7 * i)
		if c < 0x80 {
			return v, nil
		}
	}
	return 0, errors.New("protobuf: varint overflows 64 bits")
}

// field is one decoded field: a varint's value, or a length-delimited field's
// bytes (which alias the message).
type field struct {
	num   int
	wt    int
	v     uint64
	bytes []byte
}

// next reads the next field; ok is false at the end of the message.
func (d *decoder) next() (f field, ok bool, err error) {
	if len(d.b) == 0 {
		return field{}, false, nil
	}
	t, err := d.varint()
	if err != nil {
		return field{}, false, err
	}
	if t>>3 == 0 || t>>3 > math.MaxInt32 {
		return field{}, false, fmt.Errorf("protobuf: invalid field number %d", t>>3)
	}
	f = field{num: int(t >> 3), wt: int(t & 7)}
	switch f.wt {
	case wireVarint:
		f.v, err = d.varint()
	case wire64:
		if len(d.b) < 8 {
			return field{}, false, errTruncated
		}
		d.b = d.b[8:]
	case wire32:
		if len(d.b) < 4 {
			return field{}, false, errTruncated
		}
		d.b = d.b[4:]
	case wireBytes:
		var n uint64
		n, err = d.varint()
		if err == nil && n > uint64(len(d.b)) {
			err = errTruncated
		}
		if err == nil {
			f.bytes, d.b = d.b[:n], d.b[n:]
		}
	default:
		// Groups (3, 4) are proto2 only; the gate is proto3.
		err = fmt.Errorf("protobuf: unsupported wire type %d in field %d", f.wt, f.num)
	}
	if err != nil {
		return field{}, false, err
	}
	return f, true, nil
}

// each calls fn for every field of msg.
func each(msg []byte, fn func(field) error) error {
	d := decoder{b: msg}
	for {
		f, ok, err := d.next()
		if err != nil || !ok {
			return err
		}
		if err := fn(f); err != nil {
			return err
		}
	}
}

// want checks that a known field has the wire type its declaration gives it.
func (f field) want(wt int) error {
	if f.wt != wt {
		return fmt.Errorf("protobuf: field %d has wire type %d, want %d", f.num, f.wt, wt)
	}
	return nil
}
