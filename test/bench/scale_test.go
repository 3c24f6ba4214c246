package bench

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"

	"github.com/mesh-cni/mesh-cni/test/bench/results"
	"github.com/mesh-cni/mesh-cni/test/capture"
	"github.com/mesh-cni/mesh-cni/test/harness"
)

// fillWorkers is how many pods are set up at once while filling the node to the
// next level (that part is not measured).
const fillWorkers = 4

// BenchmarkScale enrolls 1, 10, 100 and 1000 pods (through the real chain) and
// at each level measures, with that many pods enrolled: the per-pod enroll time
// (the mesh-cni step of a new pod's ADD) and the per-pod setup time of the
// iptables way (iptables-restore and ip6tables-restore of Istio-ambient-style
// rules in the pod), taking turns; the agent's memory (VmRSS, VmHWM from
// /proc/PID/status); the kernel memory charged to the pinned BPF maps
// (memlock, from the maps' fdinfo); and the agent's restart-to-ready time.
func BenchmarkScale(b *testing.B) {
	requireRoot(b)
	ctx := benchContext(b, 40*time.Minute)
	levels := []int{1, 10, 100, 1000}
	if quickMode() {
		levels = []int{1, 10, 100}
	}
	probes, restarts := size(40, 6), size(5, 1)
	res := newResult("scale", "Scale: enrolling up to 1000 pods", "BenchmarkScale",
		"One node, one `mesh-agent` with the eBPF data path. The node is filled to each level with pods added through the real chain "+
			"[bridge, mesh-cni] (each also gets the iptables capture rules, so the iptables way is at the same scale; no traffic flows). "+
			"At each level, with that many pods enrolled, probe pods measure (taking turns) the **mesh-cni step** of a new pod's ADD "+
			"(the plugin run by libcni with the bridge's result as prevResult, as in the chain: exec, gate call, eBPF enrollment) "+
			"and the **iptables way** (`iptables-restore` + `ip6tables-restore` of the capture rules in the pod, as Istio ambient's node agent does per pod); "+
			"a probe's namespace and its bridge ADD are not timed. Then the agent's memory, the BPF maps' memlock and the agent's restart-to-ready "+
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

	enroll := results.Metric{Name: "enroll-per-pod", Title: "Per-pod setup time with N pods enrolled", Unit: "ms", XLabel: "pods enrolled", Baseline: "iptables"}
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
		mesh, ipt, err := probeSetup(ctx, ps, bridgeOnly, chain, a, probes)
		if err != nil {
			b.Fatal(err)
		}
		enroll.Series = append(enroll.Series,
			results.Series{Variant: "mesh-cni", Label: "mesh-cni step of ADD (eBPF enroll)", X: x, Samples: mesh},
			results.Series{Variant: "iptables", Label: "iptables + ip6tables rules in the pod", X: x, Samples: ipt})

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
		b.Logf("%d pods: mesh-cni step %.1f ms, iptables %.1f ms, agent RSS %.1f MiB, maps %.2f MiB, restart %.0f ms",
			level, results.Median(mesh), results.Median(ipt), rss/1024, float64(total)/(1<<20), results.Median(times))
	}
	res.Metrics = append(res.Metrics, enroll, memory, maps, restart)
	top := float64(levels[len(levels)-1])
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

// probeSetup measures n new pods' mesh-cni step and n new pods' iptables setup,
// alternately; each probe pod is removed afterwards.
func probeSetup(ctx context.Context, ps *pods, bridgeOnly, chain *libcni.NetworkConfigList, a *agent, n int) (mesh, ipt []float64, err error) {
	for i := range 2 * n {
		p, err := ps.create("scale", fmt.Sprintf("probe-%d", i))
		if err != nil {
			return nil, nil, err
		}
		prev, err := addBridge(ctx, ps, p, bridgeOnly)
		if err != nil {
			return nil, nil, err
		}
		if i%2 == 0 {
			conf, err := meshStep(a, prev)
			if err != nil {
				return nil, nil, err
			}
			took, err := ps.addConf(ctx, p, conf)
			if err != nil {
				return nil, nil, err
			}
			mesh = append(mesh, ms(took))
			// DEL through the whole chain: mesh-cni, then bridge.
			p.Attached = []*libcni.NetworkConfigList{chain}
		} else {
			start := time.Now()
			if _, err := capture.InstallIPTables(ctx, p.NetNS, capture.DefaultRules()); err != nil {
				return nil, nil, err
			}
			ipt = append(ipt, ms(time.Since(start)))
		}
		if err := ps.remove(ctx, p); err != nil {
			return nil, nil, err
		}
	}
	return mesh, ipt, nil
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
	conf := a.meshEntry("mesh-cni")
	conf["cniVersion"] = harness.CNIVersion
	conf["name"] = benchNet
	conf["prevResult"] = prev
	raw, err := json.Marshal(conf)
	if err != nil {
		return nil, fmt.Errorf("encode mesh-cni config: %w", err)
	}
	return libcni.NetworkPluginConfFromBytes(raw)
}
