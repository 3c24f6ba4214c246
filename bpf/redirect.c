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
// pass. The BPF LSM program is the exception: it reads the calling task's network
// namespace cookie (CO-RE, against the kernel's BTF).
//
// One compilation unit (bpf2go builds one file, and the programs share maps):
// lib/ holds what the parts share, each .c below the programs of one attach point.

#include "lib/common.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#include "sock_create.c"
#include "sock_addr.c"
#include "sockops.c"
#include "sk_lookup.c"
