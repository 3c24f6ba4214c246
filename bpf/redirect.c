// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//
// mesh-cni redirection data path.
//
// Outbound: cgroup/connect4 + cgroup/connect6 rewrite TCP connects from enrolled
// network namespaces to the pod's outbound proxy port on loopback and remember the
// original destination in the socket's local storage. sockops copies it to a key the
// proxy's accepted socket can find (netns cookie + 4-tuple) once the connection is
// established, and cgroup/getsockopt answers SO_ORIGINAL_DST from that key.
// cgroup/getpeername4/6 restore the original peer for the redirected client socket.
//
// Inbound: a TCX ingress program inside each pod netns assigns new TCP connections to
// the inbound proxy listener with bpf_sk_assign (packets are never modified) and
// records the original destination under the key the proxy's accepted socket has.
//
// Enrollment is one entry in `settings`, keyed by the pod's netns cookie. Every program
// looks that entry up first and does nothing for namespaces it does not know, which is
// what lets several independent copies of this data path share the cgroup root.

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

char LICENSE[] SEC("license") = "Dual BSD/GPL";

// Constants the kernel headers define as macros (vmlinux.h carries only types/enums).
#define AF_INET 2
#define AF_INET6 10
#define SOL_IP 0
#define SOL_IPV6 41
#define SO_ORIGINAL_DST 80      // linux/netfilter_ipv4.h
#define IP6T_SO_ORIGINAL_DST 80 // linux/netfilter_ipv6/ip6_tables.h
#define ETH_P_IP 0x0800
#define ETH_P_IPV6 0x86DD
#define IP_MF_OFFSET 0x3fff // IP_MF | IP_OFFSET
#define TCP_FLAG_SYN 0x02
#define TCP_FLAG_RST 0x04
#define TCP_FLAG_ACK 0x10
#define NEXTHDR_HOP 0
#define NEXTHDR_ROUTING 43
#define NEXTHDR_DEST 60
#define MAX_IPV6_EXT_HEADERS 4

// Limits shared with the Go side (pkg/redirect reads them from the generated types).
#define MAX_EXCLUDED_PORTS 32

// settings.flags
enum setting_flags {
	SETTING_PROXY_UID = 1 << 0,      // proxy_uid is set
	SETTING_FAIL_OPEN = 1 << 1,      // no proxy listening: pass instead of fail
	SETTING_EXCLUDED_CIDRS = 1 << 2, // excluded_dsts has entries for this pod
	SETTING_PROBE_SOURCES = 1 << 3,  // probe_srcs has entries for this pod
};

// Per-pod settings, keyed by netns cookie. Ports are in host byte order.
struct pod_settings {
	__u16 outbound_port;
	__u16 inbound_port;
	__u32 proxy_mark;
	__u32 proxy_mark_mask; // 0: the mark check is off
	__u32 proxy_uid;
	enum setting_flags flags;
	__u32 nr_excluded_ports;
	__u16 excluded_ports[MAX_EXCLUDED_PORTS];
};

// Key of the CIDR tries. The prefix always covers the whole cookie, so one trie holds
// every pod's prefixes without one pod's entries matching another's. IPv4 prefixes are
// stored IPv4-mapped (::ffff:a.b.c.d, prefix + 96), so one lookup serves both families
// and IPv4-mapped destinations of dual-stack sockets.
struct lpm_key {
	__u32 prefixlen;
	__u32 cookie[2];
	__u32 addr[4]; // network byte order
};

// An original destination. addr is IPv4-mapped when family is AF_INET.
struct orig_dst {
	__u32 addr[4]; // network byte order
	__u16 port;    // network byte order
	__u16 family;
};

// The connection as the proxy's accepted socket sees it, in the pod's netns. Addresses
// are IPv4-mapped for IPv4 so AF_INET and dual-stack AF_INET6 sockets give one key.
struct tuple_key {
	__u64 netns;
	__u32 local[4];
	__u32 remote[4];
	__u16 local_port;  // network byte order
	__u16 remote_port; // network byte order
	__u32 pad;
};

// Index into `counters`. The Go side mirrors these values (pkg/redirect counters.go).
enum counter {
	COUNTER_OUT_REDIRECTED,
	COUNTER_OUT_PASSED,
	COUNTER_OUT_DROPPED,
	COUNTER_IN_REDIRECTED,
	COUNTER_IN_PASSED,
	COUNTER_IN_DROPPED,
	COUNTER_MAX,
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u64);
	__type(value, struct pod_settings);
} settings SEC(".maps");

// Outbound destinations never redirected.
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 16384);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct lpm_key);
	__type(value, __u8);
} excluded_dsts SEC(".maps");

// Inbound sources never redirected (kubelet probes).
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 16384);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct lpm_key);
	__type(value, __u8);
} probe_srcs SEC(".maps");

// Original destination of a redirected client socket. Socket-local storage is freed
// with the socket, so failed connects leave nothing behind, and it stays readable for
// getpeername during the socket's whole life.
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct orig_dst);
} sock_orig SEC(".maps");

// Original destination by the proxy-side tuple, for getsockopt(SO_ORIGINAL_DST). LRU:
// entries are never deleted explicitly (the proxy may ask at any time while the
// connection lives), the oldest are recycled.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct tuple_key);
	__type(value, struct orig_dst);
} orig_dsts SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, COUNTER_MAX);
	__type(key, __u32);
	__type(value, __u64);
} counters SEC(".maps");

// sockaddr layouts written into getsockopt's buffer. Defined here (not taken from
// vmlinux.h) so they carry no CO-RE relocations: they are user ABI, not kernel types.
struct mesh_sockaddr_in {
	__u16 family;
	__u16 port;
	__u32 addr;
	__u8 zero[8];
};

struct mesh_sockaddr_in6 {
	__u16 family;
	__u16 port;
	__u32 flowinfo;
	__u32 addr[4];
	__u32 scope_id;
};

struct ipv4_hdr {
	__u8 version_ihl;
	__u8 tos;
	__u16 tot_len;
	__u16 id;
	__u16 frag_off;
	__u8 ttl;
	__u8 protocol;
	__u16 check;
	__u32 saddr;
	__u32 daddr;
};

struct ipv6_hdr {
	__u32 version_tc_flow;
	__u16 payload_len;
	__u8 nexthdr;
	__u8 hop_limit;
	__u32 saddr[4];
	__u32 daddr[4];
};

struct ipv6_ext_hdr {
	__u8 nexthdr;
	__u8 len;
};

// The first 14 bytes of a TCP header: ports, sequence numbers, offset and flags.
struct tcp_hdr_start {
	__u16 sport;
	__u16 dport;
	__u32 seq;
	__u32 ack_seq;
	__u8 doff;
	__u8 flags;
};

// bpf_cast_to_kern_ctx (kernel >= 6.3) gives the struct sk_buff behind a
// __sk_buff, so the program can read the receiving device's namespace.
extern void *bpf_cast_to_kern_ctx(void *obj) __ksym;

// ingress_netns_cookie is the cookie of the netns the packet is being received in.
// bpf_get_netns_cookie(skb) is not that: it prefers skb->sk, and a veth keeps the
// sending socket on the skb across namespaces, so for pod-to-pod traffic it returns
// the *sender's* netns.
static __always_inline __u64 ingress_netns_cookie(struct __sk_buff *skb)
{
	struct sk_buff *kskb = bpf_cast_to_kern_ctx(skb);
	struct net_device *dev = kskb->dev;
	if (!dev)
		return 0;
	return dev->nd_net.net->net_cookie;
}

static __always_inline void count(__u32 idx)
{
	__u64 *c = bpf_map_lookup_elem(&counters, &idx);
	if (c)
		*c += 1;
}

static __always_inline void map_v4(__u32 *dst, __u32 ip4)
{
	dst[0] = 0;
	dst[1] = 0;
	dst[2] = bpf_htonl(0x0000ffff);
	dst[3] = ip4;
}

static __always_inline bool is_v4_mapped(const __u32 *a)
{
	return a[0] == 0 && a[1] == 0 && a[2] == bpf_htonl(0x0000ffff);
}

// Loopback and unspecified destinations stay inside the pod: never redirected, like
// the `! -d 127.0.0.1/32` exclusion of iptables-based meshes.
static __always_inline bool is_local_dst(const struct orig_dst *d)
{
	if (d->family == AF_INET) {
		__u32 ip = bpf_ntohl(d->addr[3]);
		return (ip >> 24) == 127 || ip == 0;
	}
	if (d->addr[0] || d->addr[1] || d->addr[2])
		return false;
	return d->addr[3] == 0 || d->addr[3] == bpf_htonl(1);
}

static __always_inline bool port_excluded(const struct pod_settings *s, __u16 port)
{
	__u32 n = s->nr_excluded_ports;

	for (__u32 i = 0; i < MAX_EXCLUDED_PORTS; i++) {
		if (i >= n)
			break;
		if (s->excluded_ports[i] == port)
			return true;
	}
	return false;
}

static __always_inline bool in_cidrs(void *trie, __u64 netns, const __u32 *addr)
{
	struct lpm_key key = {
		.prefixlen = 64 + 128,
		.cookie = {(__u32)netns, (__u32)(netns >> 32)},
		.addr = {addr[0], addr[1], addr[2], addr[3]},
	};
	return bpf_map_lookup_elem(trie, &key) != NULL;
}

// proxy_listening reports whether a TCP listener for the outbound port exists on the
// loopback address the connect is about to be rewritten to, in the socket's netns.
static __always_inline bool proxy_listening(struct bpf_sock_addr *ctx, bool v4, __u16 port)
{
	struct bpf_sock_tuple t = {};
	struct bpf_sock *sk;

	if (v4) {
		t.ipv4.daddr = bpf_htonl(0x7f000001);
		t.ipv4.dport = bpf_htons(port);
		sk = bpf_skc_lookup_tcp(ctx, &t, sizeof(t.ipv4), BPF_F_CURRENT_NETNS, 0);
	} else {
		t.ipv6.daddr[3] = bpf_htonl(1);
		t.ipv6.dport = bpf_htons(port);
		sk = bpf_skc_lookup_tcp(ctx, &t, sizeof(t.ipv6), BPF_F_CURRENT_NETNS, 0);
	}
	if (!sk)
		return false;
	bool listening = sk->state == BPF_TCP_LISTEN;
	bpf_sk_release(sk);
	return listening;
}

static __always_inline bool skip_outbound(struct bpf_sock_addr *ctx, const struct pod_settings *s,
					  __u64 netns, const struct orig_dst *d)
{
	if (is_local_dst(d))
		return true;
	struct bpf_sock *sk = ctx->sk;
	if (!sk)
		return true;
	if (s->proxy_mark_mask && (sk->mark & s->proxy_mark_mask) == s->proxy_mark)
		return true;
	if ((s->flags & SETTING_PROXY_UID) && (__u32)bpf_get_current_uid_gid() == s->proxy_uid)
		return true;
	if (port_excluded(s, bpf_ntohs(d->port)))
		return true;
	if ((s->flags & SETTING_EXCLUDED_CIDRS) && in_cidrs(&excluded_dsts, netns, d->addr))
		return true;
	return false;
}

static __always_inline int connect_common(struct bpf_sock_addr *ctx, bool v6)
{
	if (ctx->protocol != IPPROTO_TCP)
		return 1;
	__u64 netns = bpf_get_netns_cookie(ctx);
	struct pod_settings *s = bpf_map_lookup_elem(&settings, &netns);
	if (!s)
		return 1;

	struct orig_dst d = {};
	if (v6) {
		d.addr[0] = ctx->user_ip6[0];
		d.addr[1] = ctx->user_ip6[1];
		d.addr[2] = ctx->user_ip6[2];
		d.addr[3] = ctx->user_ip6[3];
		d.family = is_v4_mapped(d.addr) ? AF_INET : AF_INET6;
	} else {
		map_v4(d.addr, ctx->user_ip4);
		d.family = AF_INET;
	}
	d.port = (__u16)ctx->user_port;

	struct bpf_sock *sk = ctx->sk;
	if (!sk)
		return 1;
	if (skip_outbound(ctx, s, netns, &d)) {
		// A socket may connect again after a failed attempt: forget an earlier
		// redirection so getpeername does not report a stale peer.
		bpf_sk_storage_delete(&sock_orig, sk);
		count(COUNTER_OUT_PASSED);
		return 1;
	}

	bool v4 = d.family == AF_INET;
	if (!proxy_listening(ctx, v4, s->outbound_port)) {
		if (s->flags & SETTING_FAIL_OPEN) {
			bpf_sk_storage_delete(&sock_orig, sk);
			count(COUNTER_OUT_PASSED);
			return 1;
		}
		// Fail closed: still rewrite, the connect gets ECONNREFUSED from the
		// closed proxy port just like an iptables REDIRECT would.
		count(COUNTER_OUT_DROPPED);
	} else {
		count(COUNTER_OUT_REDIRECTED);
	}

	struct orig_dst *st = bpf_sk_storage_get(&sock_orig, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!st) {
		// Without the original destination the proxy cannot forward: refuse the
		// connect (EPERM) rather than let it bypass the proxy.
		return 0;
	}
	*st = d;

	ctx->user_port = bpf_htons(s->outbound_port);
	if (!v6) {
		ctx->user_ip4 = bpf_htonl(0x7f000001);
	} else if (v4) {
		ctx->user_ip6[0] = 0;
		ctx->user_ip6[1] = 0;
		ctx->user_ip6[2] = bpf_htonl(0x0000ffff);
		ctx->user_ip6[3] = bpf_htonl(0x7f000001);
	} else {
		ctx->user_ip6[0] = 0;
		ctx->user_ip6[1] = 0;
		ctx->user_ip6[2] = 0;
		ctx->user_ip6[3] = bpf_htonl(1);
	}
	return 1;
}

SEC("cgroup/connect4")
int mesh_connect4(struct bpf_sock_addr *ctx)
{
	return connect_common(ctx, false);
}

SEC("cgroup/connect6")
int mesh_connect6(struct bpf_sock_addr *ctx)
{
	return connect_common(ctx, true);
}

// mesh_sockops runs for every TCP socket on the host; it acts only on
// ACTIVE_ESTABLISHED of sockets that connect4/6 redirected (they carry storage). This
// callback runs before the proxy can accept the connection on loopback.
SEC("sockops")
int mesh_sockops(struct bpf_sock_ops *ctx)
{
	if (ctx->op != BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB)
		return 1;
	struct bpf_sock *sk = ctx->sk;
	if (!sk)
		return 1;
	struct orig_dst *o = bpf_sk_storage_get(&sock_orig, sk, 0, 0);
	if (!o)
		return 1;

	struct tuple_key k = {};
	k.netns = bpf_get_netns_cookie(ctx);
	// The proxy's local end is this socket's remote end and vice versa.
	if (ctx->family == AF_INET) {
		map_v4(k.local, ctx->remote_ip4);
		map_v4(k.remote, ctx->local_ip4);
	} else if (ctx->family == AF_INET6) {
		k.local[0] = ctx->remote_ip6[0];
		k.local[1] = ctx->remote_ip6[1];
		k.local[2] = ctx->remote_ip6[2];
		k.local[3] = ctx->remote_ip6[3];
		k.remote[0] = ctx->local_ip6[0];
		k.remote[1] = ctx->local_ip6[1];
		k.remote[2] = ctx->local_ip6[2];
		k.remote[3] = ctx->local_ip6[3];
	} else {
		return 1;
	}
	// bpf_sock_ops.remote_port holds the network-order port in its upper 16 bits on
	// little-endian (a long-standing kernel quirk); local_port is in host order.
	k.local_port = (__u16)(ctx->remote_port >> 16);
	k.remote_port = bpf_htons((__u16)ctx->local_port);

	struct orig_dst v = *o;
	bpf_map_update_elem(&orig_dsts, &k, &v, BPF_ANY);
	return 1;
}

// mesh_getsockopt answers SO_ORIGINAL_DST for proxy sockets of redirected connections.
// It runs for every getsockopt on the host: the first checks are on scalars in ctx, and
// it never touches retval or optval for a socket it has no entry for, so other programs
// attached next to it and the kernel's own answer are left alone.
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

	struct tuple_key k = {};
	__u32 family = sk->family;
	if (family == AF_INET) {
		map_v4(k.local, sk->src_ip4);
		map_v4(k.remote, sk->dst_ip4);
	} else if (family == AF_INET6) {
		k.local[0] = sk->src_ip6[0];
		k.local[1] = sk->src_ip6[1];
		k.local[2] = sk->src_ip6[2];
		k.local[3] = sk->src_ip6[3];
		k.remote[0] = sk->dst_ip6[0];
		k.remote[1] = sk->dst_ip6[1];
		k.remote[2] = sk->dst_ip6[2];
		k.remote[3] = sk->dst_ip6[3];
	} else {
		return 1;
	}
	k.local_port = bpf_htons((__u16)sk->src_port);
	k.remote_port = sk->dst_port;
	k.netns = bpf_get_netns_cookie(ctx);

	struct orig_dst *o = bpf_map_lookup_elem(&orig_dsts, &k);
	if (!o)
		return 1;

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
		sin6->addr[0] = o->addr[0];
		sin6->addr[1] = o->addr[1];
		sin6->addr[2] = o->addr[2];
		sin6->addr[3] = o->addr[3];
		sin6->scope_id = 0;
		ctx->optlen = sizeof(*sin6);
	}
	ctx->retval = 0;
	return 1;
}

// getpeername on a redirected client socket reports the original destination, as it
// does with iptables REDIRECT, instead of the loopback proxy address.
SEC("cgroup/getpeername4")
int mesh_getpeername4(struct bpf_sock_addr *ctx)
{
	struct bpf_sock *sk = ctx->sk;
	if (!sk)
		return 1;
	struct orig_dst *o = bpf_sk_storage_get(&sock_orig, sk, 0, 0);
	if (!o || o->family != AF_INET)
		return 1;
	ctx->user_ip4 = o->addr[3];
	ctx->user_port = o->port;
	return 1;
}

SEC("cgroup/getpeername6")
int mesh_getpeername6(struct bpf_sock_addr *ctx)
{
	struct bpf_sock *sk = ctx->sk;
	if (!sk)
		return 1;
	struct orig_dst *o = bpf_sk_storage_get(&sock_orig, sk, 0, 0);
	if (!o)
		return 1;
	// An AF_INET6 socket sees an IPv4 destination IPv4-mapped: addr already is.
	ctx->user_ip6[0] = o->addr[0];
	ctx->user_ip6[1] = o->addr[1];
	ctx->user_ip6[2] = o->addr[2];
	ctx->user_ip6[3] = o->addr[3];
	ctx->user_port = o->port;
	return 1;
}

struct packet {
	struct bpf_sock_tuple tuple; // as seen by the stack: saddr is the peer
	__u32 src[4];                // IPv4-mapped for IPv4
	__u32 dst[4];
	__u16 family;
	__u8 flags;
};

static __always_inline int parse_tcp(struct __sk_buff *skb, __u32 off, struct packet *p)
{
	struct tcp_hdr_start th;
	if (bpf_skb_load_bytes_relative(skb, off, &th, sizeof(th), BPF_HDR_START_NET))
		return -1;
	p->flags = th.flags;
	if (p->family == AF_INET) {
		p->tuple.ipv4.sport = th.sport;
		p->tuple.ipv4.dport = th.dport;
	} else {
		p->tuple.ipv6.sport = th.sport;
		p->tuple.ipv6.dport = th.dport;
	}
	return 0;
}

// parse fills p for a TCP packet; any other packet (or a fragment, or IPv6 with
// extension headers we do not walk) returns -1 and is passed untouched.
static __always_inline int parse(struct __sk_buff *skb, struct packet *p)
{
	if (skb->protocol == bpf_htons(ETH_P_IP)) {
		struct ipv4_hdr ip;
		if (bpf_skb_load_bytes_relative(skb, 0, &ip, sizeof(ip), BPF_HDR_START_NET))
			return -1;
		if (ip.protocol != IPPROTO_TCP || (ip.frag_off & bpf_htons(IP_MF_OFFSET)))
			return -1;
		__u32 ihl = (ip.version_ihl & 0x0f) * 4;
		if (ihl < sizeof(ip))
			return -1;
		p->family = AF_INET;
		p->tuple.ipv4.saddr = ip.saddr;
		p->tuple.ipv4.daddr = ip.daddr;
		map_v4(p->src, ip.saddr);
		map_v4(p->dst, ip.daddr);
		return parse_tcp(skb, ihl, p);
	}
	if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
		struct ipv6_hdr ip6;
		if (bpf_skb_load_bytes_relative(skb, 0, &ip6, sizeof(ip6), BPF_HDR_START_NET))
			return -1;
		__u32 off = sizeof(ip6);
		__u8 nh = ip6.nexthdr;
		for (int i = 0; i < MAX_IPV6_EXT_HEADERS; i++) {
			if (nh != NEXTHDR_HOP && nh != NEXTHDR_ROUTING && nh != NEXTHDR_DEST)
				break;
			struct ipv6_ext_hdr eh;
			if (bpf_skb_load_bytes_relative(skb, off, &eh, sizeof(eh), BPF_HDR_START_NET))
				return -1;
			off += ((__u32)eh.len + 1) * 8;
			nh = eh.nexthdr;
		}
		if (nh != IPPROTO_TCP)
			return -1;
		p->family = AF_INET6;
		__builtin_memcpy(p->tuple.ipv6.saddr, ip6.saddr, sizeof(ip6.saddr));
		__builtin_memcpy(p->tuple.ipv6.daddr, ip6.daddr, sizeof(ip6.daddr));
		__builtin_memcpy(p->src, ip6.saddr, sizeof(ip6.saddr));
		__builtin_memcpy(p->dst, ip6.daddr, sizeof(ip6.daddr));
		return parse_tcp(skb, off, p);
	}
	return -1;
}

static __always_inline __u16 packet_dport(const struct packet *p)
{
	return p->family == AF_INET ? p->tuple.ipv4.dport : p->tuple.ipv6.dport;
}

static __always_inline __u16 packet_sport(const struct packet *p)
{
	return p->family == AF_INET ? p->tuple.ipv4.sport : p->tuple.ipv6.sport;
}

// lookup_tcp looks up p's tuple with a size the verifier can see is constant.
static __always_inline struct bpf_sock *lookup_tcp(struct __sk_buff *skb, struct packet *p)
{
	if (p->family == AF_INET)
		return bpf_skc_lookup_tcp(skb, &p->tuple, sizeof(p->tuple.ipv4), BPF_F_CURRENT_NETNS, 0);
	return bpf_skc_lookup_tcp(skb, &p->tuple, sizeof(p->tuple.ipv6), BPF_F_CURRENT_NETNS, 0);
}

static __always_inline void set_tuple_dport(struct packet *p, __u16 port)
{
	if (p->family == AF_INET)
		p->tuple.ipv4.dport = port;
	else
		p->tuple.ipv6.dport = port;
}

// time_wait_syn handles a SYN whose tuple still has a TIME_WAIT socket: the proxy
// closed an earlier connection from the same client port first. The listener cannot
// take it (the kernel refuses a request socket that duplicates the TIME_WAIT one),
// and the kernel's own TIME_WAIT handling looks for a listener on the *original*
// port. With none there, that handling answers with an ACK, the client resets, the
// TIME_WAIT socket goes and the client's retransmitted SYN reaches the proxy: let
// the kernel do that. With an application listening there, the kernel would hand it
// the connection, bypassing the proxy: drop the SYN instead (fail closed) unless
// the pod is fail-open.
static __always_inline int time_wait_syn(struct __sk_buff *skb, struct packet *p,
					 const struct pod_settings *s)
{
	struct packet probe = *p;
	// Source port 0 matches no connection: the lookup finds only a listener.
	if (probe.family == AF_INET)
		probe.tuple.ipv4.sport = 0;
	else
		probe.tuple.ipv6.sport = 0;
	struct bpf_sock *sk = lookup_tcp(skb, &probe);
	bool app_listening = false;
	if (sk) {
		app_listening = sk->state == BPF_TCP_LISTEN;
		bpf_sk_release(sk);
	}
	if (!app_listening)
		return TCX_NEXT;
	if (s->flags & SETTING_FAIL_OPEN) {
		count(COUNTER_IN_PASSED);
		return TCX_NEXT;
	}
	count(COUNTER_IN_DROPPED);
	return TCX_DROP;
}

// mesh_ingress runs on the pod's own interfaces, inside its netns. An existing socket
// for the packet's tuple keeps the packet (so the handshake's last ACK reaches the
// request socket); a new connection goes to the inbound proxy listener. Packets are
// never modified: the proxy's accepted socket has the original destination as its
// local address.
SEC("tcx/ingress")
int mesh_ingress(struct __sk_buff *skb)
{
	struct packet p = {};
	if (parse(skb, &p))
		return TCX_NEXT;

	__u64 netns = ingress_netns_cookie(skb);
	struct pod_settings *s = bpf_map_lookup_elem(&settings, &netns);
	if (!s)
		return TCX_NEXT;

	bool syn = (p.flags & (TCP_FLAG_SYN | TCP_FLAG_ACK | TCP_FLAG_RST)) == TCP_FLAG_SYN;
	__u16 dport = packet_dport(&p);
	if (port_excluded(s, bpf_ntohs(dport)) ||
	    ((s->flags & SETTING_PROBE_SOURCES) && in_cidrs(&probe_srcs, netns, p.src))) {
		if (syn)
			count(COUNTER_IN_PASSED);
		return TCX_NEXT;
	}

	struct bpf_sock *sk = lookup_tcp(skb, &p);
	if (sk) {
		__u32 state = sk->state;
		if (state == BPF_TCP_TIME_WAIT && syn) {
			bpf_sk_release(sk);
			return time_wait_syn(skb, &p, s);
		}
		// A listener on the original port is not a match: new connections go to
		// the proxy.
		if (state != BPF_TCP_LISTEN) {
			bpf_sk_assign(skb, sk, 0);
			bpf_sk_release(sk);
			return TCX_NEXT;
		}
		bpf_sk_release(sk);
	}
	if (!syn)
		return TCX_NEXT; // nothing to keep: the stack answers as it would

	set_tuple_dport(&p, bpf_htons(s->inbound_port));
	sk = lookup_tcp(skb, &p);
	if (sk) {
		long err = -1;
		if (sk->state == BPF_TCP_LISTEN)
			err = bpf_sk_assign(skb, sk, 0);
		bpf_sk_release(sk);
		if (!err) {
			// The stack handles the packet after this program returns, so
			// the entry is in place before the proxy can accept.
			struct tuple_key k = {};
			struct orig_dst d = {};
			k.netns = netns;
			__builtin_memcpy(k.local, p.dst, sizeof(k.local));
			__builtin_memcpy(k.remote, p.src, sizeof(k.remote));
			k.local_port = dport;
			k.remote_port = packet_sport(&p);
			__builtin_memcpy(d.addr, p.dst, sizeof(d.addr));
			d.port = dport;
			d.family = p.family;
			bpf_map_update_elem(&orig_dsts, &k, &d, BPF_ANY);
			count(COUNTER_IN_REDIRECTED);
			return TCX_NEXT;
		}
	}

	if (s->flags & SETTING_FAIL_OPEN) {
		count(COUNTER_IN_PASSED);
		return TCX_NEXT;
	}
	count(COUNTER_IN_DROPPED);
	return TCX_DROP;
}
