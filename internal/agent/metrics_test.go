package agent

import (
	"context"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"google.golang.org/grpc"

	"github.com/mesh-cni/mesh-cni/internal/redirect"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

func gaugeValue(t *testing.T, m *Metrics) float64 {
	t.Helper()
	var out dto.Metric
	if err := m.gateWaiting.Write(&out); err != nil {
		t.Fatal(err)
	}
	return out.GetGauge().GetValue()
}

// An Add held at the gate counts as waiting until it returns, whatever its
// result; other verbs never do. The alert on pods waiting reads this gauge.
func TestGatePodsWaiting(t *testing.T) {
	m := NewMetrics(func() int { return 0 }, func() bool { return false }, func() CounterReader { return nil })
	release := make(chan struct{})
	held := make(chan struct{})
	done := make(chan error, 1)
	add := &grpc.UnaryServerInfo{FullMethod: gatepb.Gate_Add_FullMethodName}
	go func() {
		_, err := m.UnaryInterceptor(context.Background(), nil, add, func(context.Context, any) (any, error) {
			close(held)
			<-release
			return nil, context.DeadlineExceeded
		})
		done <- err
	}()
	<-held
	if got := gaugeValue(t, m); got != 1 {
		t.Errorf("meshcni_gate_pods_waiting = %v while an Add is held, want 1", got)
	}
	del := &grpc.UnaryServerInfo{FullMethod: gatepb.Gate_Del_FullMethodName}
	if _, err := m.UnaryInterceptor(context.Background(), nil, del, func(context.Context, any) (any, error) {
		if got := gaugeValue(t, m); got != 1 {
			t.Errorf("meshcni_gate_pods_waiting = %v during a Del, want still 1", got)
		}
		return nil, nil
	}); err != nil {
		t.Fatal(err)
	}
	close(release)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the held Add never returned")
	}
	if got := gaugeValue(t, m); got != 0 {
		t.Errorf("meshcni_gate_pods_waiting = %v after the Add failed, want 0", got)
	}
}

// spliceReporter is a data path with counters and a splice.
type spliceReporter struct{ st redirect.SpliceStatus }

func (spliceReporter) Counters() (redirect.Counters, error)     { return redirect.Counters{}, nil }
func (r spliceReporter) Splice() (redirect.SpliceStatus, error) { return r.st, nil }

// A data path that splices exports its switch and its connections by state,
// which is how an operator sees connections falling back to TCP.
func TestSpliceMetrics(t *testing.T) {
	dp := spliceReporter{redirect.SpliceStatus{Enabled: true, Spliced: 5, Behind: 3, TCP: 2, Pending: 1}}
	m := NewMetrics(func() int { return 0 }, func() bool { return true }, func() CounterReader { return dp })
	families, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, f := range families {
		for _, mt := range f.GetMetric() {
			name := f.GetName()
			for _, l := range mt.GetLabel() {
				name += "/" + l.GetValue()
			}
			got[name] = mt.GetGauge().GetValue()
		}
	}
	want := map[string]float64{
		"meshcni_datapath_splice_enabled":             1,
		"meshcni_datapath_splice_connections/spliced": 5,
		"meshcni_datapath_splice_connections/behind":  3,
		"meshcni_datapath_splice_connections/tcp":     2,
		"meshcni_datapath_splice_connections/pending": 1,
	}
	for name, v := range want {
		if g, ok := got[name]; !ok || g != v {
			t.Errorf("%s = %v (exported: %v), want %v", name, g, ok, v)
		}
	}
}
