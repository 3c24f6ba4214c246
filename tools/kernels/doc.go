// Package kernels runs the project's kernel matrix: the data-path tests and a
// fast end-to-end subset, on each kernel the project makes a claim about,
// booted in a QEMU VM on the test machine. It is how every kernel claim in the
// docs (docs/compatibility.md) is proved; `make test-kernels` runs it (tools/cmd/kernels), CI too.
//
// The matrix (matrix.txt, embedded) lists each kernel, where its packages come
// from, and for each suite (suites.go) whether it must pass or must fail there;
// skips.txt, the tests each kernel is expected to skip and why. Both directions
// are checked: a suite that fails where the matrix says pass is a regression,
// one that passes where it says fail is a gap closed without the matrix (and
// so docs/compatibility.md, generated from both) saying so; a test that skips
// where skips.txt does not expect it fails its suite, and one that passes where
// skips.txt expects a skip is a stale line. Any of them fails the run.
//
// For each kernel, on the host:
//
//   - Fetch: the newest build of the kernel's packages, found and downloaded by
//     apt with a configuration of its own (the archive's signature and each
//     package's SHA256 checked, the machine's apt state untouched), unpacked
//     with dpkg-deb and indexed with busybox depmod, all in a cache outside the
//     repository that later runs reuse.
//   - An initramfs of a few megabytes: a static build of tools/cmd/kernels as
//     init, a plan (plan in guest.go), and the modules needed to reach the
//     host's tree (virtio PCI, 9p, overlayfs), in load order.
//   - One boot per suite, so a kernel that crashes or hangs in one suite still
//     gets the others run: QEMU with TCG (vm.go says why not KVM) and the
//     host's root shared read-only over 9p, plus a read-write share for the
//     results. A lockup or a hung task panics the guest kernel, which ends the
//     boot at once instead of at the suite's timeout.
//
// In the guest, the same program as pid 1 (Guest) mounts the host's tree with a
// tmpfs overlay on top, gives it its own /proc, /sys, /dev, cgroup2, /tmp and
// /run, changes root into it and runs the suite's test binary, built on the
// host with `go test -c`, against the product binaries of `make build`. The
// kernel loads further modules on demand (veth, bridge) from its own package,
// through busybox's modprobe. Then it powers off.
//
// Back on the host each suite's -test.v output is read test by test: a suite
// passes only when every one of its tests passed or skipped as skips.txt
// expects on that kernel (a skip is not a pass) and the binary exited 0; a suite the kernel died in fails, with the kernel's own
// words (soft lockup, oops) in its note. One summary line per kernel is
// printed; bin/kernels/<kernel>/ keeps each suite's log, console and kernel log,
// and tests.txt, every test's verdict.
package kernels
