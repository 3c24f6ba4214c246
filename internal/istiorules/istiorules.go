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
// One chain may have to outlive the others: mangle ISTIO_OUTPUT restores the
// connmark 0x111 that mangle ISTIO_PRERT gave the connections ztunnel
// delivered into the pod, so the application's replies to them are routed
// back to ztunnel (the policy route). A connection delivered before the
// switch has no other way back: mesh-cni marks an application's socket when
// it accepts one. So that chain stays while the pod's conntrack table holds
// such a connection not yet closing, and Remove says to come back; with
// ISTIO_PRERT gone no new connection gets the connmark, so what stays
// touches only the connections from before.
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
	"github.com/vishvananda/netlink"
	vnetns "github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

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
	// Deferred are the chains left for a later Remove: mangle ISTIO_OUTPUT
	// while connections made before the switch need it.
	Deferred []string
}

// Found reports whether anything of istio-cni's was there.
func (r Result) Found() bool {
	return len(r.Jumps)+len(r.Chains)+len(r.Kept)+len(r.Deferred) > 0
}

// Pending reports whether Remove is to be called again later.
func (r Result) Pending() bool { return len(r.Deferred) > 0 }

// restoreChain is the chain that stays while connections need it.
func restoreChain(table, chain string) bool { return table == "mangle" && chain == ChainOutput }

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
		// Everything but the restore chain first: ISTIO_PRERT's going stops
		// new connections from getting the connmark before they are counted.
		if err := removeFamily(conn, fam, &res, func(table, chain string) bool { return !restoreChain(table, chain) }); err != nil {
			errs = append(errs, err)
		}
	}
	for _, fam := range []nftables.TableFamily{nftables.TableFamilyIPv4, nftables.TableFamilyIPv6} {
		if !hasChain(conn, fam, "mangle", ChainOutput) {
			continue
		}
		n, err := markedConnections(ns, fam)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if n > 0 {
			res.Deferred = append(res.Deferred, fmt.Sprintf("%s mangle %s (%d connections from before need it)", familyName(fam), ChainOutput, n))
			continue
		}
		if err := removeFamily(conn, fam, &res, restoreChain); err != nil {
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

// removeFamily removes istio-cni's chains of the family for which only(table,
// chain) holds, with their entry rules.
func removeFamily(conn *nftables.Conn, fam nftables.TableFamily, res *Result, only func(table, chain string) bool) error {
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
				if only(table, c.Name) {
					ours[c.Name] = c
				}
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

func hasChain(conn *nftables.Conn, fam nftables.TableFamily, table, chain string) bool {
	chains, err := conn.ListChainsOfTableFamily(fam)
	if err != nil {
		return true // then the count says
	}
	return slices.ContainsFunc(chains, func(c *nftables.Chain) bool { return c.Table != nil && c.Table.Name == table && c.Name == chain })
}

// markedConnections counts the TCP connections of the family in ns's
// conntrack table that carry istio-cni's connmark (0x111 under 0xfff) and
// are not closing: their replies still need the restore chain.
func markedConnections(ns *os.File, fam nftables.TableFamily) (int, error) {
	h, err := netlink.NewHandleAt(vnetns.NsHandle(int(ns.Fd())))
	if err != nil {
		return 0, fmt.Errorf("netlink in the pod's namespace: %w", err)
	}
	defer h.Close()
	family := netlink.InetFamily(unix.AF_INET)
	if fam == nftables.TableFamilyIPv6 {
		family = unix.AF_INET6
	}
	flows, err := h.ConntrackTableList(netlink.ConntrackTable, family)
	if err != nil {
		return 0, fmt.Errorf("%s conntrack of the pod's namespace: %w", familyName(fam), err)
	}
	n := 0
	for _, f := range flows {
		tcp, ok := f.ProtoInfo.(*netlink.ProtoInfoTCP)
		if f.Mark&connmarkMask == connmark && ok && tcp.State > tcpNone && tcp.State < tcpTimeWait {
			n++
		}
	}
	return n, nil
}

// istio-cni's connmark, and the TCP states of nf_conntrack (enum
// tcp_conntrack) past which a connection is closed.
const (
	connmark     = 0x111
	connmarkMask = 0xfff
	tcpNone      = 0
	tcpTimeWait  = 7
)

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
