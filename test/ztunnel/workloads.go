package ztunnel

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"net/netip"
)

// Workload is a workload as istiod's ambient index holds it: what ztunnel learns
// over WDS (WatchWDS), and what istiod's /debug/ambientz shows of the same
// index (FetchAmbient).
type Workload struct {
	UID, Name, Namespace, ServiceAccount, Node, TrustDomain string
	Addresses                                               []netip.Addr
	// HBONE: istiod gives the workload tunnel protocol HBONE (its pod is
	// captured), so peers reach it through its 15008.
	HBONE bool
}

// Identity is the workload's SPIFFE identity, what its certificate names.
func (w Workload) Identity() string {
	return Identity(w.TrustDomain, w.Namespace, w.ServiceAccount)
}

// Identity is the SPIFFE identity of a service account (identity.rs
// Identity::Spiffe).
func Identity(trustDomain, namespace, serviceAccount string) string {
	return "spiffe://" + trustDomain + "/ns/" + namespace + "/sa/" + serviceAccount
}

// Directory is istiod's view of the workloads, as ztunnel holds it.
type Directory interface {
	// Lookup answers which workload holds an address (a destination).
	Lookup(netip.Addr) (Workload, bool)
	// Local waits, until ctx ends, for the workload of node that a pod's
	// ZDS workload_info names; its error wraps ErrUnknownWorkload.
	Local(ctx context.Context, node string, info WorkloadInfo) (Workload, error)
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
	TrustDomain    string   `json:"trustDomain"`
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
			Node: w.Node, TrustDomain: w.TrustDomain, HBONE: w.TunnelProtocol == "HBONE"}
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
