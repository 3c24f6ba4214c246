// Package redirect is mesh-cni's eBPF data path: it redirects the TCP traffic of
// enrolled pods to a mesh proxy that listens inside each pod's network namespace,
// and answers SO_ORIGINAL_DST for the proxy the way iptables REDIRECT does.
//
// The programs are C in bpf/ (one compilation unit, bpf/redirect.c; its README
// says which file holds what), compiled by bpf2go into the committed
// redirect_bpfel.{go,o} (see gen.go). What they do:
//
//   - cgroup/connect4, cgroup/connect6 (at the cgroup v2 root): a TCP connect from an
//     enrolled netns to a destination that is not excluded is rewritten to
//     127.0.0.1 / [::1] / ::ffff:127.0.0.1 : outbound port; the original destination
//     goes into the socket's local storage. The proxy's own connects (its cgroup, or
//     opt-in its mark or uid) are left alone and remembered (proxy_socks).
//   - sockops: on ACTIVE_ESTABLISHED hands a redirected connection's original
//     destination over to the proxy's side (orig_dsts); on PASSIVE_ESTABLISHED in an
//     enrolled netns stores the accepted socket's SO_ORIGINAL_DST (accepted_orig);
//     on TCP_LISTEN collects the listeners of inbound ports (listeners, a SOCKHASH);
//     on TCP_CONNECT of the proxy's own sockets records the connection (proxy_conns).
//   - cgroup/getsockopt: answers SOL_IP/SO_ORIGINAL_DST and
//     SOL_IPV6/IP6T_SO_ORIGINAL_DST from accepted_orig.
//   - cgroup/getpeername4/6: the redirected client sees its original peer.
//   - sk_lookup, one program per enrolled netns with the netns cookie built in:
//     when the kernel looks for a listener for a new connection there, it assigns
//     one of the inbound proxy's listeners (bpf_sk_assign); nothing is rewritten,
//     so the accepted socket's local address is the original destination.
//
// Enrolling a pod is one entry in the pods map, keyed by the netns cookie, plus its
// sk_lookup link; every cgroup program does nothing for namespaces without an
// entry. That is also why several Datapaths (different PinRoots) can share the
// cgroup root: each acts only on its own cookies, and getsockopt never touches a
// call it has no entry for.
//
// # Pin layout
//
//	<PinRoot>/maps/pods            netns cookie -> pod settings (hash)
//	<PinRoot>/maps/excluded_dsts   (set, prefix) LPM trie, outbound exclusions
//	<PinRoot>/maps/probe_srcs      (set, prefix) LPM trie, inbound probe sources
//	<PinRoot>/maps/excluded_ports  (set, port) hash, port exclusions
//	<PinRoot>/maps/listeners       (netns, port, family, slot) -> listener (SOCKHASH)
//	<PinRoot>/maps/...             socket storage, hand-over maps, counters
//	<PinRoot>/links/{sockops,getsockopt,getpeername4,getpeername6,connect4,connect6}
//	<PinRoot>/pods/<cookie>/lookup_<netns inode>
//
// PinRoot defaults to /sys/fs/bpf/mesh-cni; Open mounts a bpffs when none is there.
//
// # Choices worth knowing
//
//   - Inbound capture is at socket lookup, not per packet: it runs after IP
//     reassembly and extension-header processing, so no packet shape can slip
//     past it, and established connections pay nothing. A new connection with no
//     proxy listening is reset (fail closed) unless the pod is fail-open.
//   - The sk_lookup program's identity: its context carries no netns, and it cannot
//     call bpf_get_netns_cookie, while bpf_sk_assign would hand a connection to a
//     listener of any namespace. The cookie is therefore fixed when the agent loads
//     the pod's program, from the namespace it attaches it to; nothing a pod or a
//     packet controls (an address, an interface) decides whose listeners it gets.
//     The per-pod program carries no BTF and no CO-RE relocations, so a load is
//     one short verifier pass.
//   - Listeners: sockops collects every listener of an inbound port (listen_ports),
//     whether or not its netns is enrolled yet (and Enroll those already open, from
//     their process with pidfd_getfd), into one of a few slots per
//     (netns, port, family): a SO_REUSEPORT group stays captured while any of its
//     slotted members is open, and the kernel then picks within the group. MPTCP
//     listeners cannot enter a SOCKHASH: they are reported (Refusals, a counter) and
//     the pod fails closed.
//   - The proxy's own connections into the pod (to the application, from another
//     local address or the client's) are not captured: connect4/6 mark the proxy's
//     sockets and sockops records their tuples at TCP_CONNECT.
//   - Lists (CIDRs, ports) are stored once per distinct list (a set id the pods
//     name), so the maps' sizes bound the number of distinct lists, not of pods,
//     and one pod cannot crowd another's entries out.
//   - The client's original destination is kept in socket-local storage, freed
//     with the socket; the proxy's side gets its own copy when it is established,
//     so the shared hand-over map only holds connections mid-handshake.
//   - Loopback and unspecified destinations are never redirected (pod-local
//     traffic); a pod connecting to its own address is not captured inbound.
//   - MPTCP clients are redirected through their first subflow (the connect hook
//     sees the subflow), original destination included; getpeername on the MPTCP
//     socket shows that destination too, read through the same subflow.
package redirect
