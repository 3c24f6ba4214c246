package cniinstall

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/mesh-cni/mesh-cni/internal/cniinstall/cniconf"
)

// Mode says where the mesh-cni chain entry lives.
type Mode int

const (
	// ModeChain appends the entry to the primary CNI's own config file (the
	// file the runtime loads): one file, nothing extra for the runtime to pick.
	ModeChain Mode = iota
	// ModeOwned leaves the primary's file untouched and writes a merged copy
	// (the primary's plugins plus mesh-cni) under a name that sorts before
	// every other config file, kept in sync with the primary. For primaries
	// whose file is read-only, a symlink, or rewritten constantly.
	ModeOwned
)

func (m Mode) String() string {
	switch m {
	case ModeChain:
		return "chain"
	case ModeOwned:
		return "owned"
	default:
		return fmt.Sprintf("Mode(%d)", int(m))
	}
}

// Config configures an Installer. ConfDir and Entry are required.
type Config struct {
	// ConfDir is the CNI config directory the runtime loads (/etc/cni/net.d).
	ConfDir string
	// Entry is the mesh-cni plugin config added as the last plugin of the
	// chain: a struct, a map or json.RawMessage encoding a JSON object with a
	// "type". Every plugin of that type in a config is treated as ours.
	Entry any
	// Mode selects chain (default) or owned-config installation.
	Mode Mode
	// PrimaryFile, when set, is the base name of the primary config in
	// ConfDir, used instead of "the first valid file in lexical order" (for a
	// runtime told which network to use, such as CRI-O's cni_default_network).
	PrimaryFile string
	// OwnedName names the owned config: files "<prefix>-<OwnedName>.conflist"
	// are reserved for the installer (default "mesh-cni", so the usual name is
	// "00-mesh-cni.conflist"). Such files are never taken as the primary.
	OwnedName string
	// StateDir keeps the backup of the primary's original bytes (and what was
	// written) so that Remove restores the file exactly, also after a restart.
	// Empty keeps it in memory only: Remove after a restart then takes the
	// entry out instead of restoring bytes.
	StateDir string
	// MinCNIVersion and MaxCNIVersion bound the primary's cniVersion (the
	// result keeps the primary's version); default 0.3.0 and 1.1.0, the range
	// the mesh-cni plugin supports.
	MinCNIVersion, MaxCNIVersion string
	// Debounce is how long Run waits after the last change in ConfDir before it
	// repairs (default 50ms); MaxDelay bounds the wait under a steady stream of
	// changes (default 250ms). Both stay well under the one second a repair
	// may take.
	Debounce, MaxDelay time.Duration
	// Resync is how often Run re-checks without an event, in case an event was
	// lost (default 30s).
	Resync time.Duration
	// RepairWarnCount and RepairWarnWindow: more than RepairWarnCount repairs
	// within RepairWarnWindow log a warning that something keeps reverting the
	// config (default 5 per minute).
	RepairWarnCount  int
	RepairWarnWindow time.Duration
	// Logger receives the installer's logs (default: none).
	Logger *zap.Logger
	// OnChange, when set, is called with the new status after every change of
	// readiness, of the files in use, or of the repair counters. It runs on the
	// installer's goroutine: it must not block or call back into the Installer.
	OnChange func(Status)
}

// Defaults.
const (
	DefaultOwnedName     = "mesh-cni"
	DefaultMinCNIVersion = "0.3.0"
	DefaultMaxCNIVersion = "1.1.0"
	stateFileName        = "cni-install.json"
)

func (c *Config) applyDefaults() {
	if c.ConfDir != "" {
		c.ConfDir = filepath.Clean(c.ConfDir)
	}
	if c.OwnedName == "" {
		c.OwnedName = DefaultOwnedName
	}
	if c.MinCNIVersion == "" {
		c.MinCNIVersion = DefaultMinCNIVersion
	}
	if c.MaxCNIVersion == "" {
		c.MaxCNIVersion = DefaultMaxCNIVersion
	}
	if c.Debounce <= 0 {
		c.Debounce = 50 * time.Millisecond
	}
	if c.MaxDelay < c.Debounce {
		c.MaxDelay = max(250*time.Millisecond, c.Debounce)
	}
	if c.Resync <= 0 {
		c.Resync = 30 * time.Second
	}
	if c.RepairWarnCount <= 0 {
		c.RepairWarnCount = 5
	}
	if c.RepairWarnWindow <= 0 {
		c.RepairWarnWindow = time.Minute
	}
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
}

func (c *Config) validate() error {
	if c.ConfDir == "" {
		return errors.New("install: ConfDir is required")
	}
	if c.Entry == nil {
		return errors.New("install: Entry is required")
	}
	if c.Mode != ModeChain && c.Mode != ModeOwned {
		return fmt.Errorf("install: unknown mode %v", c.Mode)
	}
	if c.PrimaryFile != "" {
		if c.PrimaryFile != filepath.Base(c.PrimaryFile) || cniconf.KindOf(c.PrimaryFile) == cniconf.KindNone {
			return fmt.Errorf("install: PrimaryFile %q must be a .conf, .conflist or .json file name inside ConfDir", c.PrimaryFile)
		}
		if c.isOwned(c.PrimaryFile) {
			return fmt.Errorf("install: PrimaryFile %q has the name reserved for the owned config", c.PrimaryFile)
		}
	}
	if strings.ContainsAny(c.OwnedName, `/\`) {
		return fmt.Errorf("install: OwnedName %q must not contain a path separator", c.OwnedName)
	}
	if err := cniconf.CheckVersion(c.MinCNIVersion, c.MinCNIVersion, c.MaxCNIVersion); err != nil {
		return fmt.Errorf("install: CNI version range: %w", err)
	}
	return nil
}

// ownedSuffix ends every owned config's name.
func (c *Config) ownedSuffix() string { return "-" + c.OwnedName + ".conflist" }

func (c *Config) isOwned(name string) bool { return strings.HasSuffix(name, c.ownedSuffix()) }

// ownedNameBefore returns an owned config name that sorts before first (the
// smallest other config file name; "" when there is none): "00-<OwnedName>.conflist"
// when that already does, else a name derived from first. Lexical order is
// what runtimes use to pick the config, so the owned file must really come
// first.
func (c *Config) ownedNameBefore(first string) string {
	def := "00" + c.ownedSuffix()
	if first == "" || def < first {
		return def
	}
	// Copy first up to its first byte above '0' and put a '0' there: the
	// result is smaller than first at that position whatever follows. The
	// extension of first has letters, so such a byte exists.
	for i := 0; i < len(first); i++ {
		if first[i] > '0' {
			return first[:i] + "0" + c.ownedSuffix()
		}
	}
	return def
}
