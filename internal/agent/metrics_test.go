package agent

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/grpc"

	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
)

// gaugeValue is what gauge g of Metrics reads now.
func gaugeValue(t *testing.T, g prometheus.Metric) float64 {
	t.Helper()
	var out dto.Metric
	if err := g.Write(&out); err != nil {
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
	if got := gaugeValue(t, m.gateWaiting); got != 1 {
		t.Errorf("meshcni_gate_pods_waiting = %v while an Add is held, want 1", got)
	}
	del := &grpc.UnaryServerInfo{FullMethod: gatepb.Gate_Del_FullMethodName}
	if _, err := m.UnaryInterceptor(context.Background(), nil, del, func(context.Context, any) (any, error) {
		if got := gaugeValue(t, m.gateWaiting); got != 1 {
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
	if got := gaugeValue(t, m.gateWaiting); got != 0 {
		t.Errorf("meshcni_gate_pods_waiting = %v after the Add failed, want 0", got)
	}
}
