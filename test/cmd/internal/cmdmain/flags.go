package cmdmain

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
)

// Parse parses args into fs. done is true when the command is to exit at once
// with code: 0 after -h, 2 for flags fs refused (it has said why).
func Parse(fs *flag.FlagSet, args []string) (code int, done bool) {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0, true
		}
		return 2, true
	}
	return 0, false
}

// Record is a -record file: JSON lines appended to it. A nil *Record records
// nothing.
type Record struct {
	f *os.File
}

// OpenRecord opens the file at path for appending, creating it if need be;
// with an empty path it returns a nil *Record.
func OpenRecord(path string) (*Record, error) {
	if path == "" {
		return nil, nil
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		return nil, err
	}
	return &Record{f: f}, nil
}

// Write appends v as one JSON line, in one write on an O_APPEND file so that
// the lines of concurrent writers never interleave.
func (r *Record) Write(v any) error {
	if r == nil {
		return nil
	}
	line, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("encode record: %w", err)
	}
	_, err = r.f.Write(append(line, '\n'))
	return err
}

// Close closes the file.
func (r *Record) Close() error {
	if r == nil {
		return nil
	}
	return r.f.Close()
}
