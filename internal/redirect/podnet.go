package redirect

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"

	"github.com/containernetworking/plugins/pkg/netlinksafe"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/mesh-cni/mesh-cni/internal/podif"
)

// maxPodAddrs is MAX_POD_ADDRS of bpf/lib/common.h.
const maxPodAddrs = len(redirectPodNetInfo{}.Addrs)

// podAddrs are a pod's own addresses, read from its namespace when it is
// enrolled (before its containers run, at a CNI ADD), and what the data path
// derives from them.
type podAddrs struct {
	// all are the addresses of every interface but lo, global ones first; at
	// most maxPodAddrs.
	all []netip.Addr
	// src4, src6 are the sources of the pod's redirected connects (invalid:
	// none of that family).
	src4, src6 netip.Addr
	// scope is the interface index of link-local original destinations.
	scope uint32
}

// toBPF is the pod's pod_net entry: its addresses, and the reply mark and
// kubelet ports of s (normalized, valid).
func (a podAddrs) toBPF(s Settings) redirectPodNetInfo {
	v := redirectPodNetInfo{ReplyMark: s.ReplyMark, ReplyMarkMask: s.ReplyMarkMask}
	v.NrKubeletPorts = uint32(copy(v.KubeletPorts[:], s.KubeletPorts))
	for i, addr := range a.all {
		v.Addrs[i] = addrWords(addr.As16())
	}
	v.NrAddrs = uint32(len(a.all))
	if a.src4.IsValid() {
		v.Src4 = addrWords(a.src4.As16())[3]
	}
	if a.src6.IsValid() {
		v.Src6 = addrWords(a.src6.As16())
	}
	v.ScopeId = a.scope
	return v
}

// podAddrsFromBPF is the inverse of toBPF's addresses.
func podAddrsFromBPF(v redirectPodNetInfo) []netip.Addr {
	var out []netip.Addr
	for _, w := range v.Addrs[:min(int(v.NrAddrs), maxPodAddrs)] {
		out = append(out, netip.AddrFrom16(wordsAddr(w)).Unmap())
	}
	return out
}

// readPodAddrs reads the addresses of the calling thread's network namespace.
// Sources are the first global address of each family, in interface order; the
// link-local scope is the interface holding the IPv6 source, else the first with
// a link-local address.
func readPodAddrs() (podAddrs, error) {
	var a podAddrs
	ifs, err := podif.List()
	if err != nil {
		return a, fmt.Errorf("the pod's interfaces: %w", err)
	}
	var global, local []netip.Addr
	var linkLocalIf uint32
	for _, l := range ifs {
		for _, p := range l.Addrs {
			ip := p.Addr()
			switch {
			case ip.IsLinkLocalUnicast():
				local = append(local, ip)
				if ip.Is6() && linkLocalIf == 0 {
					linkLocalIf = uint32(l.Index)
				}
			default:
				global = append(global, ip)
				if ip.Is4() && !a.src4.IsValid() {
					a.src4 = ip
				}
				if ip.Is6() && !a.src6.IsValid() {
					a.src6 = ip
					a.scope = uint32(l.Index)
				}
			}
		}
	}
	if a.scope == 0 {
		a.scope = linkLocalIf
	}
	a.all = append(global, local...)
	if len(a.all) > maxPodAddrs {
		a.all = a.all[:maxPodAddrs]
	}
	return a, nil
}

// The pod's reply route: replies of the application to connections its proxy made
// with another address as source (the client's, IP_TRANSPARENT) carry the reply
// mark (sockops gives it to the proxy's socket; tcp_fwmark_accept to the accepted
// one) and are delivered locally, back to the proxy, instead of being routed out.
const fwmarkAcceptSysctl = "sys/net/ipv4/tcp_fwmark_accept"

// procfs is the procfs whose sys/net the agent writes a pod's net sysctls through
// (net sysctls are those of the namespace of the thread that opens them). It is
// /proc unless /proc/sys is read-only, as container runtimes mount it in every
// container that is not privileged: then a procfs instance of the agent's own,
// mounted detached (fsopen, fsmount: CAP_SYS_ADMIN), never attached anywhere.
type procfs struct {
	once sync.Once
	fd   int
	err  error
}

func (p *procfs) root() (int, error) {
	p.once.Do(func() {
		var st unix.Statfs_t
		if err := unix.Statfs("/proc/sys", &st); err == nil && st.Flags&unix.ST_RDONLY == 0 {
			p.fd, p.err = unix.Open("/proc", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
			return
		}
		p.fd, p.err = detachedProcfs()
	})
	return p.fd, p.err
}

func (p *procfs) close() {
	p.once.Do(func() { p.err = ErrClosed })
	if p.err == nil {
		unix.Close(p.fd)
		p.err = ErrClosed
	}
}

func detachedProcfs() (int, error) {
	fs, err := unix.Fsopen("proc", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("/proc/sys is read-only, and a procfs of the agent's own cannot be made: fsopen: %w", err)
	}
	defer unix.Close(fs)
	if err := unix.FsconfigCreate(fs); err != nil {
		return -1, fmt.Errorf("/proc/sys is read-only, and a procfs of the agent's own cannot be made: fsconfig: %w", err)
	}
	m, err := unix.Fsmount(fs, unix.FSMOUNT_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("/proc/sys is read-only, and a procfs of the agent's own cannot be made: fsmount: %w", err)
	}
	return m, nil
}

// writeSysctl writes a net sysctl of the calling thread's namespace.
func (p *procfs) writeSysctl(name, value string) error {
	root, err := p.root()
	if err != nil {
		return err
	}
	fd, err := unix.Openat(root, name, unix.O_WRONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %s: %w", name, err)
	}
	defer unix.Close(fd)
	if _, err := unix.Write(fd, []byte(value)); err != nil {
		return fmt.Errorf("write %s: %w", name, err)
	}
	return nil
}

func replyRules(s Settings) []*netlink.Rule {
	var out []*netlink.Rule
	for _, fam := range []int{unix.AF_INET, unix.AF_INET6} {
		r := netlink.NewRule()
		r.Family = fam
		r.Mark = s.ReplyMark
		mask := s.ReplyMarkMask
		r.Mask = &mask
		r.Table = ReplyTable
		r.Priority = ReplyRulePriority
		out = append(out, r)
	}
	return out
}

func replyRoutes(lo int) []*netlink.Route {
	return []*netlink.Route{
		{LinkIndex: lo, Table: ReplyTable, Type: unix.RTN_LOCAL, Scope: netlink.SCOPE_HOST, Family: unix.AF_INET,
			Dst: &net.IPNet{IP: net.IPv4zero.To4(), Mask: net.CIDRMask(0, 32)}},
		{LinkIndex: lo, Table: ReplyTable, Type: unix.RTN_LOCAL, Scope: netlink.SCOPE_HOST, Family: unix.AF_INET6,
			Dst: &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}},
	}
}

// ipv6Enabled reports whether the calling thread's namespace has IPv6 on lo.
func ipv6Enabled() bool {
	b, err := os.ReadFile("/proc/sys/net/ipv6/conf/lo/disable_ipv6")
	return err == nil && strings.TrimSpace(string(b)) == "0"
}

// setupReplyRoute puts the reply route in place in the calling thread's
// namespace: tcp_fwmark_accept, the fwmark rules and the local routes of the
// reply table, for IPv4 and (where the namespace has it) IPv6. Idempotent.
func setupReplyRoute(proc *procfs, s Settings) error {
	if err := proc.writeSysctl(fwmarkAcceptSysctl, "1"); err != nil {
		return fmt.Errorf("set tcp_fwmark_accept: %w", err)
	}
	lo, err := netlinksafe.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("reply route: %w", err)
	}
	v6 := ipv6Enabled()
	for _, r := range replyRules(s) {
		if r.Family == unix.AF_INET6 && !v6 {
			continue
		}
		if err := netlink.RuleAdd(r); err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("add reply rule (family %d): %w", r.Family, err)
		}
	}
	for _, rt := range replyRoutes(lo.Attrs().Index) {
		if rt.Family == unix.AF_INET6 && !v6 {
			continue
		}
		if err := netlink.RouteReplace(rt); err != nil {
			return fmt.Errorf("add reply route (family %d): %w", rt.Family, err)
		}
	}
	return nil
}

// removeReplyRoute takes the reply route out of the calling thread's namespace.
// What is not there is fine.
func removeReplyRoute(proc *procfs, s Settings) error {
	var errs []error
	for _, r := range replyRules(s) {
		if err := netlink.RuleDel(r); err != nil && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.EAFNOSUPPORT) {
			errs = append(errs, fmt.Errorf("remove reply rule (family %d): %w", r.Family, err))
		}
	}
	if lo, err := netlinksafe.LinkByName("lo"); err == nil {
		for _, rt := range replyRoutes(lo.Attrs().Index) {
			if err := netlink.RouteDel(rt); err != nil && !errors.Is(err, unix.ESRCH) && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.EAFNOSUPPORT) {
				errs = append(errs, fmt.Errorf("remove reply route (family %d): %w", rt.Family, err))
			}
		}
	}
	if err := proc.writeSysctl(fwmarkAcceptSysctl, "0"); err != nil {
		errs = append(errs, fmt.Errorf("reset tcp_fwmark_accept: %w", err))
	}
	return errors.Join(errs...)
}
