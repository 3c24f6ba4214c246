// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//
// sockops, and what answers for a redirected connection afterwards: getsockopt
// (SO_ORIGINAL_DST) and getpeername.

#include "lib/common.h"
#include "lib/maps.h"
#include "lib/addr.h"

// sock_addrs fills the local and remote address of a socket of family from the
// fields of that family (l4, r4 or l6, r6: a context's or a bpf_sock's),
// IPv4-mapped for IPv4 (and as a dual-stack socket sees an IPv4 peer). Returns
// false for other families.
static __always_inline bool sock_addrs(__u32 family, const __u32 *l4, const __u32 *r4, const __u32 *l6,
				       const __u32 *r6, __u32 *local, __u32 *remote)
{
	if (family == AF_INET) {
		map_v4(local, *l4);
		map_v4(remote, *r4);
		return true;
	}
	if (family == AF_INET6) {
		copy_addr(local, l6);
		copy_addr(remote, r6);
		return true;
	}
	return false;
}

// ops_addrs fills the local and remote address of a sockops socket (sock_addrs).
static __always_inline bool ops_addrs(struct bpf_sock_ops *ctx, __u32 *local, __u32 *remote)
{
	return sock_addrs(ctx->family, &ctx->local_ip4, &ctx->remote_ip4, ctx->local_ip6, ctx->remote_ip6, local,
			  remote);
}

// peer_key is the key of a connection as its server side sees it, built from the
// client socket's sockops context.
static __always_inline bool peer_key(struct bpf_sock_ops *ctx, struct tuple_key *k)
{
	k->netns = bpf_get_netns_cookie(ctx);
	if (!ops_addrs(ctx, k->remote, k->local))
		return false;
	// bpf_sock_ops.remote_port holds the network-order port in its upper 16 bits on
	// little-endian (a long-standing kernel quirk); local_port is in host order.
	k->local_port = (__u16)(ctx->remote_port >> 16);
	k->remote_port = bpf_htons((__u16)ctx->local_port);
	return true;
}

// own_key is the key of a connection as this (server-side) socket sees it.
static __always_inline bool own_key(struct bpf_sock_ops *ctx, struct tuple_key *k)
{
	k->netns = bpf_get_netns_cookie(ctx);
	if (!ops_addrs(ctx, k->local, k->remote))
		return false;
	k->local_port = bpf_htons((__u16)ctx->local_port);
	k->remote_port = (__u16)(ctx->remote_port >> 16);
	return true;
}

// slot_listener puts the socket into the first free slot of k's port and family.
static __always_inline long slot_listener(struct bpf_sock_ops *ctx, struct listener_key *k)
{
	long err = 0;
	for (__u32 slot = 0; slot < LISTENER_SLOTS; slot++) {
		k->slot = slot;
		err = bpf_sock_hash_update(ctx, &listeners, k, BPF_NOEXIST);
		if (err != -EEXIST)
			break;
	}
	return err;
}

static __always_inline void refuse_listener(struct listener_key *k, long err)
{
	k->slot = 0;
	struct listener_refusal r = {.err = (__s32)err, .count = 1};
	struct listener_refusal *old = bpf_map_lookup_elem(&listen_refused, k);
	if (old)
		r.count = old->count + 1;
	bpf_map_update_elem(&listen_refused, k, &r, BPF_ANY);
	count(COUNTER_LISTENER_REFUSED);
}

// collect_listener puts a new listener of an enrolled pod's inbound port into a
// free slot of its family. Listeners of other namespaces are not collected, so no
// namespace can fill the map: a pod holds at most LISTENER_SLOTS per family (the
// agent collects those open before its pod was enrolled). An IPv6 listener also
// goes into the IPv4 slots: it may be dual-stack (its IPV6_V6ONLY is not readable
// here), and bpf_sk_assign refuses it for IPv4 if not, so the lookup of an IPv4
// connection needs to search one family only.
static __always_inline void collect_listener(struct bpf_sock_ops *ctx)
{
	__u16 port = (__u16)ctx->local_port;
	__u64 netns = bpf_get_netns_cookie(ctx);
	struct pod_settings *s = bpf_map_lookup_elem(&pods, &netns);
	if (!s || s->inbound_port != port)
		return;
	struct listener_key k = {
		.netns = netns,
		.port = port,
		.family = (__u8)ctx->family,
	};
	long err = slot_listener(ctx, &k);
	if (err) {
		refuse_listener(&k, err);
		return;
	}
	if (ctx->family == AF_INET6) {
		k.family = AF_INET;
		slot_listener(ctx, &k);
	}
}

// accepted records SO_ORIGINAL_DST for a socket accepted in an enrolled netns.
static __always_inline void accepted(struct bpf_sock_ops *ctx)
{
	struct bpf_sock *sk = ctx->sk;
	if (!sk)
		return;
	struct tuple_key k = {};
	if (!own_key(ctx, &k))
		return;
	if (!bpf_map_lookup_elem(&pods, &k.netns))
		return;
	struct orig_dst d = {};
	struct orig_dst *handed = bpf_map_lookup_elem(&orig_dsts, &k);
	if (handed) {
		d = *handed;
	} else {
		if (is_loopback_or_any(k.local))
			return;
		__builtin_memcpy(d.addr, k.local, sizeof(d.addr));
		d.port = k.local_port;
		d.family = addr_family(k.local);
	}
	struct orig_dst *st = bpf_sk_storage_get(&accepted_orig, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!st)
		return; // getsockopt still finds a handed-over entry in orig_dsts
	*st = d;
	if (handed)
		bpf_map_delete_elem(&orig_dsts, &k);
}

// proxy_connect records a connection the proxy opens inside an enrolled pod (to
// the application, often from the client's address with IP_TRANSPARENT), so the
// pod's inbound capture leaves it alone, and when it goes to one of the pod's own
// addresses gives its socket the pod's reply mark before the SYN leaves. The pod
// accepts with tcp_fwmark_accept, so the SYN-ACK and the application's socket
// carry the mark too, and the pod's policy route (fwmark -> local table) delivers
// the application's replies to the proxy's socket on loopback instead of routing
// them out to the client address they are sent to.
static __always_inline void proxy_connect(struct bpf_sock_ops *ctx, struct bpf_sock *sk)
{
	struct tuple_key k = {};
	if (!peer_key(ctx, &k))
		return;
	__u8 one = 1;
	bpf_map_update_elem(&proxy_conns, &k, &one, BPF_ANY);
	bpf_sock_ops_cb_flags_set(ctx, ctx->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
	struct pod_settings *s = bpf_map_lookup_elem(&pods, &k.netns);
	if (!s || !(s->flags & SETTING_REPLY_MARK))
		return;
	struct pod_net_info *n = bpf_map_lookup_elem(&pod_net, &k.netns);
	if (!n || !is_pod_addr(n, k.local))
		return;
	int mark = (int)((sk->mark & ~n->reply_mark_mask) | (n->reply_mark & n->reply_mark_mask));
	bpf_setsockopt(ctx, SOL_SOCKET, SO_MARK, &mark, sizeof(mark));
}

// probe_connect records a kubelet connection (probe_socks) before its SYN leaves,
// under netns 0: the kubelet's side does not know the pod's namespace.
static __always_inline void probe_connect(struct bpf_sock_ops *ctx)
{
	struct tuple_key k = {};
	if (!peer_key(ctx, &k))
		return;
	k.netns = 0;
	__u8 one = 1;
	bpf_map_update_elem(&probe_conns, &k, &one, BPF_ANY);
	bpf_sock_ops_cb_flags_set(ctx, ctx->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
}

// forget removes what a client socket left in the node-wide maps: its hand-over
// of the original destination and the record of a proxy or kubelet connection.
// Runs when the socket's side is established (the records) or closes (all).
static __always_inline void forget(struct bpf_sock_ops *ctx, struct bpf_sock *sk, bool closing)
{
	struct tuple_key k = {};
	if (bpf_sk_storage_get(&proxy_socks, sk, 0, 0)) {
		if (peer_key(ctx, &k))
			bpf_map_delete_elem(&proxy_conns, &k);
	} else if (bpf_sk_storage_get(&probe_socks, sk, 0, 0)) {
		if (peer_key(ctx, &k)) {
			k.netns = 0;
			bpf_map_delete_elem(&probe_conns, &k);
		}
	} else if (closing && bpf_sk_storage_get(&sock_orig, sk, 0, 0)) {
		if (peer_key(ctx, &k))
			bpf_map_delete_elem(&orig_dsts, &k);
	}
}

// mesh_sockops runs for every TCP socket on the host. It acts on:
//   - ACTIVE_ESTABLISHED of sockets connect4/6 redirected (they carry sock_orig):
//     hands the original destination over, before the proxy can accept, and asks
//     for the socket's state changes, to take it back should the proxy's side
//     never be established; of proxy and kubelet sockets: drops their records
//     (the state changes they asked for at TCP_CONNECT cover a failed connect);
//   - PASSIVE_ESTABLISHED in enrolled netns: the accepted socket's SO_ORIGINAL_DST;
//   - TCP_LISTEN: collects inbound proxy listeners of enrolled netns;
//   - TCP_CONNECT of the proxy's and the kubelet's sockets: records the tuple for
//     inbound capture (and the proxy's reply mark);
//   - STATE (asked for above), to TCP_CLOSE: drops what the socket left.
SEC("sockops")
int mesh_sockops(struct bpf_sock_ops *ctx)
{
	struct bpf_sock *sk = ctx->sk;
	switch (ctx->op) {
	case BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB: {
		if (!sk)
			return 1;
		struct orig_dst *o = bpf_sk_storage_get(&sock_orig, sk, 0, 0);
		if (!o) {
			// Only the proxy's and the kubelet's sockets asked for state
			// changes at TCP_CONNECT; any other socket leaves here. The
			// flag stays: another data path sharing the cgroup root may
			// have asked for it too.
			if (ctx->bpf_sock_ops_cb_flags & BPF_SOCK_OPS_STATE_CB_FLAG)
				forget(ctx, sk, false);
			return 1;
		}
		struct tuple_key k = {};
		if (!peer_key(ctx, &k))
			return 1;
		struct orig_dst v = *o;
		bpf_map_update_elem(&orig_dsts, &k, &v, BPF_ANY);
		bpf_sock_ops_cb_flags_set(ctx, ctx->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
		return 1;
	}
	case BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB:
		accepted(ctx);
		return 1;
	case BPF_SOCK_OPS_TCP_LISTEN_CB:
		collect_listener(ctx);
		return 1;
	case BPF_SOCK_OPS_TCP_CONNECT_CB:
		if (!sk)
			return 1;
		if (bpf_sk_storage_get(&proxy_socks, sk, 0, 0))
			proxy_connect(ctx, sk);
		else if (bpf_sk_storage_get(&probe_socks, sk, 0, 0))
			probe_connect(ctx);
		return 1;
	case BPF_SOCK_OPS_STATE_CB:
		if (sk && ctx->args[1] == BPF_TCP_CLOSE)
			forget(ctx, sk, true);
		return 1;
	}
	return 1;
}

// mesh_getsockopt answers SO_ORIGINAL_DST for accepted sockets in enrolled netns.
// It runs for every getsockopt on the host: the first checks are on scalars in ctx,
// and it never touches retval or optval for a socket it has no entry for, so other
// programs attached next to it and the kernel's own answer are left alone.
SEC("cgroup/getsockopt")
int mesh_getsockopt(struct bpf_sockopt *ctx)
{
	if (ctx->optname != SO_ORIGINAL_DST)
		return 1;
	int level = ctx->level;
	if (level != SOL_IP && level != SOL_IPV6)
		return 1;
	struct bpf_sock *sk = ctx->sk;
	if (!sk || sk->protocol != IPPROTO_TCP)
		return 1;

	struct orig_dst *o = bpf_sk_storage_get(&accepted_orig, sk, 0, 0);
	if (!o) {
		// The hand-over entry stays in orig_dsts if the socket's storage could
		// not be allocated when it was accepted.
		struct tuple_key k = {};
		if (!sock_addrs(sk->family, &sk->src_ip4, &sk->dst_ip4, sk->src_ip6, sk->dst_ip6, k.local, k.remote))
			return 1;
		k.local_port = bpf_htons((__u16)sk->src_port);
		k.remote_port = sk->dst_port;
		k.netns = bpf_get_netns_cookie(ctx);
		o = bpf_map_lookup_elem(&orig_dsts, &k);
		if (!o)
			return 1;
	}

	if (level == SOL_IP) {
		// sockaddr_in cannot carry an IPv6 destination: leave the kernel's answer.
		if (o->family != AF_INET)
			return 1;
		struct mesh_sockaddr_in *sin = ctx->optval;
		if ((void *)(sin + 1) > ctx->optval_end)
			return 1;
		sin->family = AF_INET;
		sin->port = o->port;
		sin->addr = o->addr[3];
		__builtin_memset(sin->zero, 0, sizeof(sin->zero));
		ctx->optlen = sizeof(*sin);
	} else {
		// An IPv4 destination is given IPv4-mapped, as a dual-stack socket sees it.
		struct mesh_sockaddr_in6 *sin6 = ctx->optval;
		if ((void *)(sin6 + 1) > ctx->optval_end)
			return 1;
		sin6->family = AF_INET6;
		sin6->port = o->port;
		sin6->flowinfo = 0;
		copy_addr(sin6->addr, o->addr);
		// A link-local destination is only dialable with its interface: the
		// pod's (the client's connect named it, but the hooks cannot read it).
		__u32 scope = 0;
		if (o->family == AF_INET6 && is_link_local6(o->addr)) {
			__u64 netns = bpf_get_netns_cookie(ctx);
			struct pod_net_info *n = bpf_map_lookup_elem(&pod_net, &netns);
			if (n)
				scope = n->scope_id;
		}
		sin6->scope_id = scope;
		ctx->optlen = sizeof(*sin6);
	}
	ctx->retval = 0;
	return 1;
}

// mptcp_orig finds the original destination of an MPTCP socket: the connect hook
// ran for its first subflow, a TCP socket of its own that holds sock_orig, and the
// MPTCP socket reports that subflow's peer. The subflow is the socket of this netns
// connected from the MPTCP socket's local address and port to that peer. v6ctx is
// a constant (the context's address fields are those of the hook's family); v4
// asks for an IPv4 tuple: an IPv4-mapped subflow is hashed as IPv4.
static __always_inline struct orig_dst *mptcp_orig(struct bpf_sock_addr *ctx, struct bpf_sock *sk, bool v6ctx, bool v4)
{
	struct bpf_sock_tuple t = {};
	__u32 size;
	// Both fields read whatever the family: clang would otherwise pick the
	// offset per branch, and the verifier refuses arithmetic on a socket pointer.
	__u32 src4 = sk->src_ip4, src6 = sk->src_ip6[3];
	asm volatile("" : "+r"(src4), "+r"(src6));
	if (v4) {
		t.ipv4.saddr = v6ctx ? ctx->user_ip6[3] : ctx->user_ip4;
		t.ipv4.sport = (__u16)ctx->user_port;
		t.ipv4.daddr = sk->family == AF_INET6 ? src6 : src4;
		t.ipv4.dport = bpf_htons((__u16)sk->src_port);
		size = sizeof(t.ipv4);
	} else {
		copy_addr(t.ipv6.saddr, ctx->user_ip6);
		t.ipv6.sport = (__u16)ctx->user_port;
		copy_addr(t.ipv6.daddr, sk->src_ip6);
		t.ipv6.dport = bpf_htons((__u16)sk->src_port);
		size = sizeof(t.ipv6);
	}
	struct bpf_sock *sub = bpf_sk_lookup_tcp(ctx, &t, size, BPF_F_CURRENT_NETNS, 0);
	if (!sub)
		return NULL;
	struct orig_dst *o = bpf_sk_storage_get(&sock_orig, sub, 0, 0);
	bpf_sk_release(sub);
	return o;
}

// getpeername on a redirected client socket reports the original destination, as it
// does with iptables REDIRECT, instead of the proxy's address. The subflow of an
// AF_INET6 MPTCP socket is IPv4 when its peer is IPv4-mapped.
static __always_inline int getpeername_common(struct bpf_sock_addr *ctx, bool v6)
{
	struct bpf_sock *sk = ctx->sk;
	if (!sk)
		return 1;
	struct orig_dst *o = bpf_sk_storage_get(&sock_orig, sk, 0, 0);
	if (!o && sk->protocol == IPPROTO_MPTCP) {
		__u32 peer[4];
		copy_addr(peer, ctx->user_ip6);
		o = mptcp_orig(ctx, sk, v6, !v6 || is_v4_mapped(peer));
	}
	if (o)
		show_orig(ctx, v6, o);
	return 1;
}

SOCK_ADDR_PROGS(getpeername, getpeername_common)
