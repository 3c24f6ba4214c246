// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//
// The sock_addr hooks: connect, sendmsg and recvmsg (outbound capture and DNS).

#include "lib/common.h"
#include "lib/maps.h"
#include "lib/addr.h"

// in_cgroups reports whether the task making the call runs in one of these
// cgroups or below one. A pod cannot move itself into another cgroup, so unlike a
// socket mark (settable with CAP_NET_RAW, which runtimes grant by default) this
// cannot be forged from inside a pod.
static __always_inline bool in_cgroups(const struct proxy_cgroup *cgs, __u32 nr)
{
	for (__u32 i = 0; i < MAX_PROXY_CGROUPS; i++) {
		if (i >= nr)
			break;
		const struct proxy_cgroup *c = &cgs[i];
		if (c->id && bpf_get_current_ancestor_cgroup_id(c->level) == c->id)
			return true;
	}
	return false;
}

// is_proxy_task reports whether the task making the call runs in one of the node's
// proxy cgroups.
static __always_inline bool is_proxy_task(void)
{
	__u32 zero = 0;
	struct node_config *n = bpf_map_lookup_elem(&node, &zero);
	return n && in_cgroups(n->proxy_cgroups, n->nr_proxy_cgroups);
}

// mark_probe_socket remembers a TCP socket of the node's own namespace connected
// by the kubelet (probe_node): sockops records its connection so the pod's inbound
// capture lets it through. Everything else on the node leaves after one lookup.
static __always_inline void mark_probe_socket(struct bpf_sock *sk, __u64 netns)
{
	__u32 zero = 0;
	struct probe_config *p = bpf_map_lookup_elem(&probe_node, &zero);
	if (!p || !p->nr_cgroups || p->host_netns != netns)
		return;
	if (!in_cgroups(p->cgroups, p->nr_cgroups)) {
		bpf_sk_storage_delete(&probe_socks, sk);
		return;
	}
	__u8 *v = bpf_sk_storage_get(&probe_socks, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (v)
		*v = 1;
}

// proxy_addr is where a redirected connect or datagram of sk goes, IPv4-mapped
// for IPv4: loopback, as after iptables REDIRECT; for a socket bound to a device
// (SO_BINDTODEVICE), which reaches loopback through no device but lo, the pod's own
// address of that family, a local destination the kernel delivers whatever the
// bound device (the proxy must then listen on the wildcard, as ztunnel does).
static __always_inline void proxy_addr(const struct bpf_sock *sk, const struct pod_net_info *n, bool v4, __u32 *a)
{
	if (v4) {
		map_v4(a, sk->bound_dev_if && n && n->src4 ? n->src4 : bpf_htonl(0x7f000001));
		return;
	}
	if (sk->bound_dev_if && n && addr_set(n->src6)) {
		copy_addr(a, n->src6);
		return;
	}
	a[0] = 0;
	a[1] = 0;
	a[2] = 0;
	a[3] = bpf_htonl(1);
}

// proxy_listening reports whether the proxy listens on port of the address a (see
// proxy_addr) a connect or datagram is about to be rewritten to, in the socket's
// netns: a TCP listener, or a bound UDP socket.
static __always_inline bool proxy_listening(struct bpf_sock_addr *ctx, const __u32 *a, bool v4, __u16 port, bool udp)
{
	struct bpf_sock_tuple t = {};
	struct bpf_sock *sk;
	__u32 size;

	if (v4) {
		t.ipv4.daddr = a[3];
		t.ipv4.dport = bpf_htons(port);
		size = sizeof(t.ipv4);
	} else {
		copy_addr(t.ipv6.daddr, a);
		t.ipv6.dport = bpf_htons(port);
		size = sizeof(t.ipv6);
	}
	if (udp) {
		sk = bpf_sk_lookup_udp(ctx, &t, size, BPF_F_CURRENT_NETNS, 0);
		if (!sk)
			return false;
		bpf_sk_release(sk);
		return true;
	}
	sk = bpf_skc_lookup_tcp(ctx, &t, size, BPF_F_CURRENT_NETNS, 0);
	if (!sk)
		return false;
	bool listening = sk->state == BPF_TCP_LISTEN;
	bpf_sk_release(sk);
	return listening;
}

// rewrite_dst points the connect or datagram at port of a (IPv4-mapped for IPv4),
// in the form the socket's family needs.
static __always_inline void rewrite_dst(struct bpf_sock_addr *ctx, bool v6, const __u32 *a, __u16 port)
{
	ctx->user_port = bpf_htons(port);
	if (!v6) {
		ctx->user_ip4 = a[3];
		return;
	}
	copy_addr(ctx->user_ip6, a);
}

// bind_pod_source binds a connect that is being redirected and has no local
// address yet to the pod's own address of the destination's family, which is the
// source the kernel would have picked for the original destination: the proxy sees
// the pod's address as the peer (as after iptables REDIRECT, where only the
// destination changes) instead of loopback. Only the address is bound; the port is
// chosen at connect. A failure leaves the connect as it was.
static __always_inline void bind_pod_source(struct bpf_sock_addr *ctx, const struct bpf_sock *sk,
					    const struct pod_net_info *n, bool v6, bool v4dst)
{
	if (!n || sk->bound_dev_if || sk->src_port)
		return;
	if (!v6) {
		if (sk->src_ip4 || !n->src4)
			return;
		struct mesh_sockaddr_in sin = {.family = AF_INET, .addr = n->src4};
		bpf_bind(ctx, (struct sockaddr *)&sin, sizeof(sin));
		return;
	}
	if (addr_set(sk->src_ip6))
		return;
	struct mesh_sockaddr_in6 sin6 = {.family = AF_INET6};
	if (v4dst) {
		if (!n->src4)
			return;
		map_v4(sin6.addr, n->src4);
	} else {
		if (!addr_set(n->src6))
			return;
		copy_addr(sin6.addr, n->src6);
	}
	bpf_bind(ctx, (struct sockaddr *)&sin6, sizeof(sin6));
}

// user_dst reads the connect's or datagram's destination, IPv4-mapped for IPv4.
static __always_inline void user_dst(struct bpf_sock_addr *ctx, bool v6, struct orig_dst *d)
{
	if (v6) {
		copy_addr(d->addr, ctx->user_ip6);
		d->family = addr_family(d->addr);
	} else {
		map_v4(d->addr, ctx->user_ip4);
		d->family = AF_INET;
	}
	d->port = (__u16)ctx->user_port;
}

// is_proxy_socket: the proxy's own connects are never redirected. c is the pod's
// pod_capture entry (NULL: none): a sidecar's own cgroup.
static __always_inline bool is_proxy_socket(struct bpf_sock *sk, const struct pod_settings *s,
					    const struct pod_capture_info *c)
{
	if ((s->flags & SETTING_PROXY_MARK) && (sk->mark & s->proxy_mark_mask) == s->proxy_mark)
		return true;
	if ((s->flags & SETTING_PROXY_UID) && (__u32)bpf_get_current_uid_gid() == s->proxy_uid)
		return true;
	if (c && (c->flags & CAPTURE_PROXY_CGROUP) && in_cgroups(&c->proxy, 1))
		return true;
	return is_proxy_task();
}

// Istio's inbound tunnel port and the source its sidecar binds to reach the
// application (inbound passthrough): neither is sent back to the inbound port.
#define ISTIO_TUNNEL_PORT 15008
#define PASSTHROUGH_SRC4 0x7f000006 // 127.0.0.6

// local_to_inbound reports whether a connect of the proxy goes to its own inbound
// port (CAPTURE_LOCAL_TO_INBOUND): to a local address, the pod's own or a loopback
// one other than 127.0.0.1 and ::1, from a socket not bound to 127.0.0.6 or ::6,
// to any port but the tunnel's (and DNS's when DNS is captured).
static __always_inline bool local_to_inbound(const struct bpf_sock *sk, const struct pod_settings *s,
					     const struct pod_capture_info *c, const struct pod_net_info *n,
					     const struct orig_dst *d)
{
	if (!c || !(c->flags & CAPTURE_LOCAL_TO_INBOUND))
		return false;
	__u16 port = bpf_ntohs(d->port);
	if (port == ISTIO_TUNNEL_PORT || ((s->flags & SETTING_DNS_CAPTURE) && port == DNS_PORT))
		return false;
	if (sk->src_ip4 == bpf_htonl(PASSTHROUGH_SRC4))
		return false;
	__u32 src6[4];
	copy_addr(src6, sk->src_ip6);
	if (!src6[0] && !src6[1] && !src6[2] && src6[3] == bpf_htonl(6))
		return false;
	if (is_pod_addr(n, d->addr))
		return true;
	if (!is_loopback_or_any(d->addr))
		return false;
	if (is_v4_mapped(d->addr)) {
		__u32 ip = bpf_ntohl(d->addr[3]);
		return ip != 0x7f000001 && ip != 0;
	}
	return false; // ::1 and ::
}

// excluded_port: outbound connects to this port are never redirected.
static __always_inline bool excluded_port(const struct pod_settings *s, const struct orig_dst *d)
{
	return (s->flags & SETTING_OUTBOUND_PORTS) && port_in(s->outbound_port_set, bpf_ntohs(d->port));
}

// outbound_included: with an include list (CAPTURE_INCLUDED_CIDRS), a destination
// outside it is not redirected unless its port is one of the included ports.
static __always_inline bool outbound_included(const struct pod_capture_info *c, const struct orig_dst *d)
{
	if (!c || !(c->flags & CAPTURE_INCLUDED_CIDRS))
		return true;
	if ((c->flags & CAPTURE_INCLUDED_OUTBOUND_PORTS) && port_in(c->outbound_include_set, bpf_ntohs(d->port)))
		return true;
	return in_cidrs(&excluded_dsts, c->included_set, d->addr);
}

// uncaptured decides a socket whose proxy listener is (not) there: with the
// listener it is redirected; without it, a pod that fails open lets it go to its
// destination (true, its original destination forgotten), and one that fails
// closed still has it rewritten, so its connect gets ECONNREFUSED from the closed
// proxy port just like an iptables REDIRECT would. Counts which, with the
// counters given.
static __always_inline bool uncaptured(struct bpf_sock *sk, bool listening, bool fail_open, __u32 passed,
				       __u32 dropped, __u32 redirected)
{
	if (listening) {
		count(redirected);
		return false;
	}
	if (fail_open) {
		bpf_sk_storage_delete(&sock_orig, sk);
		count(passed);
		return true;
	}
	count(dropped);
	return false;
}

// dns_redirect sends a DNS query (UDP datagram or connect, or TCP connect, to port
// 53) to the proxy's DNS listener on loopback. With nothing listening there it is
// left alone (a pod must not lose name resolution while its proxy restarts) unless
// the pod is DNS fail-closed. The original destination is kept in the socket's
// storage: recvmsg shows answers as coming from it, as resolver libraries require.
static __always_inline int dns_redirect(struct bpf_sock_addr *ctx, const struct pod_settings *s,
					const struct pod_net_info *n, struct bpf_sock *sk, struct orig_dst *d, bool v6,
					bool udp, bool connect)
{
	bool v4 = d->family == AF_INET;
	__u32 a[4];
	proxy_addr(sk, n, v4, a);
	if (uncaptured(sk, proxy_listening(ctx, a, v4, s->dns_port, udp), !(s->flags & SETTING_DNS_FAIL_CLOSED),
		       COUNTER_DNS_PASSED, COUNTER_DNS_DROPPED, COUNTER_DNS_REDIRECTED))
		return 1;
	struct orig_dst *st = bpf_sk_storage_get(&sock_orig, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!st)
		return 0;
	*st = *d;
	if (connect && !udp)
		bind_pod_source(ctx, sk, n, v6, v4);
	rewrite_dst(ctx, v6, a, s->dns_port);
	return 1;
}

// capture_to sends a TCP connect to the proxy's port on loopback (proxy_addr),
// its original destination kept in the socket's storage for SO_ORIGINAL_DST and
// getpeername, its source bound to the pod's address when bind (as REDIRECT
// keeps it). With nothing listening there it fails closed, or passes when the
// pod fails open.
static __always_inline int capture_to(struct bpf_sock_addr *ctx, const struct pod_settings *s,
				      const struct pod_net_info *n, struct bpf_sock *sk, const struct orig_dst *d,
				      bool v6, bool connect, __u16 port, bool bind)
{
	bool v4 = d->family == AF_INET;
	__u32 a[4];
	proxy_addr(sk, n, v4, a);
	if (uncaptured(sk, proxy_listening(ctx, a, v4, port, false), s->flags & SETTING_FAIL_OPEN,
		       COUNTER_OUT_PASSED, COUNTER_OUT_DROPPED, COUNTER_OUT_REDIRECTED))
		return 1;
	struct orig_dst *st = bpf_sk_storage_get(&sock_orig, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!st) {
		// Without the original destination the proxy cannot forward: refuse the
		// connect (EPERM) rather than let it bypass the proxy.
		return 0;
	}
	*st = *d;
	if (connect && bind)
		bind_pod_source(ctx, sk, n, v6, v4);
	rewrite_dst(ctx, v6, a, port);
	return 1;
}

static __always_inline bool is_dns(const struct pod_settings *s, const struct orig_dst *d)
{
	return (s->flags & SETTING_DNS_CAPTURE) && d->port == bpf_htons(DNS_PORT) && !is_loopback_or_any(d->addr);
}

// redirect_common decides a TCP connect, a UDP connect or a UDP datagram (sendmsg,
// which the kernel runs for UDP only) from an enrolled netns. A TCP connect from
// any other netns is only looked at for the kubelet's (mark_probe_socket). connect
// is a constant: bpf_bind exists only for the connect hooks, so the sendmsg
// programs must not contain the call.
static __always_inline int redirect_common(struct bpf_sock_addr *ctx, bool v6, bool connect)
{
	__u32 proto = ctx->protocol;
	if (proto != IPPROTO_TCP && proto != IPPROTO_UDP)
		return 1;
	struct bpf_sock *sk = ctx->sk;
	if (!sk)
		return 1;
	__u64 netns = bpf_get_netns_cookie(ctx);
	struct pod_settings *s = bpf_map_lookup_elem(&pods, &netns);
	if (!s) {
		if (proto == IPPROTO_TCP)
			mark_probe_socket(sk, netns);
		return 1;
	}
	struct orig_dst d = {};
	user_dst(ctx, v6, &d);
	bool udp = proto == IPPROTO_UDP;
	bool dns = is_dns(s, &d);
	// Only DNS is captured among datagrams: every other one leaves before the
	// proxy-identity checks, which would otherwise run for each UDP send.
	if (udp && !dns)
		return 1;

	const struct pod_capture_info *c = NULL;
	if (s->flags & SETTING_CAPTURE)
		c = bpf_map_lookup_elem(&pod_capture, &netns);
	if (is_proxy_socket(sk, s, c)) {
		if (c && !udp && !excluded_port(s, &d)) {
			const struct pod_net_info *n = bpf_map_lookup_elem(&pod_net, &netns);
			if (local_to_inbound(sk, s, c, n, &d)) {
				// The proxy's own inbound port: not a proxy socket for sockops.
				bpf_sk_storage_delete(&proxy_socks, sk);
				return capture_to(ctx, s, n, sk, &d, v6, connect, s->inbound_port, is_pod_addr(n, d.addr));
			}
		}
		// A socket may connect again after a failed attempt: forget an
		// earlier redirection so getpeername does not report a stale peer.
		bpf_sk_storage_delete(&sock_orig, sk);
		if (!udp) {
			__u8 *p = bpf_sk_storage_get(&proxy_socks, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
			if (p)
				*p = 1;
			count(COUNTER_OUT_PASSED);
		}
		return 1;
	}
	const struct pod_net_info *n = bpf_map_lookup_elem(&pod_net, &netns);
	if (dns)
		return dns_redirect(ctx, s, n, sk, &d, v6, udp, connect);
	// Loopback, unspecified and the pod's own addresses stay inside the pod, like
	// the `! -d 127.0.0.1/32` and `-o lo` exclusions of iptables-based meshes.
	if (is_loopback_or_any(d.addr) || is_pod_addr(n, d.addr) || excluded_port(s, &d) ||
	    ((s->flags & SETTING_EXCLUDED_CIDRS) && in_cidrs(&excluded_dsts, s->excluded_set, d.addr)) ||
	    !outbound_included(c, &d)) {
		bpf_sk_storage_delete(&sock_orig, sk);
		count(COUNTER_OUT_PASSED);
		return 1;
	}

	return capture_to(ctx, s, n, sk, &d, v6, connect, s->outbound_port, true);
}

SOCK_ADDR_PROGS(connect, redirect_common, true)

// sendmsg4/6 run for datagrams sent with an address (sendto, sendmsg with a name):
// DNS queries of unconnected UDP sockets.
SOCK_ADDR_PROGS(sendmsg, redirect_common, false)

// recvmsg4/6 show a DNS answer from the proxy's listener as coming from the
// resolver the query was sent to.
static __always_inline int recvmsg_common(struct bpf_sock_addr *ctx, bool v6)
{
	struct bpf_sock *sk = ctx->sk;
	if (!sk)
		return 1;
	struct orig_dst *o = bpf_sk_storage_get(&sock_orig, sk, 0, 0);
	if (!o)
		return 1;
	__u64 netns = bpf_get_netns_cookie(ctx);
	struct pod_settings *s = bpf_map_lookup_elem(&pods, &netns);
	if (!s || ctx->user_port != bpf_htons(s->dns_port))
		return 1;
	struct orig_dst from = {};
	user_dst(ctx, v6, &from);
	if (is_loopback_or_any(from.addr))
		show_orig(ctx, v6, o);
	return 1;
}

SOCK_ADDR_PROGS(recvmsg, recvmsg_common)
