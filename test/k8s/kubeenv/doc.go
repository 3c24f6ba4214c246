// Package kubeenv runs a real Kubernetes control plane for tests: etcd and
// kube-apiserver (built by hack/build-kube.sh) on loopback, with static users,
// their client configurations and the PKI they need, cleaned up with the test.
package kubeenv
