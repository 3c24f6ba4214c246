package redirect

// The BPF objects are generated from bpf/redirect.c and committed, so building mesh-cni
// needs no clang. Regenerate (clang 14, llvm-strip, from the repository root) with:
//
//	go generate ./internal/redirect/
//
// -mcpu=v3 lets clang use 32-bit jumps and ALU ops (kernel >= 5.1).

//go:generate go tool bpf2go -tags linux -target bpfel -type pod_settings -type pod_net_info -type pod_capture_info -type capture_flags -type lpm_key -type orig_dst -type tuple_key -type setting_flags -type listener_key -type listener_refusal -type node_config -type probe_config -type proxy_cgroup -type port_key redirect ../../bpf/redirect.c -- -I../../bpf -I/usr/include/x86_64-linux-gnu -Wall -Werror -mcpu=v3

// Object is the data path's compiled eBPF object, as it is loaded.
func Object() []byte { return _RedirectBytes }
