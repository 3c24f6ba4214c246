// Package node tests mesh-cni on a real Kubernetes node on this machine, as an
// operator installs it: TestNode starts a one-node cluster (nodeenv: containerd
// with the CRI and runc, kubelet, kube-proxy, the control plane) and runs the
// install and uninstall commands of docs/install.md as written (ops_test.go holds them;
// TestReadmeInstall keeps docs/install.md the same), with kustomize and with Helm,
// checking at each step what an operator would see: pods held at the gate while
// the agent is away, meshed pods talking through their proxies, nothing
// bypassing them through restarts and a rollout, the CNI verbs containerd
// sends, and an uninstall that leaves the node as it was. Its measured times go
// to docs/benchmarks.md (make e2e-node).
//
// TestMain builds what the node runs before the tests start: the node's
// binaries (cached outside the repository by the hack/ scripts), this tree's
// images and the release's (make image, the release from its commit's tree).
//
//	go test ./test/node/                      # as make test runs it
//	go test ./test/node/ -run 'TestNode/(1-|3-|4c-)'   # some steps, with those they need
package node
