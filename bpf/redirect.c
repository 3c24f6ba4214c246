// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//
// mesh-cni redirection data path.
//
// Outbound: cgroup/connect4 + cgroup/connect6 rewrite TCP connects from enrolled
// network namespaces to the pod's outbound proxy port on loopback and remember the
// original destination in the socket's local storage. sockops hands it over to the
// proxy's accepted socket (through orig_dsts, keyed by netns cookie + 4-tuple, for the
// microseconds between the client's and the proxy's side of the handshake), and
// cgroup/getsockopt answers SO_ORIGINAL_DST from the accepted socket's storage.
// cgroup/getpeername4/6 restore the original peer for the redirected client socket.
//
// Inbound: an sk_lookup program attached to each pod's network namespace runs when
// the kernel looks for a listening socket for a new connection (after IP reassembly,
// never for established traffic) and hands the connection to the inbound proxy's
// listener with bpf_sk_assign. The proxy's listeners are collected into a SOCKHASH by
// sockops when they start listening. Packets are never modified: the accepted
// socket's local address is the original destination.
//
// The proxy's own connections into the pod (to the application, often from the
// client's address with IP_TRANSPARENT) are left alone by the lookup, and the proxy's
// socket gets the pod's reply mark before its SYN leaves: the pod accepts with
// tcp_fwmark_accept, so the application's socket inherits the mark and a policy
// route the agent puts in the pod's namespace delivers its replies back to the proxy
// on loopback. Kubelet probes are exempt by the socket that sends them: connects of
// the kubelet's cgroup in the node's namespace are recorded before their SYN leaves.
//
// Enrollment is one entry in `pods`, keyed by the pod's netns cookie (and one in
// `pod_net`, its addresses), plus the pod's sk_lookup link. Every cgroup program
// looks the `pods` entry up first and does nothing for namespaces it does not
// know, which is what lets several independent copies of this data path share the
// cgroup root.
//
// Only UAPI context structures are read (their layout is stable), so the programs
// carry no CO-RE relocations and a per-pod program loads with one short verifier
// pass. The BPF LSM programs are the exception: they read the calling task's
// network namespace cookie (CO-RE, against the kernel's BTF).

#define BPF_NO_PRESERVE_ACCESS_INDEX
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>

char LICENSE[] SEC("license") = "Dual BSD/GPL";

// Constants the kernel headers define as macros (vmlinux.h carries only types/enums).
#define AF_INET 2
#define AF_INET6 10
#define AF_PACKET 17
#define EPERM 1
#define SOL_IP 0
#define SOL_IPV6 41
#define SOL_SOCKET 1
#define SO_MARK 36
#define SO_ORIGINAL_DST 80      // linux/netfilter_ipv4.h
#define IP6T_SO_ORIGINAL_DST 80 // linux/netfilter_ipv6/ip6_tables.h
#define EEXIST 17

// Limits shared with the Go side (internal/redirect reads them from the generated types).
#define MAX_PROXY_CGROUPS 8
// The pod's own addresses the data path knows (every address of its interfaces at
// enrollment, lo's aside).
#define MAX_POD_ADDRS 8
// Listeners of one pod's inbound port and family that the data path holds at once:
// proxies with one SO_REUSEPORT listener per worker put each in its own slot (the
// kernel then picks within the whole group), so capture keeps working while any of
// them is open. Each slot costs the per-pod program's verification time.
#define LISTENER_SLOTS 8
// The ports of one pod that its own probes and lifecycle hooks name: the kubelet's
// connections reach these past the inbound capture (SETTING_KUBELET_PORTS).
#define MAX_KUBELET_PORTS 32

// The per-pod sk_lookup program carries its pod's netns cookie as an immediate: the
// loader replaces this marker (the program's context has no netns identity, and the
// program type cannot call bpf_get_netns_cookie).
#define POD_COOKIE_MARKER 0x6d6573682d636e69ULL

// pod_settings.flags
enum setting_flags {
	SETTING_PROXY_UID = 1 << 0,      // proxy_uid is set
	SETTING_FAIL_OPEN = 1 << 1,      // no proxy listening: pass instead of fail
	SETTING_EXCLUDED_CIDRS = 1 << 2, // excluded_set names a set in excluded_dsts
	SETTING_PROBE_SOURCES = 1 << 3,  // probe_set names a set in probe_srcs
	SETTING_PROXY_MARK = 1 << 4,     // sockets carrying proxy_mark are the proxy's
	SETTING_INBOUND_PORTS = 1 << 5,  // inbound_port_set names a set in excluded_ports
	SETTING_OUTBOUND_PORTS = 1 << 6, // outbound_port_set names a set in excluded_ports
	SETTING_DNS_CAPTURE = 1 << 7,    // DNS (port 53) goes to the proxy's dns_port
	SETTING_DNS_FAIL_CLOSED = 1 << 8, // ... even when nothing listens there
	// 1 << 9 meant the node's addresses were probe sources (an earlier layout);
	// never set now.
	SETTING_DENY_RAW = 1 << 10,       // the pod cannot create raw IP sockets
	SETTING_REPLY_MARK = 1 << 11,     // the proxy's connects into the pod get reply_mark
	SETTING_BYPASS_INBOUND = 1 << 12, // inbound connections are not captured
	// 1 << 13 marked settings copied from an earlier layout (a pod without
	// its pod_net entry is that now); never set now.
	SETTING_DENY_PACKET = 1 << 14, // the pod cannot create packet sockets (BPF LSM)
	// 1 << 15 asked an earlier build to splice the pod's writes to its
	// proxy (docs/design.md); never set now, and not to be given another
	// meaning while pins of those builds may exist.
	// The kubelet's connections pass the inbound capture only to the pod's
	// kubelet_ports (pod_net); without this flag, to any port (a source that
	// does not know the pod's probes, or the pinned release, which ignores it).
	SETTING_KUBELET_PORTS = 1 << 16,
};

#define DNS_PORT 53

// Per-pod settings, keyed by netns cookie. Ports are in host byte order. This is
// the layout of the pinned release too (which ignores the flags it does not
// know): a pinned map's layout never changes, so the agent can be rolled back
// without a pod losing its entry. New per-pod fields go into a new map, as
// pod_net did (docs/design.md, Upgrades).
struct pod_settings {
	__u16 outbound_port;
	__u16 inbound_port;
	enum setting_flags flags;
	__u32 proxy_mark;
	__u32 proxy_mark_mask;
	__u32 proxy_uid;
	__u32 excluded_set; // outbound destinations never redirected (excluded_dsts)
	__u32 probe_set;    // inbound sources never captured (probe_srcs)
	// Inbound destination ports never captured (the proxy's own ports).
	__u32 inbound_port_set;
	// Outbound destination ports never redirected.
	__u32 outbound_port_set;
	// The proxy's DNS listener (UDP and TCP) on loopback, for SETTING_DNS_CAPTURE.
	__u16 dns_port;
	__u16 pad;
};

// What Enroll read from the pod's namespace, keyed by netns cookie: its
// addresses, and the reply mark of the reply route it put there; and the ports
// its own probes name (from its spec). A pod with an
// entry in pods and none here (enrolled by a build without this map, such as
// the pinned release) is redirected without them: connects to its own
// addresses go to the proxy too, redirected connects leave from loopback, the
// proxy's connects into it get no mark. The agent enrolls such a pod again.
struct pod_net_info {
	// SETTING_REPLY_MARK: the mark (bits under reply_mark_mask) the proxy's
	// sockets connecting to one of the pod's addresses get, and with them the
	// application's side: its replies are routed back to the proxy.
	__u32 reply_mark;
	__u32 reply_mark_mask;
	// The interface a link-local original destination is scoped to (the
	// pod's interface holding src6), for IP6T_SO_ORIGINAL_DST.
	__u32 scope_id;
	// Source addresses of the pod's redirected connects, so the proxy sees the
	// pod's address as the peer, as after REDIRECT (0 / zero: none).
	__u32 src4;
	__u32 src6[4];
	// The pod's own addresses, IPv4-mapped for IPv4: connects to them stay in
	// the pod, and the proxy's connects to them carry the reply mark.
	__u32 nr_addrs;
	__u32 addrs[MAX_POD_ADDRS][4];
	// SETTING_KUBELET_PORTS: the ports (host byte order) of the pod's own
	// probes and lifecycle hooks, the only ones the kubelet's connections
	// reach past the inbound capture.
	__u32 nr_kubelet_ports;
	__u16 kubelet_ports[MAX_KUBELET_PORTS];
};

// A cgroup whose processes are the proxy: the node proxy's own cgroup (learned from
// its ZDS connection) or a configured parent of the pods' proxy containers. Matched
// with bpf_get_current_ancestor_cgroup_id(level), so processes in descendants count.
struct proxy_cgroup {
	__u64 id;
	__u32 level;
	__u32 pad;
};

// Node-wide settings: one entry.
struct node_config {
	__u32 nr_proxy_cgroups;
	__u32 pad;
	struct proxy_cgroup proxy_cgroups[MAX_PROXY_CGROUPS];
};

// Who may probe pods past their inbound capture: connects made in the node's own
// network namespace by processes of these cgroups (the kubelet's). One entry.
struct probe_config {
	__u64 host_netns;
	__u32 nr_cgroups;
	__u32 pad;
	struct proxy_cgroup cgroups[MAX_PROXY_CGROUPS];
};

// Key of the CIDR tries: a set of prefixes shared by every pod enrolled with the
// same list. The prefix always covers the whole set id. IPv4 prefixes are stored
// IPv4-mapped (::ffff:a.b.c.d, prefix + 96), so one lookup serves both families and
// IPv4-mapped destinations of dual-stack sockets.
struct lpm_key {
	__u32 prefixlen;
	__u32 set;
	__u32 addr[4]; // network byte order
};

// Key of excluded_ports: a port (host byte order) of a set.
struct port_key {
	__u32 set;
	__u16 port;
	__u16 pad;
};

// An original destination. addr is IPv4-mapped when family is AF_INET.
struct orig_dst {
	__u32 addr[4]; // network byte order
	__u16 port;    // network byte order
	__u16 family;
};

// A connection as its server side sees it, in the pod's netns. Addresses are
// IPv4-mapped for IPv4 so AF_INET and dual-stack AF_INET6 sockets give one key.
struct tuple_key {
	__u64 netns;
	__u32 local[4];
	__u32 remote[4];
	__u16 local_port;  // network byte order
	__u16 remote_port; // network byte order
	__u32 pad;
};

// A slot for one listener of a pod's inbound port. port is in host byte order.
struct listener_key {
	__u64 netns;
	__u16 port;
	__u8 family;
	__u8 slot;
	__u32 pad;
};

// Why a listener could not be captured, for the agent to report.
struct listener_refusal {
	__s32 err;
	__u32 count;
};

// Index into `counters`. The Go side mirrors these values (internal/redirect counters.go).
enum counter {
	COUNTER_OUT_REDIRECTED,
	COUNTER_OUT_PASSED,
	COUNTER_OUT_DROPPED,
	COUNTER_IN_REDIRECTED,
	COUNTER_IN_PASSED,
	COUNTER_IN_DROPPED,
	COUNTER_LISTENER_REFUSED,
	COUNTER_DNS_REDIRECTED,
	COUNTER_DNS_PASSED,
	COUNTER_DNS_DROPPED,
	COUNTER_MAX,
};

// Index into `socket_refusals`: counters that came after the size of `counters`
// was pinned (a pinned map's size never changes).
enum socket_refusal {
	REFUSED_RAW,
	REFUSED_PACKET,
	REFUSED_MAX,
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u64);
	__type(value, struct pod_settings);
} pods SEC(".maps");

// Each enrolled pod's pod_net_info, by netns cookie, next to its pods entry.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u64);
	__type(value, struct pod_net_info);
} pod_net SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct node_config);
} node SEC(".maps");

// Outbound destinations never redirected, by set.
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 16384);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct lpm_key);
	__type(value, __u8);
} excluded_dsts SEC(".maps");

// Inbound sources never captured (kubelet probes), by set.
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 16384);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct lpm_key);
	__type(value, __u8);
} probe_srcs SEC(".maps");

// Destination ports never redirected (outbound) or captured (inbound), by set:
// a hash lookup instead of a scan keeps the per-pod program small to verify.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct port_key);
	__type(value, __u8);
} excluded_ports SEC(".maps");

// Original destination of a redirected client socket. Socket-local storage is freed
// with the socket, so failed connects leave nothing behind, and it stays readable for
// getpeername during the socket's whole life.
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct orig_dst);
} sock_orig SEC(".maps");

// A redirected connection's original destination between the client's side of the
// handshake and the proxy's: entries live until the proxy's side is established
// (moved into accepted_orig then) or the client's socket closes, whichever comes
// first; LRU besides.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct tuple_key);
	__type(value, struct orig_dst);
} orig_dsts SEC(".maps");

// SO_ORIGINAL_DST of an accepted socket in an enrolled netns, freed with it: the
// handed-over destination of a redirected outbound connection, else (inbound) the
// socket's own local address, as conntrack answers for a connection it did not NAT.
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct orig_dst);
} accepted_orig SEC(".maps");

// Sockets the connect hooks found to be the proxy's own.
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, __u8);
} proxy_socks SEC(".maps");

// Connections the proxy opens from inside the pod (to the application, often with the
// client's address as source), as their server side sees them: inbound capture
// leaves them alone, like the `-i lo -j ACCEPT` of iptables-based in-pod capture.
// An entry lives from the proxy's TCP_CONNECT until its side is established or
// closes.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct tuple_key);
	__type(value, __u8);
} proxy_conns SEC(".maps");

// The probe_config entry.
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct probe_config);
} probe_node SEC(".maps");

// Sockets the connect hooks found to be the kubelet's (probe_node).
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, __u8);
} probe_socks SEC(".maps");

// The kubelet's connections mid-handshake, as their server side sees them, netns
// 0 (the client does not know the pod's). Recorded at TCP_CONNECT, before the SYN
// leaves, and removed when the client's side is established or closes, so an entry
// lives for one handshake; an attacker would have to send the kubelet's exact
// 4-tuple within it.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct tuple_key);
	__type(value, __u8);
} probe_conns SEC(".maps");

// The inbound proxies' listeners, only those of enrolled namespaces on their
// pod's inbound port: at most LISTENER_SLOTS per family and pod.
struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, 16384);
	__type(key, struct listener_key);
	__type(value, __u64);
} listeners SEC(".maps");

// Listeners that could not be collected, by (netns, port, family): an MPTCP
// listener (a sockhash refuses it) or every slot taken.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct listener_key);
	__type(value, struct listener_refusal);
} listen_refused SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, COUNTER_MAX);
	__type(key, __u32);
	__type(value, __u64);
} counters SEC(".maps");

// Sockets refused to pods (sock_create, socket_create), by enum socket_refusal.
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, REFUSED_MAX);
	__type(key, __u32);
	__type(value, __u64);
} socket_refusals SEC(".maps");

// sockaddr layouts written into getsockopt's buffer: user ABI, not kernel types.
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

static __always_inline void count_in(void *map, __u32 idx)
{
	__u64 *c = bpf_map_lookup_elem(map, &idx);
	if (c)
		*c += 1;
}

static __always_inline void count(__u32 idx)
{
	count_in(&counters, idx);
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

// is_loopback_or_any reports 127.0.0.0/8, ::1 and the unspecified addresses (a is
// IPv4-mapped for IPv4).
static __always_inline bool is_loopback_or_any(const __u32 *a)
{
	if (is_v4_mapped(a)) {
		__u32 ip = bpf_ntohl(a[3]);
		return (ip >> 24) == 127 || ip == 0;
	}
	if (a[0] || a[1] || a[2])
		return false;
	return a[3] == 0 || a[3] == bpf_htonl(1);
}

static __always_inline bool addr_eq(const __u32 *a, const __u32 *b)
{
	return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3];
}

static __always_inline bool port_in(__u32 set, __u16 port)
{
	struct port_key k = {.set = set, .port = port};
	return bpf_map_lookup_elem(&excluded_ports, &k) != NULL;
}

static __always_inline bool in_cidrs(void *trie, __u32 set, const __u32 *addr)
{
	struct lpm_key key = {
		.prefixlen = 32 + 128,
		.set = set,
		.addr = {addr[0], addr[1], addr[2], addr[3]},
	};
	return bpf_map_lookup_elem(trie, &key) != NULL;
}

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

// is_pod_addr reports whether a (IPv4-mapped for IPv4) is one of the pod's own
// addresses (none known without its pod_net entry, n).
static __always_inline bool is_pod_addr(const struct pod_net_info *n, const __u32 *a)
{
	if (!n)
		return false;
	__u32 nr = n->nr_addrs;
	for (__u32 i = 0; i < MAX_POD_ADDRS; i++) {
		if (i >= nr)
			break;
		if (addr_eq(n->addrs[i], a))
			return true;
	}
	return false;
}

static __always_inline bool is_link_local6(const __u32 *a)
{
	return (bpf_ntohl(a[0]) & 0xffc00000) == 0xfe800000;
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
	a[0] = 0;
	a[1] = 0;
	if (v4) {
		a[2] = bpf_htonl(0x0000ffff);
		a[3] = sk->bound_dev_if && n && n->src4 ? n->src4 : bpf_htonl(0x7f000001);
		return;
	}
	if (sk->bound_dev_if && n && (n->src6[0] | n->src6[1] | n->src6[2] | n->src6[3])) {
		a[0] = n->src6[0];
		a[1] = n->src6[1];
		a[2] = n->src6[2];
		a[3] = n->src6[3];
		return;
	}
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
		t.ipv6.daddr[0] = a[0];
		t.ipv6.daddr[1] = a[1];
		t.ipv6.daddr[2] = a[2];
		t.ipv6.daddr[3] = a[3];
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
	ctx->user_ip6[0] = a[0];
	ctx->user_ip6[1] = a[1];
	ctx->user_ip6[2] = a[2];
	ctx->user_ip6[3] = a[3];
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
	if (sk->src_ip6[0] | sk->src_ip6[1] | sk->src_ip6[2] | sk->src_ip6[3])
		return;
	struct mesh_sockaddr_in6 sin6 = {.family = AF_INET6};
	if (v4dst) {
		if (!n->src4)
			return;
		map_v4(sin6.addr, n->src4);
	} else {
		if (!(n->src6[0] | n->src6[1] | n->src6[2] | n->src6[3]))
			return;
		sin6.addr[0] = n->src6[0];
		sin6.addr[1] = n->src6[1];
		sin6.addr[2] = n->src6[2];
		sin6.addr[3] = n->src6[3];
	}
	bpf_bind(ctx, (struct sockaddr *)&sin6, sizeof(sin6));
}

// user_dst reads the connect's or datagram's destination, IPv4-mapped for IPv4.
static __always_inline void user_dst(struct bpf_sock_addr *ctx, bool v6, struct orig_dst *d)
{
	if (v6) {
		d->addr[0] = ctx->user_ip6[0];
		d->addr[1] = ctx->user_ip6[1];
		d->addr[2] = ctx->user_ip6[2];
		d->addr[3] = ctx->user_ip6[3];
		d->family = is_v4_mapped(d->addr) ? AF_INET : AF_INET6;
	} else {
		map_v4(d->addr, ctx->user_ip4);
		d->family = AF_INET;
	}
	d->port = (__u16)ctx->user_port;
}

// is_proxy_socket: the proxy's own connects are never redirected.
static __always_inline bool is_proxy_socket(struct bpf_sock *sk, const struct pod_settings *s)
{
	if ((s->flags & SETTING_PROXY_MARK) && (sk->mark & s->proxy_mark_mask) == s->proxy_mark)
		return true;
	if ((s->flags & SETTING_PROXY_UID) && (__u32)bpf_get_current_uid_gid() == s->proxy_uid)
		return true;
	return is_proxy_task();
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
	if (!proxy_listening(ctx, a, v4, s->dns_port, udp)) {
		if (!(s->flags & SETTING_DNS_FAIL_CLOSED)) {
			bpf_sk_storage_delete(&sock_orig, sk);
			count(COUNTER_DNS_PASSED);
			return 1;
		}
		count(COUNTER_DNS_DROPPED);
	} else {
		count(COUNTER_DNS_REDIRECTED);
	}
	struct orig_dst *st = bpf_sk_storage_get(&sock_orig, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!st)
		return 0;
	*st = *d;
	if (connect && !udp)
		bind_pod_source(ctx, sk, n, v6, v4);
	rewrite_dst(ctx, v6, a, s->dns_port);
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

	// A socket may connect again after a failed attempt: forget an earlier
	// redirection so getpeername does not report a stale peer.
	if (is_proxy_socket(sk, s)) {
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
	if (is_loopback_or_any(d.addr) || is_pod_addr(n, d.addr) ||
	    ((s->flags & SETTING_OUTBOUND_PORTS) && port_in(s->outbound_port_set, bpf_ntohs(d.port))) ||
	    ((s->flags & SETTING_EXCLUDED_CIDRS) && in_cidrs(&excluded_dsts, s->excluded_set, d.addr))) {
		bpf_sk_storage_delete(&sock_orig, sk);
		count(COUNTER_OUT_PASSED);
		return 1;
	}

	bool v4 = d.family == AF_INET;
	__u32 a[4];
	proxy_addr(sk, n, v4, a);
	if (!proxy_listening(ctx, a, v4, s->outbound_port, false)) {
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
	if (connect)
		bind_pod_source(ctx, sk, n, v6, v4);
	rewrite_dst(ctx, v6, a, s->outbound_port);
	return 1;
}

// sock_create refuses raw IP sockets (AF_INET and AF_INET6 SOCK_RAW) in a pod
// with SETTING_DENY_RAW. With the CAP_NET_RAW that runtimes grant by default, a
// raw socket sends TCP, a SYN to anywhere, without connect(), so past the
// outbound capture. Refused at creation, socket() fails with EPERM; the check
// costs one lookup per socket created, nothing per packet. The kernel runs this
// hook for IP sockets only: packet (AF_PACKET) sockets are not covered.
SEC("cgroup/sock_create")
int mesh_sock_create(struct bpf_sock *ctx)
{
	if (ctx->type != SOCK_RAW)
		return 1;
	__u64 netns = bpf_get_netns_cookie(ctx);
	struct pod_settings *s = bpf_map_lookup_elem(&pods, &netns);
	if (!s || !(s->flags & SETTING_DENY_RAW))
		return 1;
	count_in(&socket_refusals, REFUSED_RAW);
	return 0;
}

// mesh_socket_create (BPF LSM, loaded only where the node runs the BPF LSM and
// a pod asks for it) refuses packet sockets (AF_PACKET) to a pod with
// SETTING_DENY_PACKET: the cgroup socket hook never sees them, and with the
// CAP_NET_RAW runtimes grant by default a packet socket sends any frame, a TCP
// handshake as another address (answering ARP for it) included. The pod is the
// creating task's network namespace, read through its BTF (the one CO-RE
// access of this file). Costs one map lookup per packet socket created.
SEC("lsm/socket_create")
int BPF_PROG(mesh_socket_create, int family, int type, int protocol, int kern, int ret)
{
	if (ret || kern || family != AF_PACKET)
		return ret;
	struct task_struct *task = bpf_get_current_task_btf();
	__u64 netns = BPF_CORE_READ(task, nsproxy, net_ns, net_cookie);
	struct pod_settings *s = bpf_map_lookup_elem(&pods, &netns);
	if (!s || !(s->flags & SETTING_DENY_PACKET))
		return 0;
	count_in(&socket_refusals, REFUSED_PACKET);
	return -EPERM;
}

SEC("cgroup/connect4")
int mesh_connect4(struct bpf_sock_addr *ctx)
{
	return redirect_common(ctx, false, true);
}

SEC("cgroup/connect6")
int mesh_connect6(struct bpf_sock_addr *ctx)
{
	return redirect_common(ctx, true, true);
}

// sendmsg4/6 run for datagrams sent with an address (sendto, sendmsg with a name):
// DNS queries of unconnected UDP sockets.
SEC("cgroup/sendmsg4")
int mesh_sendmsg4(struct bpf_sock_addr *ctx)
{
	return redirect_common(ctx, false, false);
}

SEC("cgroup/sendmsg6")
int mesh_sendmsg6(struct bpf_sock_addr *ctx)
{
	return redirect_common(ctx, true, false);
}

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
	if (!is_loopback_or_any(from.addr))
		return 1;
	if (!v6) {
		if (o->family != AF_INET)
			return 1;
		ctx->user_ip4 = o->addr[3];
	} else {
		ctx->user_ip6[0] = o->addr[0];
		ctx->user_ip6[1] = o->addr[1];
		ctx->user_ip6[2] = o->addr[2];
		ctx->user_ip6[3] = o->addr[3];
	}
	ctx->user_port = o->port;
	return 1;
}

SEC("cgroup/recvmsg4")
int mesh_recvmsg4(struct bpf_sock_addr *ctx)
{
	return recvmsg_common(ctx, false);
}

SEC("cgroup/recvmsg6")
int mesh_recvmsg6(struct bpf_sock_addr *ctx)
{
	return recvmsg_common(ctx, true);
}

// ops_addrs fills the local and remote address of a sockops socket, IPv4-mapped for
// IPv4 (and as a dual-stack socket sees an IPv4 peer). Returns false for other
// families.
static __always_inline bool ops_addrs(struct bpf_sock_ops *ctx, __u32 *local, __u32 *remote)
{
	if (ctx->family == AF_INET) {
		map_v4(local, ctx->local_ip4);
		map_v4(remote, ctx->remote_ip4);
		return true;
	}
	if (ctx->family == AF_INET6) {
		local[0] = ctx->local_ip6[0];
		local[1] = ctx->local_ip6[1];
		local[2] = ctx->local_ip6[2];
		local[3] = ctx->local_ip6[3];
		remote[0] = ctx->remote_ip6[0];
		remote[1] = ctx->remote_ip6[1];
		remote[2] = ctx->remote_ip6[2];
		remote[3] = ctx->remote_ip6[3];
		return true;
	}
	return false;
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
		d.family = is_v4_mapped(k.local) ? AF_INET : AF_INET6;
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
		sin6->addr[0] = o->addr[0];
		sin6->addr[1] = o->addr[1];
		sin6->addr[2] = o->addr[2];
		sin6->addr[3] = o->addr[3];
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
		t.ipv6.saddr[0] = ctx->user_ip6[0];
		t.ipv6.saddr[1] = ctx->user_ip6[1];
		t.ipv6.saddr[2] = ctx->user_ip6[2];
		t.ipv6.saddr[3] = ctx->user_ip6[3];
		t.ipv6.sport = (__u16)ctx->user_port;
		t.ipv6.daddr[0] = sk->src_ip6[0];
		t.ipv6.daddr[1] = sk->src_ip6[1];
		t.ipv6.daddr[2] = sk->src_ip6[2];
		t.ipv6.daddr[3] = sk->src_ip6[3];
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
// does with iptables REDIRECT, instead of the proxy's address.
SEC("cgroup/getpeername4")
int mesh_getpeername4(struct bpf_sock_addr *ctx)
{
	struct bpf_sock *sk = ctx->sk;
	if (!sk)
		return 1;
	struct orig_dst *o = bpf_sk_storage_get(&sock_orig, sk, 0, 0);
	if (!o && sk->protocol == IPPROTO_MPTCP)
		o = mptcp_orig(ctx, sk, false, true);
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
	if (!o && sk->protocol == IPPROTO_MPTCP) {
		__u32 peer[4] = {ctx->user_ip6[0], ctx->user_ip6[1], ctx->user_ip6[2], ctx->user_ip6[3]};
		o = mptcp_orig(ctx, sk, true, is_v4_mapped(peer));
	}
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

// try_slots assigns the first listener of k's port and family that takes the
// connection. The kernel then picks within the listener's SO_REUSEPORT group, if it
// has one.
static __always_inline bool try_slots(struct bpf_sk_lookup *ctx, struct listener_key *k)
{
#pragma unroll
	for (__u32 slot = 0; slot < LISTENER_SLOTS; slot++) {
		k->slot = slot;
		struct bpf_sock *sk = bpf_map_lookup_elem(&listeners, k);
		if (sk) {
			long err = bpf_sk_assign(ctx, sk, 0);
			bpf_sk_release(sk);
			if (!err)
				return true;
		}
	}
	return false;
}

// assign_listener gives the connection to one of the pod's inbound listeners of its
// family (IPv6 listeners are in the IPv4 slots too).
static __always_inline bool assign_listener(struct bpf_sk_lookup *ctx, __u64 netns, __u16 port, bool v4)
{
	struct listener_key k = {.netns = netns, .port = port, .family = v4 ? AF_INET : AF_INET6};
	return try_slots(ctx, &k);
}

// The per-pod program hands its cookie to the shared one through this per-CPU
// slot, written right before the tail call: the networking receive path runs with
// bottom halves disabled and migration off, so nothing else runs on this CPU in
// between (on PREEMPT_RT, too, bottom-half sections of one CPU are serialized).
struct lookup_scratch {
	__u64 netns;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct lookup_scratch);
} lookup_scratch SEC(".maps");

// Slot 0 holds mesh_lookup_main; an upgrade replaces it for every pod at once.
struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} lookup_main SEC(".maps");

// mesh_lookup is loaded once per enrolled netns, with its cookie in place of
// POD_COOKIE_MARKER, and attached to that netns: a few instructions, so loading one
// (every pod's ADD) costs one tiny verifier pass. It runs when the kernel looks for
// a listener for a new connection there: after reassembly, whatever the packet's
// headers, and never for packets of an existing connection.
SEC("sk_lookup")
int mesh_lookup(struct bpf_sk_lookup *ctx)
{
	__u32 zero = 0;
	struct lookup_scratch *sc = bpf_map_lookup_elem(&lookup_scratch, &zero);
	if (!sc)
		return SK_DROP;
	__u64 netns = POD_COOKIE_MARKER;
	// Keep the marker a single immediate the loader can find and replace.
	asm volatile("" : "+r"(netns));
	sc->netns = netns;
	bpf_tail_call(ctx, &lookup_main, 0);
	// The shared program is always in place while pods are enrolled: without
	// it, fail closed.
	return SK_DROP;
}

// kubelet_port: the kubelet's connection to port of the pod passes its inbound
// capture. With SETTING_KUBELET_PORTS only the ports of the pod's own probes and
// hooks do; one aimed at another port (a probe whose host names this pod from
// another pod's spec) is captured like any other. No pod_net entry fails closed.
static __always_inline bool kubelet_port(const struct pod_settings *s, __u64 netns, __u16 port)
{
	if (!(s->flags & SETTING_KUBELET_PORTS))
		return true;
	struct pod_net_info *n = bpf_map_lookup_elem(&pod_net, &netns);
	if (!n)
		return false;
	__u32 nr = n->nr_kubelet_ports;
	for (__u32 i = 0; i < MAX_KUBELET_PORTS; i++) {
		if (i >= nr)
			break;
		if (n->kubelet_ports[i] == port)
			return true;
	}
	return false;
}

// mesh_lookup_main decides for the pod whose cookie mesh_lookup left in
// lookup_scratch.
SEC("sk_lookup")
int mesh_lookup_main(struct bpf_sk_lookup *ctx)
{
	if (ctx->protocol != IPPROTO_TCP)
		return SK_PASS;
	__u32 zero = 0;
	struct lookup_scratch *sc = bpf_map_lookup_elem(&lookup_scratch, &zero);
	if (!sc)
		return SK_DROP;
	__u64 netns = sc->netns;
	struct pod_settings *s = bpf_map_lookup_elem(&pods, &netns);
	if (!s)
		return SK_PASS;

	// Every address field is read whatever the family (the ones of the other
	// family read as zero): clang would otherwise pick a context offset per
	// branch, and the verifier refuses a context pointer that was moved.
	__u32 l4 = ctx->local_ip4, r4 = ctx->remote_ip4;
	__u32 l6[4] = {ctx->local_ip6[0], ctx->local_ip6[1], ctx->local_ip6[2], ctx->local_ip6[3]};
	__u32 r6[4] = {ctx->remote_ip6[0], ctx->remote_ip6[1], ctx->remote_ip6[2], ctx->remote_ip6[3]};
	struct tuple_key t = {.netns = netns};
	bool v4 = ctx->family == AF_INET;
	if (v4) {
		map_v4(t.local, l4);
		map_v4(t.remote, r4);
	} else {
		__builtin_memcpy(t.local, l6, sizeof(t.local));
		__builtin_memcpy(t.remote, r6, sizeof(t.remote));
	}
	__u16 lport = (__u16)ctx->local_port;
	t.local_port = bpf_htons(lport);
	t.remote_port = ctx->remote_port;

	// Pod-local connections (loopback, or the pod dialing its own address) and the
	// proxy's own connections into the pod are not captured.
	if (is_loopback_or_any(t.local) || addr_eq(t.local, t.remote) ||
	    bpf_map_lookup_elem(&proxy_conns, &t))
		return SK_PASS;
	if (s->flags & SETTING_BYPASS_INBOUND) {
		count(COUNTER_IN_PASSED);
		return SK_PASS;
	}
	if (((s->flags & SETTING_INBOUND_PORTS) && port_in(s->inbound_port_set, lport)) ||
	    ((s->flags & SETTING_PROBE_SOURCES) && in_cidrs(&probe_srcs, s->probe_set, t.remote))) {
		count(COUNTER_IN_PASSED);
		return SK_PASS;
	}
	// The kubelet's probes, by the socket that sent them (probe_conns), to a
	// port the pod's own probes name.
	t.netns = 0;
	if (bpf_map_lookup_elem(&probe_conns, &t) && kubelet_port(s, netns, lport)) {
		count(COUNTER_IN_PASSED);
		return SK_PASS;
	}
	if (assign_listener(ctx, netns, s->inbound_port, v4)) {
		count(COUNTER_IN_REDIRECTED);
		return SK_PASS;
	}
	if (s->flags & SETTING_FAIL_OPEN) {
		count(COUNTER_IN_PASSED);
		return SK_PASS;
	}
	// No proxy listening: the client gets a reset, as from a closed port.
	count(COUNTER_IN_DROPPED);
	return SK_DROP;
}
