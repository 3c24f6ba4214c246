package ztunnel

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"net/netip"
	"sync"
	"time"

	"go.uber.org/zap"
)

// Workload is a workload as istiod's ambient index holds it: what ztunnel learns
// about a destination over WDS. The double reads it from istiod's
// /debug/ambientz instead, the same index as JSON.
type Workload struct {
	UID, Name, Namespace, ServiceAccount, Node string
	Addresses                                  []netip.Addr
	// HBONE: istiod gives the workload tunnel protocol HBONE (its pod is
	// captured), so peers reach it through its 15008.
	HBONE bool
}

// Directory answers which workload holds an address.
type Directory interface {
	Lookup(netip.Addr) (Workload, bool)
}

// ambientWorkload is an entry of /debug/ambientz's workloads: the workload
// proto as jsonpb writes it (lower camel case, defaults omitted, bytes in
// base64; the handler rewrites each address to the bytes of its text form).
type ambientWorkload struct {
	UID            string   `json:"uid"`
	Name           string   `json:"name"`
	Namespace      string   `json:"namespace"`
	ServiceAccount string   `json:"serviceAccount"`
	Node           string   `json:"node"`
	Addresses      []string `json:"addresses"`
	TunnelProtocol string   `json:"tunnelProtocol"`
}

// FetchAmbient reads istiod's ambient index from its debug endpoint (base is
// e.g. http://127.0.0.1:15014; loopback callers need no credential).
func FetchAmbient(ctx context.Context, base string) ([]Workload, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/debug/ambientz", nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("istiod ambient index: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("istiod ambient index: %s", resp.Status)
	}
	var body struct {
		Workloads []ambientWorkload `json:"workloads"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return nil, fmt.Errorf("istiod ambient index: %w", err)
	}
	out := make([]Workload, 0, len(body.Workloads))
	for _, w := range body.Workloads {
		wl := Workload{UID: w.UID, Name: w.Name, Namespace: w.Namespace, ServiceAccount: w.ServiceAccount,
			Node: w.Node, HBONE: w.TunnelProtocol == "HBONE"}
		for _, a := range w.Addresses {
			text, err := base64.StdEncoding.DecodeString(a)
			if err != nil {
				continue
			}
			if ip, err := netip.ParseAddr(string(text)); err == nil {
				wl.Addresses = append(wl.Addresses, ip)
			}
		}
		out = append(out, wl)
	}
	return out, nil
}

// IstiodDirectory keeps istiod's ambient index, read again every interval.
type IstiodDirectory struct {
	mu     sync.Mutex
	byAddr map[netip.Addr]Workload
}

// WatchIstiod reads istiod's index at base until ctx ends.
func WatchIstiod(ctx context.Context, log *zap.Logger, base string, interval time.Duration) *IstiodDirectory {
	d := &IstiodDirectory{byAddr: map[netip.Addr]Workload{}}
	go func() {
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			ws, err := FetchAmbient(ctx, base)
			if err != nil {
				log.Debug("istiod", zap.Error(err))
			} else {
				m := map[netip.Addr]Workload{}
				for _, w := range ws {
					for _, a := range w.Addresses {
						m[a] = w
					}
				}
				d.mu.Lock()
				d.byAddr = m
				d.mu.Unlock()
			}
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}()
	return d
}

// Lookup implements Directory.
func (d *IstiodDirectory) Lookup(a netip.Addr) (Workload, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	w, ok := d.byAddr[a.Unmap()]
	return w, ok
}
