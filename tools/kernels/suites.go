package kernels

import "time"

// Suite is a group of the repository's own tests run in the guest. A suite
// passes on a kernel only when each of its tests passes there, or skips where
// skips.txt expects it to (a helper process run by another test, a test of an
// upgrade from a layout that never loaded on that kernel).
type Suite struct {
	Name string
	// Package is the Go package, relative to the module root.
	Package string
	// Tests are the top-level tests to run; none means all of the package's
	// but Exclude.
	Tests []string
	// Exclude are tests left out of the suite, each with the reason; only
	// for a test that cannot pass under emulation on any kernel.
	Exclude map[string]string
	// Timeout bounds the suite in the guest (the test binary's -test.timeout):
	// about three times what the slowest kernel took under TCG emulation
	// (datapath 135 s, gate 25 s, traffic 100 s), which
	// runs several times slower than the host.
	Timeout time.Duration
	// Claim is what a pass proves, for docs/compatibility.md.
	Claim string
}

// Suites are the columns of the matrix, in its order. The end-to-end tests are
// split by what they need from the kernel: the gate holds and admits pods
// without any eBPF (the agent runs with --datapath=none, or not at all), the
// traffic tests need the whole data path.
var Suites = []Suite{
	{
		Name:    "datapath",
		Package: "./internal/redirect",
		Exclude: map[string]string{
			// Measured: 94,000 SYNs in its time budget under TCG on 6.1,
			// 6.12 and 7.2 alike, below what the test needs.
			"TestFloodDoesNotDisturbOtherPods": "a load test: it must send more SYNs within its time budget than an emulated CPU can",
		},
		Timeout: 7 * time.Minute,
		Claim:   "the tests of `internal/redirect`: the eBPF programs load and attach, pods enroll and release, outbound and inbound TCP reach the proxy ports with the original destination, over IPv4 and IPv6",
	},
	{
		Name:    "gate",
		Package: "./test/e2e",
		Tests:   []string{"TestAddWaitsForAgent", "TestExcludedNamespacePassesThrough"},
		Timeout: 3 * time.Minute,
		Claim:   "the chain through libcni with the real agent: a pod's ADD held at the gate until the agent is ready, a pod of an excluded namespace passing with no agent",
	},
	{
		Name:    "traffic",
		Package: "./test/e2e",
		Tests:   []string{"TestRedirectThroughChain", "TestFailClosedAndRelease", "TestAgentRestartKeepsDataPath"},
		Timeout: 6 * time.Minute,
		Claim:   "pods enrolled through the chain: their traffic through the reference proxies both ways over IPv4 and IPv6, fail-closed without a proxy, release on DEL, an agent killed and restarted without a connection failing",
	},
}
