// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//
// Socket creation: raw IP sockets (cgroup/sock_create) and packet sockets (BPF
// LSM) refused to the pods that ask for it.

#include "lib/common.h"
#include "lib/maps.h"

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
