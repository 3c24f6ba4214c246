// Package demo is `make demo`: a simulated node with real network namespaces,
// the real CNI chain and the real agent, narrated in plain words. It also runs
// in `make test`, so the demo keeps working.
package demo
