// Package bench holds mesh-cni's benchmarks: each measures mesh-cni side by side
// with its baseline in the same run and reports the ratio.
package bench
