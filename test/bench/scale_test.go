package bench

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
	types100 "github.com/containernetworking/cni/pkg/types/100"

	"github.com/mesh-cni/mesh-cni/internal/gaterpc"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
	"github.com/mesh-cni/mesh-cni/test/bench/results"
	"github.com/mesh-cni/mesh-cni/test/capture"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// fillWorkers is how many pods are set up at once while filling the node to the
// next level (that part is not measured).
const fillWorkers = 4

// BenchmarkScale enrolls 1, 10, 100 and 1000 pods (through the real chain) and
// at each level measures, with that many pods enrolled, taking turns: a new
// pod's enroll+release (the gate's Add and Del called by the benchmark over the
// agent's socket: the agent's per-pod work and one round trip each, no plugin
// process), the mesh-cni step of a new pod's ADD (the plugin run by libcni:
// exec, gate call, enrollment), and the iptables way's install+remove
// (iptables-restore and ip6tables-restore of Istio-ambient-style rules in the
// pod, then of their removal); the agent's memory (VmRSS, VmHWM from
// /proc/PID/status); the kernel memory charged to the pinned BPF maps
// (memlock, from the maps' fdinfo); and the agent's restart-to-ready time.
func BenchmarkScale(b *testing.B) {
	requireRoot(b)
	ctx := fixtures.Context(b, 40*time.Minute)
	levels := []int{1, 10, 100, 1000}
	if quickMode() {
		levels = []int{1, 10, 100}
	}
	probes, restarts := size(40, 6), size(5, 1)
	res := newResult(b, "scale", "Scale: enrolling up to 1000 pods", "BenchmarkScale",
		"One node, one `mesh-agent` with the eBPF data path. The node is filled to each level with pods added through the real chain "+
			"[bridge, mesh-cni] (each also gets the iptables capture rules, so the iptables way is at the same scale; no traffic flows). "+
			"At each level, with that many pods enrolled, probe pods measure, taking turns in rotating order: "+
			"**enroll+release**, the agent's per-pod work: the gate's `Add` and then `Del` for a new pod, called by the benchmark over the agent's socket "+
			"(one gRPC round trip each, on a connection kept open; no plugin process); "+
			"the **mesh-cni step** of a new pod's ADD (the plugin run by libcni with the bridge's result as prevResult, as in the chain: exec, gate call, eBPF enrollment); "+
			"and the **iptables way**, install+remove: `iptables-restore` + `ip6tables-restore` of the capture rules in the pod, as Istio ambient's node agent does per pod, "+
			"then the same two commands removing them again. "+
			"A probe's namespace and its bridge ADD are not timed. Then the agent's memory, the BPF maps' memlock and the agent's restart-to-ready "+
			"(SIGTERM, start, until its ready line: load or adopt the pinned data path, reconcile every enrolled pod) are measured.")

	a := newAgent(b, agentOptions{})
	if _, _, err := a.start(ctx); err != nil {
		b.Fatal(err)
	}
	// A /20 (the harness's default /24 holds 253 pods) at a random place in 10/8.
	rnd := make([]byte, 2)
	_, _ = rand.Read(rnd) // never fails (crypto/rand panics rather than return an error)
	wide := netip.PrefixFrom(netip.AddrFrom4([4]byte{10, rnd[0], rnd[1] &^ 0x0f, 0}), 20)
	node := harness.NewNode(b, harness.NodeOptions{
		Plugins:   append(harness.ReferencePluginNames(), "mesh-cni"),
		IPv4Range: wide,
	})
	chain := node.Conflist(b, benchNet, a.meshEntry("mesh-cni"))
	bridgeOnly := node.Conflist(b, benchNet)
	ps := newPods(b, node)
	gc := dialGate(b, a)

	enroll := results.Metric{Name: "enroll-per-pod", Title: "Per-pod setup and teardown time with N pods enrolled", Unit: "ms", XLabel: "pods enrolled", Baseline: "iptables"}
	split := results.Metric{Name: "enroll-release-split", Title: "The gate's Add (enroll) and Del (release) with N pods enrolled", Unit: "ms", XLabel: "pods enrolled"}
	memory := results.Metric{Name: "agent-memory", Title: "Agent memory with N pods enrolled", Unit: "MiB", XLabel: "pods enrolled"}
	maps := results.Metric{Name: "bpf-map-memory", Title: "BPF map memory (memlock) with N pods enrolled", Unit: "MiB", XLabel: "pods enrolled"}
	restart := results.Metric{Name: "restart-ready", Title: "Agent restart-to-ready with N pods enrolled", Unit: "ms", XLabel: "pods enrolled"}

	enrolled := 0
	for _, level := range levels {
		if err := fill(ctx, ps, chain, level-enrolled, enrolled); err != nil {
			b.Fatal(err)
		}
		enrolled = level
		x := float64(level)
		pr, err := probeSetup(ctx, ps, bridgeOnly, chain, a, gc, probes)
		if err != nil {
			b.Fatal(err)
		}
		enroll.Series = append(enroll.Series,
			results.Series{Variant: "enroll-release", Label: "enroll+release (gate Add + Del)", X: x, Samples: pr.enrollRelease, Rounds: pr.enrollRelease},
			results.Series{Variant: "iptables", Label: "iptables way: rules installed + removed", X: x, Samples: pr.iptables, Rounds: pr.iptables},
			results.Series{Variant: "mesh-cni", Label: "mesh-cni step of ADD (exec, gate, enroll)", X: x, Samples: pr.meshStep, Rounds: pr.meshStep})
		split.Series = append(split.Series,
			results.Series{Variant: "enroll", Label: "Add (enroll)", X: x, Samples: pr.enroll},
			results.Series{Variant: "release", Label: "Del (release)", X: x, Samples: pr.release})

		rss, err := procStatusKiB(a.pid(), "VmRSS")
		if err != nil {
			b.Fatal(err)
		}
		hwm, err := procStatusKiB(a.pid(), "VmHWM")
		if err != nil {
			b.Fatal(err)
		}
		total, _, err := a.mapMemlock()
		if err != nil {
			b.Fatal(err)
		}
		maps.Series = append(maps.Series, results.Series{Variant: "memlock", Label: "pinned maps, memlock", X: x, Samples: []float64{float64(total) / (1 << 20)}})

		var times []float64
		for range restarts {
			if err := a.stop(ctx); err != nil {
				b.Fatal(err)
			}
			started, ready, err := a.start(ctx)
			if err != nil {
				b.Fatal(err)
			}
			times = append(times, ms(ready.Sub(started)))
		}
		restart.Series = append(restart.Series, results.Series{Variant: "restart", Label: "SIGTERM, start → ready", X: x, Samples: times})
		after, err := procStatusKiB(a.pid(), "VmRSS")
		if err != nil {
			b.Fatal(err)
		}
		memory.Series = append(memory.Series,
			results.Series{Variant: "rss", Label: "VmRSS, running", X: x, Samples: []float64{rss / 1024}},
			results.Series{Variant: "hwm", Label: "VmHWM (peak), running", X: x, Samples: []float64{hwm / 1024}},
			results.Series{Variant: "rss-restarted", Label: "VmRSS after a restart", X: x, Samples: []float64{after / 1024}})
		b.Logf("%d pods: enroll+release %.2f ms, iptables install+remove %.2f ms, mesh-cni step %.1f ms, agent RSS %.1f MiB, maps %.2f MiB, restart %.0f ms",
			level, results.Median(pr.enrollRelease), results.Median(pr.iptables), results.Median(pr.meshStep), rss/1024, float64(total)/(1<<20), results.Median(times))
	}
	res.Metrics = append(res.Metrics, enroll, split, memory, maps, restart)
	top := float64(levels[len(levels)-1])
	report(b, &enroll, "enroll-release", top, "ms")
	report(b, &enroll, "mesh-cni", top, "ms")
	report(b, &enroll, "iptables", top, "ms")
	report(b, &restart, "restart", top, "ms")
	report(b, &memory, "rss", top, "MiB")
	b.ReportMetric(0, "ns/op")
	finish(b, res)
}

// fill adds n pods through the chain (each also gets the iptables rules),
// fillWorkers at a time.
func fill(ctx context.Context, ps *pods, chain *libcni.NetworkConfigList, n, offset int) error {
	jobs := make(chan int)
	errs := make([]error, fillWorkers)
	var wg sync.WaitGroup
	for w := range fillWorkers {
		wg.Go(func() {
			for i := range jobs {
				if errs[w] != nil {
					continue
				}
				p, err := ps.create("scale", fmt.Sprintf("fill-%d", i))
				if err == nil {
					_, err = ps.add(ctx, p, chain)
				}
				if err == nil {
					_, err = capture.InstallIPTables(ctx, p.NetNS, capture.DefaultRules())
				}
				errs[w] = err
			}
		})
	}
	for i := range n {
		jobs <- offset + i
	}
	close(jobs)
	wg.Wait()
	return errors.Join(errs...)
}

// probeSamples are one level's per-pod samples, in ms; the i-th sample of each
// variant ran in the same round.
type probeSamples struct {
	enrollRelease, enroll, release []float64
	meshStep                       []float64
	iptables                       []float64
}

// probeSetup measures n new pods of each variant, the variants taking turns in
// rotating order; each probe pod is removed afterwards.
func probeSetup(ctx context.Context, ps *pods, bridgeOnly, chain *libcni.NetworkConfigList, a *agent, gc gatepb.GateClient, n int) (probeSamples, error) {
	var pr probeSamples
	kinds := []func(p *pod, prev types.Result) error{
		func(p *pod, prev types.Result) error {
			add, del, err := enrollRelease(ctx, gc, p, prev)
			if err != nil {
				return err
			}
			pr.enroll, pr.release = append(pr.enroll, ms(add)), append(pr.release, ms(del))
			pr.enrollRelease = append(pr.enrollRelease, ms(add+del))
			return nil
		},
		func(p *pod, prev types.Result) error {
			conf, err := meshStep(a, prev)
			if err != nil {
				return err
			}
			took, err := ps.addConf(ctx, p, conf)
			if err != nil {
				return err
			}
			pr.meshStep = append(pr.meshStep, ms(took))
			// DEL through the whole chain: mesh-cni, then bridge.
			p.Attached = []*libcni.NetworkConfigList{chain}
			return nil
		},
		func(p *pod, _ types.Result) error {
			start := time.Now()
			cleanup, err := capture.InstallIPTables(ctx, p.NetNS, capture.DefaultRules())
			if err != nil {
				return err
			}
			if err := cleanup(ctx); err != nil {
				return err
			}
			pr.iptables = append(pr.iptables, ms(time.Since(start)))
			return nil
		},
	}
	for i := range n {
		for k := range kinds {
			j := (i + k) % len(kinds)
			p, err := ps.create("scale", fmt.Sprintf("probe-%d-%d", i, j))
			if err != nil {
				return pr, err
			}
			prev, err := addBridge(ctx, ps, p, bridgeOnly)
			if err != nil {
				return pr, err
			}
			if err := kinds[j](p, prev); err != nil {
				return pr, errors.Join(err, ps.remove(ctx, p))
			}
			if err := ps.remove(ctx, p); err != nil {
				return pr, err
			}
		}
	}
	return pr, nil
}

// dialGate connects to the agent's gate socket as the plugin does, for calls
// the benchmark makes itself; the connection is closed at cleanup.
func dialGate(tb testing.TB, a *agent) gatepb.GateClient {
	tb.Helper()
	conn, err := gaterpc.Dial(a.Socket)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { conn.Close() })
	return gatepb.NewGateClient(conn)
}

// enrollRelease enrolls p through the gate's Add with the interfaces of its
// bridge result, as the plugin would send them, then releases it through Del,
// and returns how long each call took.
func enrollRelease(ctx context.Context, gc gatepb.GateClient, p *pod, prev types.Result) (add, del time.Duration, err error) {
	res, err := types100.NewResultFromResult(prev)
	if err != nil {
		return 0, 0, fmt.Errorf("bridge result: %w", err)
	}
	var ifs []*gatepb.Interface
	for i, iface := range res.Interfaces {
		if iface.Sandbox == "" {
			continue
		}
		gi := &gatepb.Interface{Name: iface.Name, Mac: iface.Mac}
		for _, ip := range res.IPs {
			if ip.Interface != nil && *ip.Interface == i {
				gi.Addresses = append(gi.Addresses, ip.Address.String())
			}
		}
		ifs = append(ifs, gi)
	}
	var ns, name, uid string
	for _, kv := range p.rt.Args {
		switch kv[0] {
		case "K8S_POD_NAMESPACE":
			ns = kv[1]
		case "K8S_POD_NAME":
			name = kv[1]
		case "K8S_POD_UID":
			uid = kv[1]
		}
	}
	att := &gatepb.Attachment{ContainerId: p.rt.ContainerID, Ifname: p.rt.IfName, Network: benchNet}
	pod := &gatepb.PodIdentity{Namespace: ns, Name: name, Uid: uid}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	start := time.Now()
	if _, err := gc.Add(ctx, &gatepb.AddRequest{Pod: pod, Attachment: att, NetnsPath: p.NetNS, Interfaces: ifs, Source: gatepb.Source_SOURCE_CNI}); err != nil {
		return 0, 0, fmt.Errorf("gate Add for pod %s: %w", p.Name, err)
	}
	add = time.Since(start)
	start = time.Now()
	resp, err := gc.Del(ctx, &gatepb.DelRequest{Pod: pod, Attachment: att, NetnsPath: p.NetNS, Source: gatepb.Source_SOURCE_CNI})
	if err != nil {
		return 0, 0, fmt.Errorf("gate Del for pod %s: %w", p.Name, err)
	}
	del = time.Since(start)
	if !resp.GetReleased() {
		return 0, 0, fmt.Errorf("gate Del for pod %s: the agent held nothing to release", p.Name)
	}
	return add, del, nil
}

// addBridge ADDs p through [bridge] and returns the result, for the next
// plugin's prevResult.
func addBridge(ctx context.Context, ps *pods, p *pod, list *libcni.NetworkConfigList) (types.Result, error) {
	if _, err := ps.add(ctx, p, list); err != nil {
		return nil, err
	}
	var res types.Result
	err := ps.node.Do(func() error {
		var err error
		res, err = ps.node.CNI.GetNetworkListCachedResult(list, p.rt)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("cached bridge result: %w", err)
	}
	if res == nil {
		return nil, errors.New("no cached bridge result")
	}
	return res, nil
}

// meshStep is mesh-cni's entry as libcni hands it to the plugin in the chain:
// the network's name and version, and the previous plugin's result.
func meshStep(a *agent, prev types.Result) (*libcni.PluginConfig, error) {
	raw, err := stepConfig(a.meshEntry("mesh-cni"), prev)
	if err != nil {
		return nil, err
	}
	return libcni.NetworkPluginConfFromBytes(raw)
}
