package agent

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	"github.com/mesh-cni/mesh-cni/internal/redirect"
)

// Metrics are the agent's Prometheus metrics, on a registry of its own.
type Metrics struct {
	Registry *prometheus.Registry
	// reg is where metrics registered later (trackStartupTaint) go: Registry.
	reg prometheus.Registerer

	gateRequests     *prometheus.CounterVec
	gateWait         prometheus.Histogram
	gateWaiting      prometheus.Gauge
	enrollFailures   *prometheus.CounterVec
	reconcileActions *prometheus.CounterVec
	chainRepairs     prometheus.Counter
	cacheMisses      *prometheus.CounterVec
	// startupTaint is registered only with --startup-taint.
	startupTaint prometheus.Gauge
	// ZDSConnections and ZDSAcks are fed by the proxy handoff server.
	ZDSConnections prometheus.Gauge
	ZDSAcks        *prometheus.CounterVec
}

// CounterReader is a data path that can report its per-CPU decision counters.
type CounterReader interface {
	Counters() (redirect.Counters, error)
}

// NewMetrics registers every metric. enrolled and ready are read at scrape time.
func NewMetrics(enrolled func() int, ready func() bool, counters func() CounterReader) *Metrics {
	reg := prometheus.NewRegistry()
	m := newMetrics(reg, enrolled, ready, counters)
	m.Registry = reg
	return m
}

// newMetrics registers every metric with reg.
func newMetrics(reg prometheus.Registerer, enrolled func() int, ready func() bool, counters func() CounterReader) *Metrics {
	m := &Metrics{
		reg: reg,
		gateRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshcni_gate_requests_total", Help: "Gate calls by verb and gRPC result code.",
		}, []string{"verb", "code"}),
		gateWait: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "meshcni_gate_add_duration_seconds",
			Help:    "How long a pod's Add was held at the gate: waiting for readiness plus enrollment.",
			Buckets: []float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60},
		}),
		gateWaiting: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "meshcni_gate_pods_waiting",
			Help: "Pod Adds held at the gate now, waiting for readiness or enrollment: their pods have not started.",
		}),
		enrollFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshcni_enrollment_failures_total", Help: "Pods not admitted, by reason.",
		}, []string{"reason"}),
		reconcileActions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshcni_reconcile_actions_total", Help: "What reconcile passes did: released (namespace gone), repaired, orphan (removed).",
		}, []string{"action"}),
		chainRepairs: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshcni_chain_entry_repairs_total", Help: "Times the mesh-cni chain entry was put back after it went missing.",
		}),
		cacheMisses: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshcni_enrollment_cache_misses_total", Help: "Decisions that had to ask the API server for an object the enrollment source's cache lacked, by resource (pod, namespace).",
		}, []string{"resource"}),
		ZDSConnections: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "meshcni_zds_connections", Help: "Node proxies connected over ZDS.",
		}),
		ZDSAcks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshcni_zds_acks_total", Help: "ZDS messages acknowledged by node proxies, by result.",
		}, []string{"result"}),
	}
	reg.MustRegister(m.gateRequests, m.gateWait, m.gateWaiting, m.enrollFailures, m.reconcileActions, m.chainRepairs, m.cacheMisses,
		m.ZDSConnections, m.ZDSAcks,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "meshcni_enrolled_pods", Help: "Pod attachments with redirection in place."},
			func() float64 { return float64(enrolled()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "meshcni_ready", Help: "1 when the agent admits pods."},
			func() float64 {
				if ready() {
					return 1
				}
				return 0
			}),
		&datapathCollector{counters: counters},
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	)
	return m
}

// The methods below are safe on a nil *Metrics, so tests and tools can run the
// service without metrics.

func (m *Metrics) enrollFailed(reason string) {
	if m != nil {
		m.enrollFailures.WithLabelValues(reason).Inc()
	}
}

// CacheMiss counts a decision that had to ask the API server.
func (m *Metrics) CacheMiss(resource string) {
	if m != nil {
		m.cacheMisses.WithLabelValues(resource).Inc()
	}
}

func (m *Metrics) reconciled(res ReconcileResult) {
	if m == nil {
		return
	}
	m.reconcileActions.WithLabelValues("released").Add(float64(res.Released))
	m.reconcileActions.WithLabelValues("repaired").Add(float64(res.Repaired))
	m.reconcileActions.WithLabelValues("orphan").Add(float64(res.Orphans))
}

// trackStartupTaint registers meshcni_startup_taint, at 1 until the agent
// has seen its node without the taint.
func (m *Metrics) trackStartupTaint() {
	if m == nil || m.startupTaint != nil {
		return
	}
	m.startupTaint = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "meshcni_startup_taint",
		Help: "1 while the node carries the startup taint (--startup-taint) as the agent last saw it, or it has not yet seen the node without it; 0 once removed or absent.",
	})
	m.startupTaint.Set(1)
	m.reg.MustRegister(m.startupTaint)
}

func (m *Metrics) setStartupTaint(present bool) {
	if m == nil || m.startupTaint == nil {
		return
	}
	v := 0.0
	if present {
		v = 1
	}
	m.startupTaint.Set(v)
}

func (m *Metrics) chainRepaired(n uint64) {
	if m != nil && n > 0 {
		m.chainRepairs.Add(float64(n))
	}
}

// UnaryInterceptor counts gate calls and times Add.
func (m *Metrics) UnaryInterceptor(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if m == nil {
		return handler(ctx, req)
	}
	verb := info.FullMethod
	if i := lastSlash(verb); i >= 0 {
		verb = verb[i+1:]
	}
	if verb == "Add" {
		m.gateWaiting.Inc()
		defer m.gateWaiting.Dec()
	}
	start := time.Now()
	resp, err := handler(ctx, req)
	m.gateRequests.WithLabelValues(verb, status.Code(err).String()).Inc()
	if verb == "Add" {
		m.gateWait.Observe(time.Since(start).Seconds())
	}
	return resp, err
}

func lastSlash(s string) int {
	for i := len(s) - 1; i >= 0; i-- {
		if s[i] == '/' {
			return i
		}
	}
	return -1
}

// datapathCollector exports the BPF per-CPU counters, summed per direction.
type datapathCollector struct {
	counters func() CounterReader
}

var bpfDecisions = prometheus.NewDesc("meshcni_datapath_decisions_total",
	"Redirection decisions of the eBPF data path: outbound connects, inbound new connections and, with DNS capture, DNS queries (direction dns), by decision.",
	[]string{"direction", "decision"}, nil)

var bpfListenersRefused = prometheus.NewDesc("meshcni_datapath_listeners_refused_total",
	"Inbound proxy listeners the eBPF data path could not capture (an MPTCP listener, or every slot of its port taken): their pods' inbound connections fail closed.",
	nil, nil)

var bpfRawRefused = prometheus.NewDesc("meshcni_datapath_raw_sockets_refused_total",
	"Raw IP sockets refused to enrolled pods (--deny-raw-sockets).",
	nil, nil)

var bpfPacketRefused = prometheus.NewDesc("meshcni_datapath_packet_sockets_refused_total",
	"Packet sockets refused to enrolled pods (--deny-packet-sockets).",
	nil, nil)

func (c *datapathCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- bpfDecisions
	ch <- bpfListenersRefused
	ch <- bpfRawRefused
	ch <- bpfPacketRefused
}

func (c *datapathCollector) Collect(ch chan<- prometheus.Metric) {
	r := c.counters()
	if r == nil {
		return
	}
	counts, err := r.Counters()
	if err != nil {
		ch <- prometheus.NewInvalidMetric(bpfDecisions, err)
		return
	}
	for dir, d := range map[string]redirect.DirectionCounters{"outbound": counts.Outbound, "inbound": counts.Inbound, "dns": counts.DNS} {
		ch <- prometheus.MustNewConstMetric(bpfDecisions, prometheus.CounterValue, float64(d.Redirected), dir, "redirected")
		ch <- prometheus.MustNewConstMetric(bpfDecisions, prometheus.CounterValue, float64(d.Passed), dir, "passed")
		ch <- prometheus.MustNewConstMetric(bpfDecisions, prometheus.CounterValue, float64(d.Dropped), dir, "dropped")
	}
	ch <- prometheus.MustNewConstMetric(bpfListenersRefused, prometheus.CounterValue, float64(counts.ListenersRefused))
	ch <- prometheus.MustNewConstMetric(bpfRawRefused, prometheus.CounterValue, float64(counts.RawSocketsRefused))
	ch <- prometheus.MustNewConstMetric(bpfPacketRefused, prometheus.CounterValue, float64(counts.PacketSocketsRefused))
}
