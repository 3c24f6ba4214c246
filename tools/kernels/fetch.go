package kernels

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// ErrUnavailable says a kernel's archive could not be reached and no earlier
// copy of its index is cached.
var ErrUnavailable = errors.New("archive unavailable")

// Unpacked is a kernel unpacked in the cache: its image and its modules, indexed.
type Unpacked struct {
	// Release is the kernel's `uname -r`.
	Release string
	// Version is the first package's version, Packages each name=version.
	Version  string
	Packages []string
	// Image is the bzImage QEMU boots; Modules is lib/modules/<release>.
	Image   string
	Modules string
}

// Fetch finds the newest build of k in its archive, downloads its packages with
// apt (which checks the archive's signature on the index, and each package
// against the index's SHA256), unpacks them and indexes the modules with
// busybox depmod, into cache. A build already unpacked is reused without a
// download. Nothing is installed: the machine's own apt state and /boot are not
// touched, each archive gets an apt configuration of its own under cache.
func Fetch(ctx context.Context, cache string, k Kernel, log io.Writer) (*Unpacked, error) {
	a := archives[k.Archive]
	aptDir := filepath.Join(cache, "apt", k.Archive+"-"+strings.Join(k.Suites, "+"))
	unlock, err := lock(ctx, aptDir)
	if err != nil {
		return nil, err
	}
	defer unlock()
	conf, err := writeAptConfig(aptDir, a, k.Suites)
	if err != nil {
		return nil, err
	}
	run := func(dir string, args ...string) ([]byte, error) {
		cmd := exec.CommandContext(ctx, args[0], args[1:]...)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "APT_CONFIG="+conf, "LC_ALL=C")
		out, err := cmd.CombinedOutput()
		if err != nil {
			return out, fmt.Errorf("%s: %w\n%s", strings.Join(args, " "), err, tail(out, 20))
		}
		return out, nil
	}
	// apt-get update exits 0 when it could not fetch an index but warns
	// "Failed to fetch": either way only the lists it left count.
	out, err := run("", "apt-get", "update", "-q")
	offline := err != nil || strings.Contains(string(out), "Failed to fetch")
	lists, _ := filepath.Glob(filepath.Join(aptDir, "state", "lists", "*Packages*"))
	if len(lists) == 0 {
		return nil, fmt.Errorf("%w: no index fetched from %s: %s", ErrUnavailable, a.url, tail(out, 3))
	}
	if offline {
		fmt.Fprintf(log, "kernels: %s: apt-get update failed, using the index cached before:\n%s\n", k.Name, tail(out, 5))
	}

	first := pattern(k.Packages[0])
	prefix, _, _ := strings.Cut(k.Packages[0], "*")
	out, err = run("", "apt-cache", "pkgnames", prefix)
	if err != nil {
		return nil, err
	}
	var builds []string
	for _, name := range strings.Fields(string(out)) {
		if m := first.FindStringSubmatch(name); m != nil {
			builds = append(builds, m[1])
		}
	}
	if len(builds) == 0 {
		return nil, fmt.Errorf("no package %s in %s %s", k.Packages[0], k.Archive, strings.Join(k.Suites, ","))
	}
	slices.SortFunc(builds, naturalCompare)
	build := builds[len(builds)-1]

	u := &Unpacked{}
	for _, p := range k.Packages {
		name := strings.Replace(p, "*", build, 1)
		out, err := run("", "apt-cache", "show", "--no-all-versions", name)
		if err != nil {
			return nil, err
		}
		version := field(string(out), "Version")
		if version == "" {
			return nil, fmt.Errorf("apt-cache show %s: no Version", name)
		}
		u.Packages = append(u.Packages, name+"="+version)
	}
	u.Version = strings.SplitN(u.Packages[0], "=", 2)[1]

	kernelsDir := filepath.Join(cache, "kernels")
	dir := filepath.Join(kernelsDir, strings.ReplaceAll(u.Packages[0], "=", "_"))
	if done, err := readUnpacked(dir); err == nil {
		return done, nil
	}
	fmt.Fprintf(log, "kernels: %s: downloading %s\n", k.Name, strings.Join(u.Packages, " "))
	if err := os.MkdirAll(kernelsDir, 0o755); err != nil {
		return nil, err
	}
	tmp, err := os.MkdirTemp(kernelsDir, ".unpack-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	debs := filepath.Join(tmp, "debs")
	root := filepath.Join(tmp, "root")
	if err := os.Mkdir(debs, 0o755); err != nil {
		return nil, err
	}
	if _, err := run(debs, append([]string{"apt-get", "download", "-q"}, u.Packages...)...); err != nil {
		if offline {
			// The archive was not reachable for the index either.
			return nil, fmt.Errorf("%w: %w", ErrUnavailable, err)
		}
		return nil, err
	}
	files, err := filepath.Glob(filepath.Join(debs, "*.deb"))
	if err != nil || len(files) != len(u.Packages) {
		return nil, fmt.Errorf("apt-get download left %d packages in %s, want %d", len(files), debs, len(u.Packages))
	}
	for _, f := range files {
		if _, err := run("", "dpkg-deb", "-x", f, root); err != nil {
			return nil, err
		}
	}
	if err := os.RemoveAll(debs); err != nil {
		return nil, err
	}
	if err := u.locate(root); err != nil {
		return nil, fmt.Errorf("%s: %w", strings.Join(u.Packages, " "), err)
	}
	// The packages leave modules.dep to their install scripts; busybox's depmod
	// writes it (and modules.alias, which the guest's modprobe needs) without
	// installing anything.
	base := strings.TrimSuffix(filepath.Dir(filepath.Dir(u.Modules)), "/lib")
	if _, err := run("", "busybox", "depmod", "-b", base, u.Release); err != nil {
		return nil, err
	}
	if err := u.save(tmp, root, dir); err != nil {
		return nil, err
	}
	prune(kernelsDir, k.Packages[0], dir, log)
	return readUnpacked(dir)
}

// locate finds the modules directory and the image in an unpacked tree: Debian
// 12 and Ubuntu put them in /lib/modules/<release> and /boot/vmlinuz-<release>,
// newer Debian packages in /usr/lib/modules/<release>/vmlinuz.
func (u *Unpacked) locate(root string) error {
	mods, _ := filepath.Glob(filepath.Join(root, "lib", "modules", "*"))
	more, _ := filepath.Glob(filepath.Join(root, "usr", "lib", "modules", "*"))
	mods = append(mods, more...)
	if len(mods) != 1 {
		return fmt.Errorf("want one lib/modules/<release> directory, found %d: %v", len(mods), mods)
	}
	u.Modules = mods[0]
	u.Release = filepath.Base(u.Modules)
	for _, img := range []string{filepath.Join(root, "boot", "vmlinuz-"+u.Release), filepath.Join(u.Modules, "vmlinuz")} {
		if _, err := os.Stat(img); err == nil {
			u.Image = img
			return nil
		}
	}
	return fmt.Errorf("no kernel image for %s", u.Release)
}

const unpackedFile = "unpacked.json"

// save moves the unpacked tree to its place in the cache and records it last,
// so that a directory with the record is always complete.
func (u *Unpacked) save(tmp, root, dir string) error {
	rel := func(p string) string { return strings.TrimPrefix(p, root) }
	rec := *u
	rec.Image, rec.Modules = rel(u.Image), rel(u.Modules)
	data, err := json.MarshalIndent(rec, "", "  ")
	if err != nil {
		return err
	}
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	if err := os.Rename(root, dir); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, unpackedFile), data, 0o644)
}

func readUnpacked(dir string) (*Unpacked, error) {
	u, err := readJSON[Unpacked](filepath.Join(dir, unpackedFile))
	if err != nil {
		return nil, err
	}
	u.Image, u.Modules = filepath.Join(dir, u.Image), filepath.Join(dir, u.Modules)
	return u, nil
}

// prune removes older builds of the same kernel row, so the cache holds one
// build per row.
func prune(kernelsDir, pkg, keep string, log io.Writer) {
	re := pattern(pkg)
	entries, _ := os.ReadDir(kernelsDir)
	for _, e := range entries {
		name, _, _ := strings.Cut(e.Name(), "_")
		p := filepath.Join(kernelsDir, e.Name())
		if p != keep && re.MatchString(name) {
			fmt.Fprintf(log, "kernels: removing the older build %s from the cache\n", p)
			_ = os.RemoveAll(p)
		}
	}
}

// writeAptConfig writes an apt configuration that reads nothing of the
// machine's: its own sources, state, cache and no configuration parts.
func writeAptConfig(dir string, a archive, suites []string) (string, error) {
	for _, d := range []string{"state/lists/partial", "cache/archives/partial", "empty"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			return "", err
		}
	}
	keyring := a.keyring
	if a.key != nil {
		keyring = filepath.Join(dir, "archive-key.asc")
		if err := os.WriteFile(keyring, a.key, 0o644); err != nil {
			return "", err
		}
	}
	var sources strings.Builder
	for _, s := range suites {
		fmt.Fprintf(&sources, "deb [arch=amd64 signed-by=%s] %s %s main\n", keyring, a.suiteURL(s), s)
	}
	if err := os.WriteFile(filepath.Join(dir, "sources.list"), []byte(sources.String()), 0o644); err != nil {
		return "", err
	}
	status := filepath.Join(dir, "status")
	if err := os.WriteFile(status, nil, 0o644); err != nil {
		return "", err
	}
	empty := filepath.Join(dir, "empty")
	// Check-Valid-Until is off: the signature is still checked, but mirrors
	// can lag behind a suite that is re-signed weekly (sid's Release was weeks
	// past its Valid-Until on the mirror this was written against).
	conf := fmt.Sprintf(`Dir::Etc::SourceList "%[1]s/sources.list";
Dir::Etc::SourceParts "%[2]s";
Dir::Etc::Parts "%[2]s";
Dir::Etc::Preferences "%[2]s/none";
Dir::Etc::PreferencesParts "%[2]s";
Dir::State "%[1]s/state";
Dir::State::status "%[3]s";
Dir::Cache "%[1]s/cache";
APT::Architecture "amd64";
APT::Architectures { "amd64"; };
APT::Sandbox::User "root";
Acquire::Languages "none";
Acquire::Check-Valid-Until "false";
`, dir, empty, status)
	path := filepath.Join(dir, "apt.conf")
	return path, os.WriteFile(path, []byte(conf), 0o644)
}

// lock takes an exclusive lock on dir's lock file, so runs in parallel share one
// apt state and one unpacked copy per kernel.
func lock(ctx context.Context, dir string) (func(), error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(filepath.Join(dir, ".lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return func() { f.Close() }, nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("lock %s: %w", dir, err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("lock %s: %w", dir, ctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// field is a control-file field's value ("Version: 1.2" -> "1.2").
func field(control, name string) string {
	for _, line := range strings.Split(control, "\n") {
		if v, ok := strings.CutPrefix(line, name+":"); ok {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

var runs = regexp.MustCompile(`[0-9]+|[^0-9]+`)

// naturalCompare orders builds by their numbers: 6.1.0-9 before 6.1.0-10.
func naturalCompare(a, b string) int {
	x, y := runs.FindAllString(a, -1), runs.FindAllString(b, -1)
	for i := 0; i < len(x) && i < len(y); i++ {
		if x[i] == y[i] {
			continue
		}
		if isDigit(x[i][0]) && isDigit(y[i][0]) {
			xs, ys := strings.TrimLeft(x[i], "0"), strings.TrimLeft(y[i], "0")
			if len(xs) != len(ys) {
				return len(xs) - len(ys)
			}
		}
		return strings.Compare(x[i], y[i])
	}
	return len(x) - len(y)
}

func isDigit(c byte) bool { return c >= '0' && c <= '9' }

// tail is the last n lines of out.
func tail(out []byte, n int) string {
	lines := strings.Split(strings.TrimRight(string(out), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
