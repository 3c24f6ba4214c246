// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//
// The data path's maps, and their accessors. The two through which the per-pod
// sk_lookup program hands over to the shared one are in sk_lookup.c.

#ifndef __MESH_LIB_MAPS_H__
#define __MESH_LIB_MAPS_H__

#include "common.h"

// CIDR_SETS_MAP defines a map name of CIDR sets: an lpm_key (set, prefix)
// is in the set when its entry is there.
#define CIDR_SETS_MAP(name)                            \
	struct {                                       \
		__uint(type, BPF_MAP_TYPE_LPM_TRIE);   \
		__uint(max_entries, 16384);            \
		__uint(map_flags, BPF_F_NO_PREALLOC);  \
		__type(key, struct lpm_key);           \
		__type(value, __u8);                   \
	} name SEC(".maps")

// SK_STORAGE_MAP defines a socket-local storage map name of value type T:
// an entry lives as long as its socket (the kernel requires no preallocation).
#define SK_STORAGE_MAP(name, T)                        \
	struct {                                       \
		__uint(type, BPF_MAP_TYPE_SK_STORAGE); \
		__uint(map_flags, BPF_F_NO_PREALLOC);  \
		__type(key, int);                      \
		__type(value, T);                      \
	} name SEC(".maps")

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

// Each sidecar-mode pod's pod_capture_info, by netns cookie, next to its pods entry.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u64);
	__type(value, struct pod_capture_info);
} pod_capture SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct node_config);
} node SEC(".maps");

// Outbound destinations never redirected, by set.
CIDR_SETS_MAP(excluded_dsts);

// Inbound sources never captured (kubelet probes), by set.
CIDR_SETS_MAP(probe_srcs);

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
SK_STORAGE_MAP(sock_orig, struct orig_dst);

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
SK_STORAGE_MAP(accepted_orig, struct orig_dst);

// Sockets the connect hooks found to be the proxy's own.
SK_STORAGE_MAP(proxy_socks, __u8);

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
SK_STORAGE_MAP(probe_socks, __u8);

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

#endif // __MESH_LIB_MAPS_H__
