// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//
// Inbound capture at socket lookup (sk_lookup).

#include "lib/common.h"
#include "lib/maps.h"
#include "lib/addr.h"

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
	__u32 l6[4], r6[4];
	copy_addr(l6, ctx->local_ip6);
	copy_addr(r6, ctx->remote_ip6);
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
	struct pod_capture_info *c = NULL;
	if (s->flags & SETTING_CAPTURE)
		c = bpf_map_lookup_elem(&pod_capture, &netns);
	if (((s->flags & SETTING_INBOUND_PORTS) && port_in(s->inbound_port_set, lport)) ||
	    ((s->flags & SETTING_PROBE_SOURCES) && in_cidrs(&probe_srcs, s->probe_set, t.remote)) ||
	    (c && (c->flags & CAPTURE_INCLUDED_INBOUND_PORTS) && !port_in(c->inbound_include_set, lport))) {
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
