// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//
// What every part of the data path shares: the kernel and libbpf headers, the
// constants, and the layouts of the maps' keys and values (the Go side reads them
// from the generated types).

#ifndef __MESH_LIB_COMMON_H__
#define __MESH_LIB_COMMON_H__

#define BPF_NO_PRESERVE_ACCESS_INDEX
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>

// SOCK_ADDR_PROGS defines a cgroup sock_addr hook's IPv4 and IPv6 programs,
// mesh_<hook>4 and mesh_<hook>6, both the one body fn: called with v6 false and
// true, then the rest of the arguments given.
#define SOCK_ADDR_PROGS(hook, fn, ...)                              \
	SEC("cgroup/" #hook "4")                                    \
	int mesh_##hook##4(struct bpf_sock_addr *ctx)               \
	{                                                           \
		return fn(ctx, false, ##__VA_ARGS__);               \
	}                                                           \
	SEC("cgroup/" #hook "6")                                    \
	int mesh_##hook##6(struct bpf_sock_addr *ctx)               \
	{                                                           \
		return fn(ctx, true, ##__VA_ARGS__);                \
	}

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
	// The pod has a pod_capture entry (a sidecar of its own): the hooks look
	// it up for this pod only, not for every pod's connections.
	SETTING_CAPTURE = 1 << 17,
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

// pod_capture_info.flags
enum capture_flags {
	// The pod's own proxy is proxy's processes (a sidecar container's cgroup).
	CAPTURE_PROXY_CGROUP = 1 << 0,
	// The proxy's connects to the pod's local addresses other than 127.0.0.1
	// and ::1 (127.0.0.6, the pod's own address) go to its inbound port, as
	// Istio's sidecar rules send uid 1337's: the proxy calling its own pod
	// through a service, and the validation of the capture.
	CAPTURE_LOCAL_TO_INBOUND = 1 << 1,
	// Only outbound destinations in included_set are redirected
	// (traffic.sidecar.istio.io/includeOutboundIPRanges).
	CAPTURE_INCLUDED_CIDRS = 1 << 2,
	// ... and, whatever their destination, the ports of outbound_include_set.
	CAPTURE_INCLUDED_OUTBOUND_PORTS = 1 << 3,
	// Only inbound connections to the ports of inbound_include_set are captured.
	CAPTURE_INCLUDED_INBOUND_PORTS = 1 << 4,
};

// What an in-pod sidecar's capture adds to a pod's pod_settings (Istio's
// sidecar mode), by netns cookie; pods without an entry have none of it. A map
// of its own: pod_settings's layout is pinned. The sets are in excluded_dsts
// (CIDRs) and excluded_ports (ports), shared by content with the exclusions.
struct pod_capture_info {
	struct proxy_cgroup proxy;
	enum capture_flags flags;
	__u32 included_set;
	__u32 outbound_include_set;
	__u32 inbound_include_set;
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

// sockaddr layouts given to bpf_bind and written into getsockopt's buffer: user
// ABI, not kernel types.
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

#endif // __MESH_LIB_COMMON_H__
