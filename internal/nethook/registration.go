package nethook

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/mesh-cni/mesh-cni/internal/atomicfile"
)

// Registration defaults.
const (
	// DefaultPriority places the mesh after the primary network plugin: the
	// runtime runs the primary first and then the non-primary plugins by
	// priority, lower first, with 100 the default. 200 runs after plugins that
	// keep the default, so the mesh sees their interfaces in prev_result.
	DefaultPriority = 200
	// DefaultDialTimeout is the runtime's own default.
	DefaultDialTimeout = 5 * time.Second

	registrationMode = 0o644
	registrationDir  = 0o755
)

// Registration is one plugin's registration file in the runtime's plugin
// directory (e.g. /etc/containerd/net.d):
//
//	{"name": "...", "address": "<socket>", "management_address": "...",
//	 "primary": false, "priority": 200, "dial_timeout": 5}
//
// The runtime watches the directory; the file is named <Name>.json.
type Registration struct {
	Name string
	// Address is the absolute path of the PodNetworkLifecycle socket.
	Address string
	// ManagementAddress is optional and left out when empty.
	ManagementAddress string
	// Primary is false for the mesh: it sets up no network of its own.
	Primary bool
	// Priority orders the non-primary plugins, lower first; 0 means
	// DefaultPriority.
	Priority int
	// DialTimeout is written in whole seconds, rounded up; 0 means
	// DefaultDialTimeout.
	DialTimeout time.Duration
}

type registrationFile struct {
	Name              string `json:"name"`
	Address           string `json:"address"`
	ManagementAddress string `json:"management_address,omitempty"`
	Primary           bool   `json:"primary"`
	Priority          int    `json:"priority"`
	DialTimeout       int    `json:"dial_timeout"`
}

var pluginName = regexp.MustCompile(`^[a-z0-9]([a-z0-9._-]{0,62})$`)

// RegistrationPath is where WriteRegistration puts the file for name.
func RegistrationPath(dir, name string) string {
	return filepath.Join(dir, name+".json")
}

// WriteRegistration writes reg's file into dir (created 0755 if missing) and
// returns its path. The file is written to a temporary name the runtime does
// not read (no .json suffix), synced, made 0644 and renamed into place, so a
// watching runtime never reads half a registration.
func WriteRegistration(dir string, reg Registration) (string, error) {
	if !pluginName.MatchString(reg.Name) {
		return "", fmt.Errorf("registration name %q: must be 1-63 characters of a-z 0-9 . _ - starting with a letter or digit", reg.Name)
	}
	addr := strings.TrimPrefix(reg.Address, "unix://")
	if !filepath.IsAbs(addr) {
		return "", fmt.Errorf("registration %s: address %q must be an absolute socket path", reg.Name, reg.Address)
	}
	if reg.Priority == 0 {
		reg.Priority = DefaultPriority
	}
	if reg.DialTimeout <= 0 {
		reg.DialTimeout = DefaultDialTimeout
	}
	data, err := json.MarshalIndent(registrationFile{
		Name:              reg.Name,
		Address:           reg.Address,
		ManagementAddress: reg.ManagementAddress,
		Primary:           reg.Primary,
		Priority:          reg.Priority,
		DialTimeout:       int((reg.DialTimeout + time.Second - 1) / time.Second),
	}, "", "  ")
	if err != nil {
		return "", fmt.Errorf("registration %s: %w", reg.Name, err)
	}
	if err := os.MkdirAll(dir, registrationDir); err != nil {
		return "", fmt.Errorf("registration directory %s: %w", dir, err)
	}
	path := RegistrationPath(dir, reg.Name)
	// The runtime may read the file as another user: registrationMode, not
	// the temporary file's 0600. Durable, file and directory: a runtime that
	// restarts after a crash must find the hook registered.
	if err := atomicfile.WriteFile(path, append(data, '\n'), atomicfile.Options{Mode: registrationMode}); err != nil {
		return "", fmt.Errorf("write registration %s: %w", path, err)
	}
	return path, nil
}

// RemoveRegistration removes name's registration file from dir (on the
// hook's stop, and by `mesh-agent hook --unregister`). A file that is not
// there is fine.
func RemoveRegistration(dir, name string) error {
	if !pluginName.MatchString(name) {
		return fmt.Errorf("registration name %q is not a plugin name", name)
	}
	path := RegistrationPath(dir, name)
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove registration %s: %w", path, err)
	}
	return nil
}

// ReadRegistration reads a registration file, as the runtime would.
func ReadRegistration(path string) (Registration, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return Registration{}, fmt.Errorf("read registration: %w", err)
	}
	var f registrationFile
	if err := json.Unmarshal(data, &f); err != nil {
		return Registration{}, fmt.Errorf("parse registration %s: %w", path, err)
	}
	return Registration{
		Name:              f.Name,
		Address:           f.Address,
		ManagementAddress: f.ManagementAddress,
		Primary:           f.Primary,
		Priority:          f.Priority,
		DialTimeout:       time.Duration(f.DialTimeout) * time.Second,
	}, nil
}
