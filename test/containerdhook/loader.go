package containerdhook

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/fsnotify/fsnotify"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// ErrNoPlugins is the runtime's answer while no chain is loaded
// (DynamicPodNetworkPlugin with a nil chain).
var ErrNoPlugins = errors.New("no gRPC network plugins are currently registered")

// registration is grpcPluginRegistration.
type registration struct {
	Name              string `json:"name"`
	Address           string `json:"address"`
	ManagementAddress string `json:"management_address,omitempty"`
	Primary           bool   `json:"primary,omitempty"`
	Priority          int    `json:"priority,omitempty"`
	DialTimeout       int    `json:"dial_timeout,omitempty"`
}

// Loader is containerd's directory-based plugin loader: grpcPluginSyncer
// (internal/cri/server/grpc_plugin_syncer.go) with the DynamicPodNetworkPlugin
// it swaps chains in (core/networking/plugin_registry.go) and NewGRPCPlugin
// (core/networking/grpc_plugin.go), at the fork commit of the package doc:
//
//   - NewLoader makes the directory (0700) if missing, watches it with
//     fsnotify and loads it once; a failed first load leaves no chain, and
//     then every setup, teardown and health check fails with ErrNoPlugins:
//     containerd's NetworkReady is false and no pod gets a network;
//   - a load reads every *.json file (an unreadable or invalid file, or one
//     without an address, fails the load), sorts primary first, then by
//     priority (0 meaning 100), then by name, and dials each plugin with
//     grpc.DialContext and WithBlock within its dial_timeout (0 meaning 5 s):
//     a socket nobody answers on is retried until the timeout, and one failed
//     dial fails the whole load. A failed load keeps the chain in place
//     before it (at the start: none); a directory without files clears the
//     chain;
//   - events: Chmod and Create are ignored, a Remove or Rename of the
//     directory itself stops the watch, every other event (Write, Remove,
//     Rename of a file) loads again. A file renamed into place arrives as a
//     Create and is seen through the Rename of its temporary name;
//   - the chain is replaced atomically and the previous one closed in the
//     background, which cancels the calls still in flight on it: a setup or
//     health check racing a load can fail with "the client connection is
//     closing", and the runtime's caller retries.
type Loader struct {
	dir     string
	watcher *fsnotify.Watcher
	done    chan struct{}

	mu      sync.RWMutex
	current *Chain
	conns   []*GRPC
	status  error
	loads   int
	loaded  chan struct{} // closed and replaced after every load
}

// NewLoader starts a loader on dir. Close it when done.
func NewLoader(dir string) (*Loader, error) {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, fmt.Errorf("failed to create fsnotify watcher: %w", err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		w.Close()
		return nil, fmt.Errorf("failed to create gRPC plugin conf dir=%s: %w", dir, err)
	}
	if err := w.Add(dir); err != nil {
		w.Close()
		return nil, fmt.Errorf("failed to watch gRPC plugin conf dir %s: %w", dir, err)
	}
	l := &Loader{dir: dir, watcher: w, done: make(chan struct{}), loaded: make(chan struct{})}
	l.finish(l.reload())
	go l.syncLoop()
	return l, nil
}

// Close stops the watch and closes the chain's connections.
func (l *Loader) Close() error {
	err := l.watcher.Close()
	<-l.done
	l.mu.Lock()
	conns := l.conns
	l.current, l.conns = nil, nil
	l.mu.Unlock()
	for _, c := range conns {
		c.Close()
	}
	return err
}

func (l *Loader) syncLoop() {
	defer close(l.done)
	for {
		select {
		case ev, ok := <-l.watcher.Events:
			if !ok {
				return
			}
			if ev.Has(fsnotify.Chmod) || ev.Has(fsnotify.Create) {
				continue
			}
			if ev.Name == l.dir && (ev.Has(fsnotify.Rename) || ev.Has(fsnotify.Remove)) {
				return
			}
			l.finish(l.reload())
		case err, ok := <-l.watcher.Errors:
			if !ok || err != nil {
				return
			}
		}
	}
}

func (l *Loader) finish(err error) {
	l.mu.Lock()
	l.status = err
	l.loads++
	close(l.loaded)
	l.loaded = make(chan struct{})
	l.mu.Unlock()
}

func (l *Loader) reload() error {
	regs, err := l.scan()
	if err != nil {
		return err
	}
	if len(regs) == 0 {
		l.swap(nil, nil)
		return nil
	}
	var (
		conns []*GRPC
		names []string
	)
	for _, reg := range regs {
		timeout := time.Duration(reg.DialTimeout) * time.Second
		if timeout == 0 {
			timeout = 5 * time.Second
		}
		g, err := dialBlocking(reg.Address, timeout)
		if err != nil {
			for _, c := range conns {
				c.Close()
			}
			return fmt.Errorf("failed to connect to gRPC plugin %q at %s: %w", reg.Name, reg.Address, err)
		}
		conns = append(conns, g)
		name := reg.Name
		if name == "" {
			name = reg.Address
		}
		names = append(names, name)
	}
	plugins := make([]Plugin, len(conns))
	for i, c := range conns {
		plugins[i] = c
	}
	l.swap(&Chain{Plugins: plugins, Names: names}, conns)
	return nil
}

func (l *Loader) scan() ([]registration, error) {
	pattern := filepath.Join(l.dir, "*.json")
	matches, err := filepath.Glob(pattern)
	if err != nil {
		return nil, fmt.Errorf("failed to glob %s: %w", pattern, err)
	}
	var regs []registration
	for _, path := range matches {
		data, err := os.ReadFile(path)
		if err != nil {
			return nil, fmt.Errorf("failed to read plugin file %s: %w", path, err)
		}
		var reg registration
		if err := json.Unmarshal(data, &reg); err != nil {
			return nil, fmt.Errorf("invalid plugin file %s: %w", path, err)
		}
		if reg.Address == "" {
			return nil, fmt.Errorf("plugin file %s: address is required", path)
		}
		if reg.Priority == 0 {
			reg.Priority = 100
		}
		if reg.Name == "" {
			reg.Name = filepath.Base(path)
		}
		regs = append(regs, reg)
	}
	sort.Slice(regs, func(i, j int) bool {
		if regs[i].Primary != regs[j].Primary {
			return regs[i].Primary
		}
		if regs[i].Priority != regs[j].Priority {
			return regs[i].Priority < regs[j].Priority
		}
		return regs[i].Name < regs[j].Name
	})
	return regs, nil
}

func (l *Loader) swap(c *Chain, conns []*GRPC) {
	l.mu.Lock()
	old := l.conns
	l.current, l.conns = c, conns
	l.mu.Unlock()
	go func() {
		for _, g := range old {
			g.Close()
		}
	}()
}

// dialBlocking is NewGRPCPlugin's dial: blocking, within timeout.
func dialBlocking(address string, timeout time.Duration) (*GRPC, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	//lint:ignore SA1019 the runtime dials with DialContext and WithBlock; the point is to dial as it does
	conn, err := grpc.DialContext(ctx, "unix://"+address,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithBlock(), //lint:ignore SA1019 as above
		grpc.WithDefaultCallOptions(grpc.ForceCodec(rawCodec{})))
	if err != nil {
		return nil, fmt.Errorf("failed to connect to pod network service at %s: %w", address, err)
	}
	return &GRPC{address: address, conn: conn}, nil
}

// Chain is the chain in place, nil when none is.
func (l *Loader) Chain() *Chain {
	l.mu.RLock()
	defer l.mu.RUnlock()
	return l.current
}

// Names are the plugins of the chain in place, in order; nil when none is.
func (l *Loader) Names() []string {
	if c := l.Chain(); c != nil {
		return c.Names
	}
	return nil
}

// LastStatus is the last load's error (crictl info's
// lastGRPCPluginLoadStatus), nil after a good one.
func (l *Loader) LastStatus() error {
	l.mu.RLock()
	defer l.mu.RUnlock()
	return l.status
}

// WaitLoads waits until the loader has finished n loads in all (the first
// one in NewLoader counts) and returns the count; a test uses it to know a
// change in the directory was acted on.
func (l *Loader) WaitLoads(ctx context.Context, n int) (int, error) {
	for {
		l.mu.RLock()
		got, loaded := l.loads, l.loaded
		l.mu.RUnlock()
		if got >= n {
			return got, nil
		}
		select {
		case <-loaded:
		case <-ctx.Done():
			return got, fmt.Errorf("waiting for load %d (done %d): %w", n, got, ctx.Err())
		}
	}
}

// Loads is the number of loads finished so far.
func (l *Loader) Loads() int {
	l.mu.RLock()
	defer l.mu.RUnlock()
	return l.loads
}

// SettledNetworkReady is NetworkReady from a call that no load interrupted:
// a load closes the previous chain's connections under the calls in flight
// (as in the runtime), which a test waiting for a steady state must not read
// as the hook's answer.
func (l *Loader) SettledNetworkReady(ctx context.Context) error {
	for {
		n := l.Loads()
		err := l.NetworkReady(ctx)
		if l.Loads() == n || ctx.Err() != nil {
			return err
		}
	}
}

// WaitChain waits until the chain in place is names (none: no chain),
// checking after every load.
func (l *Loader) WaitChain(ctx context.Context, names ...string) error {
	n := l.Loads()
	for !slices.Equal(l.Names(), names) {
		n++
		if _, err := l.WaitLoads(ctx, n); err != nil {
			return fmt.Errorf("the chain is %v (last load: %v), want %v: %w", l.Names(), l.LastStatus(), names, err)
		}
	}
	return nil
}

// Setup is the runtime's pod network setup through the chain in place.
func (l *Loader) Setup(ctx context.Context, pod Pod) (*Result, error) {
	c := l.Chain()
	if c == nil {
		return nil, ErrNoPlugins
	}
	return c.Setup(ctx, pod)
}

// Teardown is the runtime's teardown through the chain in place.
func (l *Loader) Teardown(ctx context.Context, pod Pod, final *Result) error {
	c := l.Chain()
	if c == nil {
		return ErrNoPlugins
	}
	return c.Teardown(ctx, pod, final)
}

// NetworkReady is the runtime's NetworkReady condition: nil when the chain in
// place is healthy.
func (l *Loader) NetworkReady(ctx context.Context) error {
	c := l.Chain()
	if c == nil {
		return ErrNoPlugins
	}
	return c.NetworkReady(ctx)
}
