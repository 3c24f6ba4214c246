package bench

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
