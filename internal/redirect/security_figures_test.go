package redirect

import (
	"fmt"
	"strconv"
	"strings"
	"testing"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// TestSecurityFigures holds every figure SECURITY.md gives for the data path
// to the constant of the product or of the test that proves it, and the
// flood tests' sizes to the maps they must overflow, as this build makes
// them.
func TestSecurityFigures(t *testing.T) {
	t.Parallel()
	spec, err := loadRedirect()
	if err != nil {
		t.Fatal(err)
	}
	largest := 0
	for _, m := range spec.Maps {
		largest = max(largest, int(m.MaxEntries))
	}
	if floodSYNs <= largest {
		t.Errorf("the SYN flood sends %d, no more than the %d entries of the largest map", floodSYNs, largest)
	}
	handover := int(spec.Maps["orig_dsts"].MaxEntries)
	if floodConnects <= handover {
		t.Errorf("the flood connects %d times, no more than the %d entries of the hand-over map", floodConnects, handover)
	}
	listeners := int(spec.Maps["listeners"].MaxEntries)
	if floodNamespaces*floodListeners <= listeners {
		t.Errorf("the listener flood makes %d listeners, no more than the listeners map's %d entries", floodNamespaces*floodListeners, listeners)
	}
	if floodListeners != listenerSlots {
		t.Errorf("the listener flood makes %d listeners per namespace, and a pod has %d slots", floodListeners, listenerSlots)
	}
	var ports []string
	for _, p := range capturedProxyPorts() {
		ports = append(ports, strconv.Itoa(int(p)))
	}
	fixtures.DocSays(t, "SECURITY.md",
		fmt.Sprintf("sets ztunnel's mark `%#x` is still redirected", ZtunnelMark),
		fmt.Sprintf("directly (%d, ztunnel's HBONE) is excluded", HBONEPort),
		fmt.Sprintf("listening on %s or %s is captured", strings.Join(ports[:len(ports)-1], ", "), ports[len(ports)-1]),
		fmt.Sprintf("at most %d per family and pod: %s network namespaces", listenerSlots, fixtures.Thousands(floodNamespaces)),
		fmt.Sprintf("with %s listeners on the inbound port take no entry", fixtures.Thousands(floodNamespaces*floodListeners)),
		fmt.Sprintf("%s connects reset against a proxy that defers accepting", fixtures.Thousands(handoffConnects)),
		fmt.Sprintf("at least %s raw SYNs (more than the %s entries of the data path's largest map)", fixtures.Thousands(floodSYNs), fixtures.Thousands(largest)),
		fmt.Sprintf("and %s outbound connects (more than the %s hand-over entries their connections pass through)", fixtures.Thousands(floodConnects), fixtures.Thousands(handover)),
		fmt.Sprintf("(`%#x` under `%#x`, with `CAP_NET_RAW`)", ReplyMark, ReplyMarkMask),
	)
}
