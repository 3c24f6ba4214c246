// Package e2e runs mesh-cni end to end: real network namespaces, the reference
// bridge/host-local plugins, the chain executed through libcni as a runtime does,
// and the real mesh-agent process.
package e2e

import (
	"maps"
	"testing"

	"github.com/mesh-cni/mesh-cni/test/harness"
)

func TestMain(m *testing.M) {
	pkgs := harness.ReferencePlugins()
	maps.Copy(pkgs, harness.ProductBinaries())
	harness.Main(m, harness.Options{Packages: pkgs})
}
