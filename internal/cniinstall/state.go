package cniinstall

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"go.uber.org/zap"

	"github.com/mesh-cni/mesh-cni/internal/atomicfile"
)

// record is what the installer remembers about the files it wrote, in memory
// and (with Config.StateDir) in StateDir/cni-install.json.
//
// It is saved before each write, so a crash between saving and writing leaves
// a record that is merely ahead of the file: the next pass sees the file
// without the entry, treats its content as the new original and writes again.
type record struct {
	ConfDir string `json:"confDir"`
	// Current is the file carrying the entry now.
	Current *written `json:"current,omitempty"`
	// Stale are files that carried the entry before (the primary changed, the
	// owned name changed, the mode changed) and still have to be cleaned up.
	Stale []written `json:"stale,omitempty"`
}

// written describes one file the installer wrote.
type written struct {
	Mode string `json:"mode"`
	// File is the base name in ConfDir.
	File string `json:"file"`
	// Data are the bytes written.
	Data []byte `json:"data"`
	// Original is the primary's file as it was without the entry (chain mode
	// only): restoring it gives back the exact bytes, name, mode and owner.
	// Nil when unknown (the file already had the entry when first seen and no
	// record said what it was before); Remove then takes the entry out.
	Original *original `json:"original,omitempty"`
}

type original struct {
	File string      `json:"file"`
	Data []byte      `json:"data"`
	Mode os.FileMode `json:"mode"`
	UID  int         `json:"uid"`
	GID  int         `json:"gid"`
}

func (o *original) options() atomicfile.Options {
	return atomicfile.Options{Mode: o.Mode, Chown: true, UID: o.UID, GID: o.GID}
}

func (in *Installer) statePath() string {
	if in.cfg.StateDir == "" {
		return ""
	}
	return filepath.Join(in.cfg.StateDir, stateFileName)
}

// loadRecord reads the saved record once per Installer.
func (in *Installer) loadRecord() {
	if in.recLoaded {
		return
	}
	in.recLoaded = true
	p := in.statePath()
	if p == "" {
		return
	}
	data, err := os.ReadFile(p)
	if errors.Is(err, os.ErrNotExist) {
		return
	}
	in.hadFile = true
	if err != nil {
		in.log.Warn("Cannot read the install record; Remove will take the entry out instead of restoring original bytes", zap.String("path", p), zap.Error(err))
		return
	}
	var r record
	if err := json.Unmarshal(data, &r); err != nil {
		in.log.Warn("Ignoring a corrupt install record", zap.String("path", p), zap.Error(err))
		return
	}
	if filepath.Clean(r.ConfDir) != filepath.Clean(in.cfg.ConfDir) {
		in.log.Warn("Ignoring an install record for another CNI config directory", zap.String("path", p), zap.String("recordConfDir", r.ConfDir))
		return
	}
	in.rec = r
}

func (in *Installer) saveRecord() error {
	p := in.statePath()
	if p == "" {
		return nil
	}
	if in.rec.Current == nil && len(in.rec.Stale) == 0 {
		if in.saved == nil && !in.hadFile {
			return nil
		}
		if err := atomicfile.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("remove install record: %w", err)
		}
		in.saved, in.hadFile = nil, false
		return nil
	}
	in.rec.ConfDir = in.cfg.ConfDir
	data, err := json.MarshalIndent(in.rec, "", "  ")
	if err != nil {
		return fmt.Errorf("encode install record: %w", err)
	}
	if bytes.Equal(data, in.saved) {
		return nil // every pass saves; only changes cost a write
	}
	if err := os.MkdirAll(in.cfg.StateDir, 0o700); err != nil {
		return fmt.Errorf("create state directory: %w", err)
	}
	if err := atomicfile.WriteFile(p, data, atomicfile.Options{Mode: 0o600}); err != nil {
		return fmt.Errorf("save install record: %w", err)
	}
	in.saved = data
	return nil
}
