// Package istiorules removes what istio-cni's node agent leaves in an ambient
// pod's network namespace, when mesh-cni takes such a pod over in place.
//
// istio-cni captures a pod with iptables rules in the pod's namespace: chains
// ISTIO_PRERT and ISTIO_OUTPUT in its nat, mangle and (with DNS capture) raw
// tables, each entered by a rule of PREROUTING or OUTPUT that is a bare jump to
// it (no match), in both families. Those names and that shape are istio-cni's
// own (istio.io/istio cni/pkg/iptables); nothing else is touched: a rule of
// the pod's that jumps to one of those chains under a match stays, and the
// chain it holds then stays too, emptied.
//
// Only the nftables backend (iptables-nft, the default of current
// distributions) is read and changed. iptables-legacy tables cannot be
// changed without an iptables binary, which the agent's image does not
// have; Remove reports their presence instead.
//
// istio-cni's policy route (fwmark 0x111/0xfff, priority 32764, table 100
// with local default routes on lo) is mesh-cni's reply route too, rule for
// rule (internal/redirect): it is left in place, as mesh-cni's.
package istiorules

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"

	"github.com/mesh-cni/mesh-cni/internal/netns"
)

// istio-cni's in-pod chains, the base chains that enter them, and the tables
// that hold them.
const (
	ChainPrerouting = "ISTIO_PRERT"
	ChainOutput     = "ISTIO_OUTPUT"
)

var (
	tables = []string{"nat", "mangle", "raw"}
	// entries is the base chain each of istio-cni's chains is jumped to
	// from.
	entries = map[string]string{"PREROUTING": ChainPrerouting, "OUTPUT": ChainOutput}
)

// ErrLegacyTables is wrapped by Remove's error when the namespace has
// iptables-legacy tables, where istio-cni's rules may be and are not removed.
var ErrLegacyTables = errors.New("iptables-legacy tables present: istio-cni's rules there, if any, are not removed")

// Result is what Remove found and removed.
type Result struct {
	// Jumps are the entry rules removed ("ip nat OUTPUT -> ISTIO_OUTPUT").
	Jumps []string
	// Chains are the chains removed ("ip6 mangle ISTIO_PRERT").
	Chains []string
	// Kept are istio-cni's chains emptied but kept, because a rule that is
	// not istio-cni's still jumps to them.
	Kept []string
}

// Found reports whether anything of istio-cni's was there.
func (r Result) Found() bool { return len(r.Jumps)+len(r.Chains)+len(r.Kept) > 0 }

// Remove removes istio-cni's in-pod chains and their entry rules from the
// network namespace ns. It is idempotent: a namespace without them is left
// as it is and Result is empty. Every problem is returned, joined; what could
// be removed is removed regardless.
func Remove(ns *os.File) (Result, error) {
	var res Result
	conn, err := nftables.New(nftables.WithNetNSFd(int(ns.Fd())))
	if err != nil {
		return res, fmt.Errorf("nftables of the pod's namespace: %w", err)
	}
	var errs []error
	for _, fam := range []nftables.TableFamily{nftables.TableFamilyIPv4, nftables.TableFamilyIPv6} {
		if err := removeFamily(conn, fam, &res); err != nil {
			errs = append(errs, err)
		}
	}
	if legacy, err := legacyTables(ns); err != nil {
		errs = append(errs, err)
	} else if len(legacy) > 0 {
		errs = append(errs, fmt.Errorf("%w (%s)", ErrLegacyTables, strings.Join(legacy, ", ")))
	}
	return res, errors.Join(errs...)
}

func familyName(f nftables.TableFamily) string {
	if f == nftables.TableFamilyIPv6 {
		return "ip6"
	}
	return "ip"
}

func removeFamily(conn *nftables.Conn, fam nftables.TableFamily, res *Result) error {
	chains, err := conn.ListChainsOfTableFamily(fam)
	if err != nil {
		return fmt.Errorf("list %s chains: %w", familyName(fam), err)
	}
	var errs []error
	for _, table := range tables {
		ours := map[string]*nftables.Chain{}
		var bases []*nftables.Chain
		for _, c := range chains {
			if c.Table == nil || c.Table.Name != table {
				continue
			}
			switch {
			case c.Name == ChainPrerouting || c.Name == ChainOutput:
				ours[c.Name] = c
			case c.Hooknum != nil && entries[c.Name] != "":
				bases = append(bases, c)
			}
		}
		if len(ours) == 0 {
			continue
		}
		where := familyName(fam) + " " + table
		// The entry rules first, in one batch: once they are gone nothing
		// reaches the chains.
		var jumps []string
		for _, base := range bases {
			target := entries[base.Name]
			if ours[target] == nil {
				continue
			}
			rules, err := conn.GetRules(base.Table, base)
			if err != nil {
				errs = append(errs, fmt.Errorf("list %s %s: %w", where, base.Name, err))
				continue
			}
			for _, r := range rules {
				if !bareJump(r, target) {
					continue
				}
				if err := conn.DelRule(r); err != nil {
					errs = append(errs, fmt.Errorf("remove %s %s -> %s: %w", where, base.Name, target, err))
					continue
				}
				jumps = append(jumps, where+" "+base.Name+" -> "+target)
			}
		}
		if err := conn.Flush(); err != nil {
			errs = append(errs, fmt.Errorf("remove %s entry rules: %w", where, err))
			continue
		}
		res.Jumps = append(res.Jumps, jumps...)
		// Then each chain, flushed and deleted in one batch; one still
		// jumped to by a rule that is not istio-cni's cannot be deleted, and
		// is flushed alone.
		for _, name := range []string{ChainPrerouting, ChainOutput} {
			c := ours[name]
			if c == nil {
				continue
			}
			conn.FlushChain(c)
			conn.DelChain(c)
			if err := conn.Flush(); err == nil {
				res.Chains = append(res.Chains, where+" "+name)
				continue
			}
			conn.FlushChain(c)
			if err := conn.Flush(); err != nil {
				errs = append(errs, fmt.Errorf("flush %s %s: %w", where, name, err))
				continue
			}
			res.Kept = append(res.Kept, where+" "+name)
			errs = append(errs, fmt.Errorf("%s %s emptied but kept: a rule that is not istio-cni's jumps to it", where, name))
		}
	}
	return errors.Join(errs...)
}

// bareJump reports whether r is a jump to target and nothing else but
// counters, as istio-cni's entry rules are.
func bareJump(r *nftables.Rule, target string) bool {
	jump := false
	for _, e := range r.Exprs {
		switch e := e.(type) {
		case *expr.Counter:
		case *expr.Verdict:
			if e.Kind != expr.VerdictJump || e.Chain != target || jump {
				return false
			}
			jump = true
		default:
			return false
		}
	}
	return jump
}

// legacyTables lists the iptables-legacy tables of ns (the kernel's
// ip_tables_names and ip6_tables_names of the namespace).
func legacyTables(ns *os.File) ([]string, error) {
	var out []string
	err := netns.DoFd(int(ns.Fd()), func() error {
		for _, f := range []struct{ file, fam string }{{"ip_tables_names", "ip"}, {"ip6_tables_names", "ip6"}} {
			b, err := os.ReadFile("/proc/thread-self/net/" + f.file)
			if errors.Is(err, os.ErrNotExist) {
				continue // the module is not loaded: no legacy table anywhere
			}
			if err != nil {
				return fmt.Errorf("read %s: %w", f.file, err)
			}
			for name := range strings.FieldsSeq(string(b)) {
				out = append(out, f.fam+" "+name)
			}
		}
		return nil
	})
	slices.Sort(out)
	return out, err
}
