package cniplugin

import (
	"bytes"
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

type fixedClock time.Time

func (c fixedClock) Now() time.Time                       { return time.Time(c) }
func (c fixedClock) NewTicker(time.Duration) *time.Ticker { return time.NewTicker(time.Hour) }

// TestLogMatchesZap: the plugin's lines carry the same keys and values as the
// zap configuration it used before (and the agent uses) writes.
func TestLogMatchesZap(t *testing.T) {
	at := time.Date(2026, 3, 4, 5, 6, 7, 891_000_000, time.FixedZone("x", 3600))
	odd := "quote \" backslash \\ nl \n tab \t ctl \x01 html <&> ü invalid \xff end"
	var want bytes.Buffer
	enc := zap.NewProductionEncoderConfig()
	enc.EncodeTime = zapcore.ISO8601TimeEncoder
	z := zap.New(zapcore.NewCore(zapcore.NewJSONEncoder(enc), zapcore.AddSync(&want), zapcore.DebugLevel), zap.WithClock(fixedClock(at))).
		With(zap.String("cmd", "ADD"), zap.String("odd", odd))
	z.Debug("cni call")
	z.Info("pod admitted", zap.String("decision", "DECISION_ENROLLED"), zap.Uint64("netnsCookie", 1<<63+7), zap.Int("valid", -3), zap.Bool("released", true))
	z.Warn(odd, zap.Error(errors.New(odd)), zap.Duration("waited", 1234567891*time.Nanosecond), zap.Duration("parse", 0))
	z.Error("pod not admitted")

	var got bytes.Buffer
	l := newLogger(&got, levelDebug, func() time.Time { return at })
	l = l.With(fStr("cmd", "ADD"), fStr("odd", odd))
	l.Debug("cni call")
	l.Info("pod admitted", fStr("decision", "DECISION_ENROLLED"), fUint("netnsCookie", 1<<63+7), fInt("valid", -3), fBool("released", true))
	l.Warn(odd, fErr(errors.New(odd)), fDur("waited", 1234567891*time.Nanosecond), fDur("parse", 0))
	l.Error("pod not admitted")

	gotLines, wantLines := strings.Split(strings.TrimSpace(got.String()), "\n"), strings.Split(strings.TrimSpace(want.String()), "\n")
	if len(gotLines) != len(wantLines) {
		t.Fatalf("plugin log:\n%s\nzap:\n%s", got.String(), want.String())
	}
	for i := range gotLines {
		var g, w map[string]any
		// Numbers as written, so a uint64 above 2^53 compares exactly.
		for _, c := range []struct {
			line string
			into *map[string]any
		}{{gotLines[i], &g}, {wantLines[i], &w}} {
			d := json.NewDecoder(strings.NewReader(c.line))
			d.UseNumber()
			if err := d.Decode(c.into); err != nil {
				t.Fatalf("line %q: %v", c.line, err)
			}
		}
		if !reflect.DeepEqual(g, w) {
			t.Errorf("line %d:\nplugin %v\nzap    %v", i+1, g, w)
		}
	}
}

func TestLogLevels(t *testing.T) {
	for _, c := range []struct {
		level string
		lines int
	}{{"debug", 4}, {"DEBUG", 4}, {"info", 3}, {"", 3}, {"warn", 2}, {"error", 1}, {"fatal", 0}, {"panic", 0}} {
		lvl, err := parseLevel(c.level)
		if err != nil {
			t.Fatalf("%q: %v", c.level, err)
		}
		if _, zerr := zapcore.ParseLevel(c.level); zerr != nil {
			t.Errorf("%q accepted here, not by zap", c.level)
		}
		var b bytes.Buffer
		l := newLogger(&b, lvl, nil)
		l.Debug("d")
		l.Info("i")
		l.Warn("w")
		l.Error("e")
		if n := bytes.Count(b.Bytes(), []byte("\n")); n != c.lines {
			t.Errorf("level %q: %d lines, want %d", c.level, n, c.lines)
		}
	}
	for _, bad := range []string{"verbose", "Info", "WaRn", "trace", " info"} {
		_, err := parseLevel(bad)
		_, zerr := zapcore.ParseLevel(bad)
		if (err == nil) != (zerr == nil) {
			t.Errorf("%q: accepted here %v, by zap %v", bad, err == nil, zerr == nil)
		}
	}
}
