// Package harness is the end-to-end test harness for mesh-cni: it builds the binaries
// under test, makes "nodes" and "pods" out of real network namespaces, drives CNI
// through libcni exactly as a container runtime does, and runs and watches processes.
//
// A test package wires it up once in TestMain:
//
//	func TestMain(m *testing.M) {
//		harness.Main(m, harness.Options{Packages: harness.ReferencePlugins()})
//	}
//
// Main builds the requested binaries once per test binary (or takes them from
// $MESH_CNI_BIN_DIR when CI has built them already), runs the tests, and fails the run
// if any network namespace made by this process is left behind. Tests then use
//
//	node := harness.NewNode(t, harness.NodeOptions{})
//	list := node.Conflist(t, "testnet")
//	pod := node.NewPod(t, "default", "client")
//	result, err := node.Add(ctx, pod, list)
//
// (NodeOptions.Primary and Families pick the primary network: bridge, ptp, ipvlan
// L2/L3 or macvlan, over IPv4, IPv6 or both) and drive it with node.Del, Check, GC
// and Status, reach pods with pod.Listen, pod.Dial, pod.Exec and pod.Start (and
// pod.ServeEcho, pod.EchoRoundTrip and pod.StartRefproxy for traffic through a
// sidecar), run daemons with StartProcess (WaitForLine for a readiness line,
// WaitForHealthy for a gRPC health service on a Unix socket), and give an agent
// its directories and flags with NewAgentDirs.
//
// Everything a test makes (namespaces, attachments, processes, listeners) is removed in
// t.Cleanup, also when the test fails.
package harness
