package agent

import (
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mesh-cni/mesh-cni/internal/netns"
	"github.com/mesh-cni/mesh-cni/internal/podstore"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// The tests' pods live in the test's own network namespace: the one a test
// without privileges can open and read the cookie of.
const podNetns = "/proc/self/ns/net"

// fakeDatapath records what the service asks of the data path.
type fakeDatapath struct {
	mu       sync.Mutex
	enrolled map[uint64]podstore.Capture
	released int
	enrollErr,
	checkErr error
}

func (d *fakeDatapath) Enroll(_ context.Context, ns *netns.Handle, c podstore.Capture) (uint64, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.enrollErr != nil {
		return 0, d.enrollErr
	}
	d.enrolled[ns.Cookie] = c
	return ns.Cookie, nil
}

func (d *fakeDatapath) Release(_ context.Context, cookie uint64, _ string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.enrolled, cookie)
	d.released++
	return nil
}

func (d *fakeDatapath) Check(context.Context, uint64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.checkErr
}

func (d *fakeDatapath) Enrolled(context.Context) ([]uint64, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []uint64
	for c := range d.enrolled {
		out = append(out, c)
	}
	return out, nil
}

// fakePolicy decides by namespace and remembers the outcomes reported.
type fakePolicy struct {
	mu       sync.Mutex
	enrolled map[string]bool // by namespace
	capture  podstore.Capture
	err      error
	outcomes map[string]string // pod name -> last outcome
}

func (p *fakePolicy) Decide(_ context.Context, pod *gatepb.PodIdentity) (Decision, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.err != nil {
		return Decision{}, p.err
	}
	return Decision{Enroll: p.enrolled[pod.GetNamespace()], Reason: "test", ServiceAccount: "sa-" + pod.GetName(), Capture: p.capture}, nil
}

func (p *fakePolicy) Report(_ context.Context, pod *gatepb.PodIdentity, outcome string, _ error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.outcomes[pod.GetName()] = outcome
}

func (p *fakePolicy) outcome(name string) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.outcomes[name]
}

func (p *fakePolicy) set(namespace string, enroll bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.enrolled[namespace] = enroll
}

type serviceEnv struct {
	svc    *Service
	dp     *fakeDatapath
	policy *fakePolicy
	ready  *Readiness
	store  *podstore.Store
}

func newServiceEnv(t *testing.T) *serviceEnv {
	t.Helper()
	store, problems, err := podstore.Open(t.TempDir())
	if err != nil || len(problems) > 0 {
		t.Fatal(err, problems)
	}
	e := &serviceEnv{
		dp:     &fakeDatapath{enrolled: map[uint64]podstore.Capture{}},
		policy: &fakePolicy{enrolled: map[string]bool{"shop": true}, outcomes: map[string]string{}},
		ready:  NewReadiness(CondDatapath),
		store:  store,
	}
	e.ready.Set(CondDatapath, true, "")
	e.svc = NewService(zaptest.NewLogger(t), e.ready, e.policy, e.dp, store)
	return e
}

func addRequest(namespace, name, container string) *gatepb.AddRequest {
	return &gatepb.AddRequest{
		Pod:        &gatepb.PodIdentity{Namespace: namespace, Name: name, Uid: "0f1e2d3c-aaaa-bbbb-cccc-12345678" + container[:4]},
		Attachment: &gatepb.Attachment{ContainerId: container, Ifname: "eth0", Network: "meshnet"},
		NetnsPath:  podNetns,
		Interfaces: []*gatepb.Interface{{Name: "eth0", Addresses: []string{"10.1.0.5/24"}}},
		Source:     gatepb.Source_SOURCE_CNI,
	}
}

func codeOf(err error) codes.Code { return status.Code(err) }

// Add enrolls what the policy selects and records it, records what it does not
// as skipped, and reports each outcome; Del releases once and is idempotent.
func TestServiceAddDel(t *testing.T) {
	e := newServiceEnv(t)
	ctx := context.Background()
	resp, err := e.svc.Add(ctx, addRequest("shop", "web", "c0ffee01"))
	if err != nil || resp.GetDecision() != gatepb.Decision_DECISION_ENROLLED || resp.GetNetnsCookie() == 0 {
		t.Fatalf("Add = %v, %v", resp, err)
	}
	rec, ok := e.store.Get(podstore.Key{Network: "meshnet", ContainerID: "c0ffee01", Ifname: "eth0"})
	if !ok || rec.Skipped || rec.ServiceAccount != "sa-web" || rec.NetnsCookie != resp.GetNetnsCookie() || rec.Source != "SOURCE_CNI" {
		t.Errorf("record %+v, %v", rec, ok)
	}
	if got := e.policy.outcome("web"); got != OutcomeEnabled {
		t.Errorf("outcome %q, want %q", got, OutcomeEnabled)
	}

	resp, err = e.svc.Add(ctx, addRequest("plain", "batch", "c0ffee02"))
	if err != nil || resp.GetDecision() != gatepb.Decision_DECISION_SKIPPED {
		t.Fatalf("Add of an unselected pod = %v, %v", resp, err)
	}
	if rec, ok := e.store.Get(podstore.Key{Network: "meshnet", ContainerID: "c0ffee02", Ifname: "eth0"}); !ok || !rec.Skipped {
		t.Errorf("the unselected pod's record %+v, %v; want skipped", rec, ok)
	}
	if got := e.policy.outcome("batch"); got != OutcomeDisabled {
		t.Errorf("outcome %q, want %q", got, OutcomeDisabled)
	}
	if n := len(e.svc.enrolled()); n != 1 {
		t.Errorf("%d enrolled, want 1", n)
	}

	del := &gatepb.DelRequest{Attachment: addRequest("shop", "web", "c0ffee01").GetAttachment(), NetnsPath: podNetns}
	for i, want := range []bool{true, false} {
		r, err := e.svc.Del(ctx, del)
		if err != nil || r.GetReleased() != want {
			t.Errorf("Del #%d = %v, %v; want released %v", i+1, r, err, want)
		}
	}
	if e.dp.released != 1 {
		t.Errorf("the data path released %d times, want 1", e.dp.released)
	}
	// A DEL whose namespace is already gone still releases.
	gone := &gatepb.DelRequest{Attachment: addRequest("plain", "batch", "c0ffee02").GetAttachment()}
	if r, err := e.svc.Del(ctx, gone); err != nil || !r.GetReleased() {
		t.Errorf("Del without a netns = %v, %v", r, err)
	}
}

// What Add refuses: a request that does not validate, a pod while the agent is
// not ready (until the caller's deadline, then Unavailable; admitted once it is
// ready), a policy that cannot answer (Aborted), a data path that fails
// (Internal); none of them leaves a record.
func TestServiceAddRefusals(t *testing.T) {
	e := newServiceEnv(t)
	ctx := context.Background()
	bad := addRequest("shop", "web", "c0ffee01")
	bad.NetnsPath = "relative/path"
	if _, err := e.svc.Add(ctx, bad); codeOf(err) != codes.InvalidArgument {
		t.Errorf("invalid request: %v", err)
	}

	e.ready.Set(CondDatapath, false, "loading")
	short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	_, err := e.svc.Add(short, addRequest("shop", "web", "c0ffee01"))
	cancel()
	if codeOf(err) != codes.Unavailable {
		t.Errorf("not ready: %v, want Unavailable", err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := e.svc.Add(ctx, addRequest("shop", "web", "c0ffee01"))
		done <- err
	}()
	select {
	case err := <-done:
		t.Fatalf("Add returned while the agent was not ready: %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	e.ready.Set(CondDatapath, true, "")
	if err := <-done; err != nil {
		t.Errorf("Add once ready: %v", err)
	}

	e.policy.err = errors.New("api server unreachable")
	if _, err := e.svc.Add(ctx, addRequest("shop", "api", "c0ffee03")); codeOf(err) != codes.Aborted {
		t.Errorf("policy error: %v, want Aborted", err)
	}
	if got := e.policy.outcome("api"); got != OutcomeFailed {
		t.Errorf("outcome %q, want %q", got, OutcomeFailed)
	}
	e.policy.err = nil
	e.dp.enrollErr = errors.New("map full")
	if _, err := e.svc.Add(ctx, addRequest("shop", "db", "c0ffee04")); codeOf(err) != codes.Internal {
		t.Errorf("data path error: %v, want Internal", err)
	}
	for _, c := range []string{"c0ffee03", "c0ffee04"} {
		if _, ok := e.store.Get(podstore.Key{Network: "meshnet", ContainerID: c, Ifname: "eth0"}); ok {
			t.Errorf("a refused Add left a record for %s", c)
		}
	}
}

// Check says enrolled, broken or wrongly enrolled; GC releases what the runtime
// no longer lists on that network, and leaves other networks alone; a policy
// change re-decides known pods.
func TestServiceCheckGCReevaluate(t *testing.T) {
	e := newServiceEnv(t)
	ctx := context.Background()
	for _, c := range []string{"c0ffee01", "c0ffee02"} {
		if _, err := e.svc.Add(ctx, addRequest("shop", "web-"+c, c)); err != nil {
			t.Fatal(err)
		}
	}
	other := addRequest("shop", "side", "c0ffee03")
	other.Attachment.Network = "othernet"
	if _, err := e.svc.Add(ctx, other); err != nil {
		t.Fatal(err)
	}
	check := func(container string) error {
		a := addRequest("shop", "web-"+container, container)
		_, err := e.svc.Check(ctx, &gatepb.CheckRequest{Pod: a.Pod, Attachment: a.Attachment, NetnsPath: a.NetnsPath, Interfaces: a.Interfaces})
		return err
	}
	if err := check("c0ffee01"); err != nil {
		t.Errorf("Check of an enrolled pod: %v", err)
	}
	e.dp.checkErr = errors.New("sk_lookup link detached")
	if err := check("c0ffee01"); codeOf(err) != codes.FailedPrecondition {
		t.Errorf("Check of a broken pod: %v, want FailedPrecondition", err)
	}
	e.dp.checkErr = nil
	if err := check("c0ffee09"); codeOf(err) != codes.FailedPrecondition {
		t.Errorf("Check of a pod with no record: %v, want FailedPrecondition", err)
	}

	resp, err := e.svc.GC(ctx, &gatepb.GCRequest{Network: "meshnet", Valid: []*gatepb.Attachment{{ContainerId: "c0ffee02", Ifname: "eth0"}}})
	if err != nil || len(resp.GetReleased()) != 1 || resp.GetReleased()[0].GetContainerId() != "c0ffee01" {
		t.Fatalf("GC = %v, %v; want c0ffee01 released", resp, err)
	}
	if _, ok := e.store.Get(podstore.Key{Network: "othernet", ContainerID: "c0ffee03", Ifname: "eth0"}); !ok {
		t.Error("GC of one network released an attachment of another")
	}

	e.policy.set("shop", false)
	res, err := e.svc.Reevaluate(ctx)
	if err != nil || res != (ReevaluateResult{Released: 2}) {
		t.Errorf("Reevaluate after unlabelling = %+v, %v; want 2 released", res, err)
	}
	if n := len(e.svc.enrolled()); n != 0 {
		t.Errorf("%d still enrolled", n)
	}
	e.policy.set("shop", true)
	if res, err := e.svc.Reevaluate(ctx); err != nil || res != (ReevaluateResult{Enrolled: 2}) {
		t.Errorf("Reevaluate after labelling = %+v, %v; want 2 enrolled", res, err)
	}
}

// An enrolled pod whose capture the policy now answers differently (its
// annotations, or its probes' ports where its record predates them) gets it
// in place, once: no release, the data path and the record both updated.
func TestReevaluateUpdatesCapture(t *testing.T) {
	e := newServiceEnv(t)
	ctx := context.Background()
	resp, err := e.svc.Add(ctx, addRequest("shop", "web", "c0ffee01"))
	if err != nil {
		t.Fatal(err)
	}
	if res, err := e.svc.Reevaluate(ctx); err != nil || res != (ReevaluateResult{}) {
		t.Fatalf("Reevaluate with nothing changed = %+v, %v", res, err)
	}
	ports := []uint16{8080}
	e.policy.mu.Lock()
	e.policy.capture = podstore.Capture{KubeletPorts: &ports}
	e.policy.mu.Unlock()
	if res, err := e.svc.Reevaluate(ctx); err != nil || res != (ReevaluateResult{Updated: 1}) {
		t.Fatalf("Reevaluate with the probes' ports = %+v, %v; want 1 updated", res, err)
	}
	e.dp.mu.Lock()
	got, released := e.dp.enrolled[resp.GetNetnsCookie()], e.dp.released
	e.dp.mu.Unlock()
	if got.KubeletPorts == nil || !slices.Equal(*got.KubeletPorts, ports) || released != 0 {
		t.Errorf("data path has %+v after %d releases, want the ports and none", got, released)
	}
	rec, _ := e.store.Get(podstore.Key{Network: "meshnet", ContainerID: "c0ffee01", Ifname: "eth0"})
	if !rec.Capture.Equal(e.policy.capture) {
		t.Errorf("record's capture %+v, want %+v", rec.Capture, e.policy.capture)
	}
	if res, err := e.svc.Reevaluate(ctx); err != nil || res != (ReevaluateResult{}) {
		t.Errorf("Reevaluate once applied = %+v, %v; want nothing", res, err)
	}
}

// Reconcile releases records whose namespace is gone (a path that now names
// nothing) and repairs broken ones.
func TestServiceReconcile(t *testing.T) {
	e := newServiceEnv(t)
	ctx := context.Background()
	if _, err := e.svc.Add(ctx, addRequest("shop", "web", "c0ffee01")); err != nil {
		t.Fatal(err)
	}
	gone := podstore.Record{Key: podstore.Key{Network: "meshnet", ContainerID: "deadbeef", Ifname: "eth0"}, Namespace: "shop", Name: "old", NetnsPath: "/nonexistent/netns", NetnsCookie: 7, Source: "SOURCE_CNI"}
	if err := e.store.Put(gone); err != nil {
		t.Fatal(err)
	}
	res, err := e.svc.Reconcile(ctx)
	if err != nil || res.Released != 1 || res.Kept != 1 || res.Repaired != 0 {
		t.Errorf("Reconcile = %+v, %v; want 1 released, 1 kept", res, err)
	}
	e.dp.checkErr = errors.New("broken")
	res, err = e.svc.Reconcile(ctx)
	if err != nil || res.Repaired != 1 {
		t.Errorf("Reconcile of a broken pod = %+v, %v; want 1 repaired", res, err)
	}
}

type fakeSyncer struct {
	synced atomic.Bool
	asked  atomic.Int32 // how often Synced was called
}

func (s *fakeSyncer) Synced() (bool, string) {
	s.asked.Add(1)
	return s.synced.Load(), "test"
}

// neverChanged is a policy watcher whose policy never changes.
type neverChanged struct{}

func (neverChanged) Changed() <-chan struct{} { return nil }

// The agent re-decides every pod once its source is synced, with no change
// announced: what changed while it was away (here a capture an earlier
// record lacks) is applied at start. Not before the source is synced: a
// decision from an empty cache would be a guess.
func TestFollowPolicyDecidesOnceSynced(t *testing.T) {
	e := newServiceEnv(t)
	ctx, cancel := context.WithCancel(context.Background())
	if _, err := e.svc.Add(ctx, addRequest("shop", "web", "c0ffee01")); err != nil {
		t.Fatal(err)
	}
	ports := []uint16{8080}
	e.policy.mu.Lock()
	e.policy.capture = podstore.Capture{KubeletPorts: &ports}
	e.policy.mu.Unlock()
	key := podstore.Key{Network: "meshnet", ContainerID: "c0ffee01", Ifname: "eth0"}
	updated := func() bool {
		rec, _ := e.store.Get(key)
		return rec.Capture.KubeletPorts != nil
	}
	syncer := &fakeSyncer{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		followPolicy(ctx, zaptest.NewLogger(t), neverChanged{}, syncer, e.svc)
	}()
	defer func() { cancel(); <-done }()

	// Told three times that the source is not synced: nothing re-decided.
	fixtures.WaitFor(t, 10*time.Second, "three answers of not synced", func() bool { return syncer.asked.Load() >= 3 })
	if updated() {
		t.Fatal("re-decided before the source was synced")
	}
	syncer.synced.Store(true)
	fixtures.WaitFor(t, 10*time.Second, "the record's capture updated once the source was synced", updated)
}
