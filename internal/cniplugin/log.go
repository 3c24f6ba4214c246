package cniplugin

import (
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// The plugin's log: one JSON object per line, in the format the agent's zap
// logger writes ({"level":"info","ts":"2006-01-02T15:04:05.000Z0700",
// "msg":...,fields...}; durations in seconds), so both read alike. It is not
// zap: zap brings net/http and crypto/tls with it, about sixty packages whose
// initialization every plugin process paid for a handful of log lines.

// level is a log severity.
type level int8

const (
	levelDebug level = iota - 1
	levelInfo
	levelWarn
	levelError
	// levelOff is above every message the plugin writes (zap's dpanic, panic
	// and fatal, which logLevel also accepts).
	levelOff
)

func (l level) String() string {
	switch l {
	case levelDebug:
		return "debug"
	case levelInfo:
		return "info"
	case levelWarn:
		return "warn"
	case levelError:
		return "error"
	}
	return "off"
}

// parseLevel reads logLevel: the names zap accepts, in any case.
func parseLevel(s string) (level, error) {
	switch strings.ToLower(s) {
	case "debug":
		return levelDebug, nil
	case "info", "":
		return levelInfo, nil
	case "warn":
		return levelWarn, nil
	case "error":
		return levelError, nil
	case "dpanic", "panic", "fatal":
		return levelOff, nil
	}
	return 0, fmt.Errorf("unrecognized level: %q", s)
}

// field is one key and its value, already encoded as JSON.
type field struct {
	key, value string
}

// jsonString quotes s as a JSON string the way zap's encoder does: quotes,
// backslashes and control characters escaped, invalid UTF-8 replaced, no
// HTML escaping.
func jsonString(s string) string {
	var b strings.Builder
	b.Grow(len(s) + 2)
	b.WriteByte('"')
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			switch {
			case c == '"' || c == '\\':
				b.WriteByte('\\')
				b.WriteByte(c)
			case c == '\n':
				b.WriteString(`\n`)
			case c == '\r':
				b.WriteString(`\r`)
			case c == '\t':
				b.WriteString(`\t`)
			case c < 0x20:
				b.WriteString(`\u00`)
				b.WriteByte("0123456789abcdef"[c>>4])
				b.WriteByte("0123456789abcdef"[c&0xf])
			default:
				b.WriteByte(c)
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b.WriteString(`\ufffd`)
		} else {
			b.WriteString(s[i : i+size])
		}
		i += size
	}
	b.WriteByte('"')
	return b.String()
}

func fStr(key, v string) field { return field{key, jsonString(v)} }

func fInt(key string, v int) field { return field{key, strconv.Itoa(v)} }

func fUint(key string, v uint64) field { return field{key, strconv.FormatUint(v, 10)} }

func fBool(key string, v bool) field { return field{key, strconv.FormatBool(v)} }

// fDur is a duration in seconds, as zap's production encoder writes it.
func fDur(key string, d time.Duration) field {
	return field{key, strconv.FormatFloat(d.Seconds(), 'f', -1, 64)}
}

func fErr(err error) field {
	if err == nil {
		return field{"error", "null"}
	}
	return fStr("error", err.Error())
}

// logger writes lines at min and above to w. Its zero value writes nothing.
type logger struct {
	w      io.Writer
	min    level
	fields []field
	now    func() time.Time
}

func newLogger(w io.Writer, min level) *logger {
	return &logger{w: w, min: min, now: time.Now}
}

// With returns a logger that adds fields to every line.
func (l *logger) With(fields ...field) *logger {
	c := *l
	c.fields = append(append([]field(nil), l.fields...), fields...)
	return &c
}

func (l *logger) Debug(msg string, fields ...field) { l.write(levelDebug, msg, fields) }
func (l *logger) Info(msg string, fields ...field)  { l.write(levelInfo, msg, fields) }
func (l *logger) Warn(msg string, fields ...field)  { l.write(levelWarn, msg, fields) }
func (l *logger) Error(msg string, fields ...field) { l.write(levelError, msg, fields) }

func (l *logger) write(lvl level, msg string, fields []field) {
	if l == nil || l.w == nil || lvl < l.min {
		return
	}
	var b strings.Builder
	b.WriteString(`{"level":"`)
	b.WriteString(lvl.String())
	b.WriteString(`","ts":"`)
	b.WriteString(l.now().Format("2006-01-02T15:04:05.000Z0700"))
	b.WriteString(`","msg":`)
	b.WriteString(jsonString(msg))
	for _, fs := range [][]field{l.fields, fields} {
		for _, f := range fs {
			b.WriteByte(',')
			b.WriteString(jsonString(f.key))
			b.WriteByte(':')
			b.WriteString(f.value)
		}
	}
	b.WriteString("}\n")
	// One write per line: with O_APPEND, lines of plugins logging to the same
	// file at once do not interleave. A failed log write changes nothing.
	_, _ = io.WriteString(l.w, b.String())
}
