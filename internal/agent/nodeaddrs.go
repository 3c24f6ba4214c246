package agent

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/vishvananda/netlink"
	"go.uber.org/zap"
)

// nodeAddressDebounce collects the burst of address events an interface change
// makes into one update.
const nodeAddressDebounce = 100 * time.Millisecond

// StartNodeAddressWatch calls set with the node's own addresses (every address in
// the agent's network namespace but loopback ones), once before it returns and again
// whenever they change, until ctx ends or stop is called. They are the sources of
// kubelet's probes, which must reach the application without going through the
// inbound proxy.
func StartNodeAddressWatch(ctx context.Context, log *zap.Logger, set func([]netip.Prefix) error) (stop func(), _ error) {
	ctx, cancel := context.WithCancel(ctx)
	updates := make(chan netlink.AddrUpdate, 64)
	if err := netlink.AddrSubscribeWithOptions(updates, ctx.Done(), netlink.AddrSubscribeOptions{
		ErrorCallback: func(err error) { log.Warn("node address watch", zap.Error(err)) },
	}); err != nil {
		cancel()
		return nil, fmt.Errorf("watch node addresses: %w", err)
	}
	last, err := applyNodeAddresses(set, nil)
	if err != nil {
		cancel()
		return nil, err
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-ctx.Done():
				return
			case _, ok := <-updates:
				if !ok {
					return
				}
			}
			// Let the rest of the burst arrive, then read the whole list again.
			timer := time.NewTimer(nodeAddressDebounce)
		drain:
			for {
				select {
				case <-ctx.Done():
					timer.Stop()
					return
				case <-updates:
				case <-timer.C:
					break drain
				}
			}
			if last, err = applyNodeAddresses(set, last); err != nil {
				log.Warn("update node addresses", zap.Error(err))
			}
		}
	}()
	return func() { cancel(); <-done }, nil
}

// applyNodeAddresses lists the addresses and calls set when they differ from last.
func applyNodeAddresses(set func([]netip.Prefix) error, last []netip.Prefix) ([]netip.Prefix, error) {
	addrs, err := netlink.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return last, fmt.Errorf("list node addresses: %w", err)
	}
	var out []netip.Prefix
	for _, a := range addrs {
		ip, ok := netip.AddrFromSlice(a.IP)
		if !ok || ip.IsLoopback() {
			continue
		}
		ip = ip.Unmap()
		out = append(out, netip.PrefixFrom(ip, ip.BitLen()))
	}
	slices.SortFunc(out, func(a, b netip.Prefix) int { return a.Addr().Compare(b.Addr()) })
	out = slices.Compact(out)
	if last != nil && slices.Equal(out, last) {
		return last, nil
	}
	if err := set(out); err != nil {
		return last, err
	}
	return out, nil
}
