// Package redirect is mesh-cni's eBPF data path: it redirects the TCP traffic of
// enrolled pods to a mesh proxy that listens inside each pod's network namespace,
// and answers SO_ORIGINAL_DST for the proxy the way iptables REDIRECT does.
//
// The programs are C in bpf/redirect.c, compiled by bpf2go into the committed
// redirect_bpfel.{go,o} (see gen.go). What they do:
//
//   - cgroup/connect4, cgroup/connect6 (at the cgroup v2 root): a TCP connect from an
//     enrolled netns to a destination that is not excluded is rewritten to
//     127.0.0.1 / [::1] / ::ffff:127.0.0.1 : outbound port; the original destination
//     goes into the socket's local storage.
//   - sockops: on ACTIVE_ESTABLISHED, copies it to orig_dsts under (netns cookie,
//     the 4-tuple as the proxy's accepted socket sees it).
//   - cgroup/getsockopt: answers SOL_IP/SO_ORIGINAL_DST and
//     SOL_IPV6/IP6T_SO_ORIGINAL_DST from orig_dsts.
//   - cgroup/getpeername4/6: the redirected client sees its original peer.
//   - tcx/ingress (on the pod's interfaces, inside its netns): new inbound TCP
//     connections are assigned to the inbound proxy listener with bpf_sk_assign,
//     packets of existing sockets keep going to them, nothing is rewritten; the
//     original destination is recorded in orig_dsts for getsockopt.
//
// Enrolling a pod is one entry in the settings map, keyed by the netns cookie;
// every program does nothing for namespaces without one. That is also why several
// Datapaths (different PinRoots) can share the cgroup root: each acts only on its
// own cookies, and getsockopt never touches a call it has no entry for.
//
// # Pin layout
//
//	<PinRoot>/maps/settings        netns cookie -> pod settings (hash)
//	<PinRoot>/maps/excluded_dsts   (cookie, prefix) LPM trie, outbound exclusions
//	<PinRoot>/maps/probe_srcs      (cookie, prefix) LPM trie, inbound probe sources
//	<PinRoot>/maps/sock_orig       socket storage: a redirected client's destination
//	<PinRoot>/maps/orig_dsts       (cookie, tuple) -> original destination (LRU)
//	<PinRoot>/maps/counters        per-CPU decision counters
//	<PinRoot>/links/{sockops,getsockopt,getpeername4,getpeername6,connect4,connect6}
//	<PinRoot>/pods/<cookie>/tcx_<ifindex>_<ifname>
//
// PinRoot defaults to /sys/fs/bpf/mesh-cni; Open mounts a bpffs there when the
// directory is not on one, and Uninstall unmounts it again.
//
// # Choices worth knowing
//
//   - Exclusion CIDRs live in two LPM tries keyed by (cookie, address), IPv4 stored
//     IPv4-mapped, rather than in fixed arrays in the settings value: no per-pod
//     limit baked into the map layout, one lookup for both families (and for
//     IPv4-mapped destinations of dual-stack sockets), no loop in the programs. Only
//     a flag in the settings entry says whether to look, so pods without CIDRs pay
//     nothing. Excluded ports are a short array in the settings value (32), scanned
//     with a bounded loop.
//   - The client's original destination is kept in socket-local storage, not in an
//     LRU keyed by socket cookie: it is freed with the socket (failed connects leave
//     nothing), and getpeername can read it for the socket's whole life.
//   - The TCX program takes the netns cookie from the receiving device
//     (bpf_cast_to_kern_ctx, kernel >= 6.3). bpf_get_netns_cookie(skb) prefers
//     skb->sk, which a veth keeps across namespaces: for pod-to-pod traffic it
//     returns the sender's netns.
//   - Fail-open is decided per connect: connect4/6 look up a listener on the
//     outbound port with bpf_skc_lookup_tcp (allowed in sock_addr programs) and, when
//     there is none, pass a fail-open pod's connect through; a fail-closed pod's
//     connect is rewritten anyway and gets ECONNREFUSED. Inbound, a SYN with no
//     listener is dropped unless the pod is fail-open.
//   - A SYN that reuses a tuple whose proxy-side socket is in TIME_WAIT cannot be
//     given to the listener (the kernel refuses a duplicate request socket), and
//     the kernel's own TIME_WAIT handling would look for a listener on the original
//     port. With no application listening there, the kernel's handling is left to
//     clear the TIME_WAIT socket and the client's retransmitted SYN reaches the
//     proxy. With one, the SYN is dropped (fail closed) rather than let the
//     connection bypass the proxy, until TIME_WAIT ends.
//   - Loopback and unspecified destinations are never redirected (pod-local
//     traffic). ProxyUID is compared with the connecting task's uid.
//   - MPTCP clients are redirected through their first subflow (the connect hook
//     sees the subflow), original destination included; getpeername on the MPTCP
//     socket still shows the proxy. Proxy listeners may be MPTCP (Go's default).
package redirect
