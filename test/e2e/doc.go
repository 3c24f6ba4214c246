// Package e2e runs mesh-cni end to end: real network namespaces, the reference
// bridge/host-local plugins, the chain executed through libcni as a runtime does,
// and the real mesh-agent process.
package e2e
