package cniplugin

import (
	"fmt"
	"io"
	"log/slog"
	"strings"
	"time"
)

// The plugin's log: one JSON object per line with the keys and values the
// agent's zap logger writes ("level" in lower case, "ts" as
// 2006-01-02T15:04:05.000Z0700, "msg", durations in seconds), so both read
// alike. It is log/slog's JSON handler, not zap: zap brings net/http and
// crypto/tls with it, about sixty packages whose initialization every plugin
// process paid for a handful of log lines.

// level is a log severity, as logLevel names it.
type level = slog.Level

const (
	levelDebug = slog.LevelDebug
	levelInfo  = slog.LevelInfo
	levelWarn  = slog.LevelWarn
	levelError = slog.LevelError
	// levelOff is above every message the plugin writes (zap's dpanic, panic
	// and fatal, which logLevel also accepts).
	levelOff = slog.LevelError + 4
)

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

// logger is the plugin's logger.
type logger = slog.Logger

// newLogger writes lines at min and above to w, one write per line: with
// O_APPEND, lines of plugins logging to the same file at once do not
// interleave. now, when set, stamps the lines instead of the clock (tests).
func newLogger(w io.Writer, min level, now func() time.Time) *logger {
	return slog.New(slog.NewJSONHandler(w, &slog.HandlerOptions{
		Level: min,
		ReplaceAttr: func(groups []string, a slog.Attr) slog.Attr {
			if len(groups) > 0 {
				return a
			}
			switch {
			case a.Key == slog.TimeKey:
				t := a.Value.Time()
				if now != nil {
					t = now()
				}
				return slog.String("ts", t.Format("2006-01-02T15:04:05.000Z0700"))
			case a.Key == slog.LevelKey:
				return slog.String(slog.LevelKey, strings.ToLower(a.Value.Resolve().String()))
			case a.Value.Kind() == slog.KindDuration:
				return slog.Float64(a.Key, a.Value.Duration().Seconds())
			}
			return a
		},
	}))
}

// Field constructors, named as the plugin's log calls use them.
func fStr(key, v string) slog.Attr               { return slog.String(key, v) }
func fInt(key string, v int) slog.Attr           { return slog.Int(key, v) }
func fUint(key string, v uint64) slog.Attr       { return slog.Uint64(key, v) }
func fBool(key string, v bool) slog.Attr         { return slog.Bool(key, v) }
func fDur(key string, d time.Duration) slog.Attr { return slog.Duration(key, d) }

func fErr(err error) slog.Attr {
	if err == nil {
		return slog.Any("error", nil)
	}
	return slog.String("error", err.Error())
}
