package e2e

import (
	"fmt"
	"testing"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/mesh-cni/mesh-cni/internal/cniplugin"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// TestSecurityFigures holds the figures SECURITY.md gives for the plugin and
// the gate to the constants of the product or the tests that prove them.
func TestSecurityFigures(t *testing.T) {
	t.Parallel()
	fixtures.DocSays(t, "SECURITY.md",
		fmt.Sprintf("reads at most %s of stdin into one buffer", fixtures.Bytes(cniplugin.MaxStdin)),
		fmt.Sprintf("a %s stdin is refused with code %d and the plugin stays under %s resident",
			fixtures.Bytes(hugeStdin), types.ErrInvalidNetworkConfig, fixtures.Bytes(refusedStdinRSS)),
		fmt.Sprintf("the plugin as uid %d against a socket opened up to %#o gets code %d naming the uid",
			nobodyUID, openSocketMode, cniplugin.ErrGateRefused),
		fmt.Sprintf("(a %s annotation starts, `TestLargeAnnotation`)", fixtures.Bytes(largeAnnotation)),
	)
}
