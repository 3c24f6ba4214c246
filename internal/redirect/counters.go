package redirect

import (
	"fmt"

	"github.com/cilium/ebpf"
)

// Indexes into the counters map: enum counter in bpf/lib/common.h.
const (
	counterOutRedirected uint32 = iota
	counterOutPassed
	counterOutDropped
	counterInRedirected
	counterInPassed
	counterInDropped
	counterListenerRefused
	counterDNSRedirected
	counterDNSPassed
	counterDNSDropped
	counterMax
)

// Indexes into the socket_refusals map: enum socket_refusal in bpf/lib/common.h.
const (
	refusedRaw uint32 = iota
	refusedPacket
	refusedMax
)

// DirectionCounters count redirection decisions in one direction.
type DirectionCounters struct {
	// Redirected: sent to the proxy.
	Redirected uint64 `json:"redirected"`
	// Passed: left alone by policy (proxy mark or uid, excluded port or CIDR,
	// probe source, loopback destination) or by fail-open with no proxy listening.
	Passed uint64 `json:"passed"`
	// Dropped: no proxy listening and fail-open off. Outbound connects are still
	// rewritten and get ECONNREFUSED; inbound connections are reset.
	Dropped uint64 `json:"dropped"`
}

// Counters are the data path's decisions summed over all CPUs and all enrolled
// pods since the maps were created (they survive agent restarts). Outbound counts
// TCP connect() calls from enrolled netns; inbound counts the kernel's listener
// lookups for new connections in enrolled netns (one per SYN, and one per stray
// packet that matches no connection). Packets of existing connections are not
// counted.
type Counters struct {
	Outbound DirectionCounters `json:"outbound"`
	Inbound  DirectionCounters `json:"inbound"`
	// ListenersRefused counts inbound proxy listeners that could not be
	// collected (see Refusal).
	ListenersRefused uint64 `json:"listenersRefused"`
	// DNS counts DNS queries (UDP datagrams, UDP and TCP connects to port 53)
	// of pods with DNS capture: sent to the proxy's DNS listener, passed to
	// the resolver because nothing listened there, or sent to the closed port
	// of a DNS fail-closed pod.
	DNS DirectionCounters `json:"dns"`
	// RawSocketsRefused counts raw IP sockets refused to pods with
	// DenyRawSockets.
	RawSocketsRefused uint64 `json:"rawSocketsRefused"`
	// PacketSocketsRefused counts packet sockets refused to pods with
	// DenyPacketSockets.
	PacketSocketsRefused uint64 `json:"packetSocketsRefused"`
}

// Counters reads the per-CPU counters.
func (d *Datapath) Counters() (Counters, error) {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		return Counters{}, ErrClosed
	}
	return sumCounters(d.objs.Counters, d.objs.SocketRefusals)
}

// sumCounters adds up the per-CPU counters and socket_refusals maps (refusals
// nil: none pinned, all 0).
func sumCounters(counters, refusals *ebpf.Map) (Counters, error) {
	sums, err := sumPerCPU(counters, counterMax)
	if err != nil {
		return Counters{}, err
	}
	refused := make([]uint64, refusedMax)
	if refusals != nil {
		if refused, err = sumPerCPU(refusals, refusedMax); err != nil {
			return Counters{}, err
		}
	}
	return Counters{
		Outbound: DirectionCounters{
			Redirected: sums[counterOutRedirected],
			Passed:     sums[counterOutPassed],
			Dropped:    sums[counterOutDropped],
		},
		Inbound: DirectionCounters{
			Redirected: sums[counterInRedirected],
			Passed:     sums[counterInPassed],
			Dropped:    sums[counterInDropped],
		},
		ListenersRefused: sums[counterListenerRefused],
		DNS: DirectionCounters{
			Redirected: sums[counterDNSRedirected],
			Passed:     sums[counterDNSPassed],
			Dropped:    sums[counterDNSDropped],
		},
		RawSocketsRefused:    refused[refusedRaw],
		PacketSocketsRefused: refused[refusedPacket],
	}, nil
}

// sumPerCPU sums each of the first n entries of a per-CPU array over the CPUs.
func sumPerCPU(m *ebpf.Map, n uint32) ([]uint64, error) {
	sums := make([]uint64, n)
	for i := range n {
		var perCPU []uint64
		if err := m.Lookup(i, &perCPU); err != nil {
			return nil, fmt.Errorf("read %s entry %d: %w", m, i, err)
		}
		for _, v := range perCPU {
			sums[i] += v
		}
	}
	return sums, nil
}
