package proxy

import (
	"net/netip"
	"testing"
)

// An application's connection may come from the local address of one of the
// proxy's onward connections (the kernel chose the port against the capture's
// destination): that alone is served, as only a connection from an onward
// connection that was itself a captured onward connection is a loop.
func TestOnwardDepth(t *testing.T) {
	p := &Proxy{onward: map[netip.AddrPort]int{}}
	app := netip.MustParseAddrPort("10.0.0.1:40000")
	if d := p.onwardDepth(app); d != 0 {
		t.Fatalf("depth %d of an address no onward connection has", d)
	}
	p.addOnward(app, 0)
	if d := p.onwardDepth(app); d != 1 || d >= loopDepth {
		t.Fatalf("depth %d of a first onward address, loopDepth %d", d, loopDepth)
	}
	again := netip.MustParseAddrPort("10.0.0.1:40002")
	p.addOnward(again, 1)
	if d := p.onwardDepth(again); d < loopDepth {
		t.Fatalf("depth %d of an onward connection of a captured onward connection, loopDepth %d", d, loopDepth)
	}
	p.removeOnward(app)
	if d := p.onwardDepth(app); d != 0 {
		t.Fatalf("depth %d after the onward connection closed", d)
	}
}
