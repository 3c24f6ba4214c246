// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//
// Addresses. Both families are held as IPv6, IPv4 IPv4-mapped, so one code path
// and one map key serve AF_INET and dual-stack AF_INET6 sockets.

#ifndef __MESH_LIB_ADDR_H__
#define __MESH_LIB_ADDR_H__

#include "common.h"

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

// addr_family is the family of a (IPv4-mapped for IPv4).
static __always_inline __u16 addr_family(const __u32 *a)
{
	return is_v4_mapped(a) ? AF_INET : AF_INET6;
}

// copy_addr copies an address word by word, so that an address field of a
// context or a bpf_sock is read or written with the 4-byte accesses the verifier
// accepts for each of them.
static __always_inline void copy_addr(__u32 *dst, const __u32 *src)
{
	dst[0] = src[0];
	dst[1] = src[1];
	dst[2] = src[2];
	dst[3] = src[3];
}

// addr_set reports whether a holds an address: not all zeros.
static __always_inline bool addr_set(const __u32 *a)
{
	return a[0] | a[1] | a[2] | a[3];
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

// show_orig makes a sock_addr call report the original destination o instead of
// the proxy's address (getpeername's peer, recvmsg's source), in the form the
// socket's family gives it: IPv4-mapped for an IPv4 destination of an AF_INET6
// socket, as o holds it. An AF_INET socket cannot show an IPv6 one and is left
// the address it has.
static __always_inline void show_orig(struct bpf_sock_addr *ctx, bool v6, const struct orig_dst *o)
{
	if (!v6) {
		if (o->family != AF_INET)
			return;
		ctx->user_ip4 = o->addr[3];
	} else {
		copy_addr(ctx->user_ip6, o->addr);
	}
	ctx->user_port = o->port;
}

#endif // __MESH_LIB_ADDR_H__
