package e2e

import (
	"testing"

	"github.com/mesh-cni/mesh-cni/test/harness"
)

func TestMain(m *testing.M) {
	harness.Main(m, harness.Options{Packages: harness.AllBinaries()})
}
