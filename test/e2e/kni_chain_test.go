package e2e

import (
	"context"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/internal/kni/knipb"
	"github.com/mesh-cni/mesh-cni/pkg/gate/gatepb"
	"github.com/mesh-cni/mesh-cni/test/fixtures"
	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/kniruntime"
)

// TestKNIUnderLibkni: the interposer in front of a libkni-shaped runtime that
// runs the node's own CNI configuration (the first file of the node's CNI
// directory at each call), as the KNI install is meant to run:
//
//   - a node the agent served in CNI mode keeps its chain entry after a
//     plain stop (by design), so the runtime would run mesh-cni too;
//   - the agent with the interposer and the chain entry installer both on
//     refuses to start, saying why;
//   - with --cni-install=false but the old entry still there, each pod is
//     gated twice (a CNI and a KNI record of one network namespace): what the
//     install's `mesh-agent uninstall --datapath=none` step removes;
//   - after it, the runtime runs the primary's own conflist, the pod is
//     gated once, through the interposer, and its detach releases it.
func TestKNIUnderLibkni(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	node := installNode(t)
	node.WriteConf(t, primaryFile, primaryConflist(t, node, 0))
	rt := kniruntime.StartFromConfDir(t, node)

	// The agent in CNI mode installs its owned conflist, which sorts first.
	a := newInstallAgent(t, node, "--owned-config=true")
	cniArgs := slices.Clone(a.Args)
	a.launchReady(ctx)
	fixtures.WaitFor(t, 30*time.Second, "the owned chain entry", func() bool {
		_, f, err := node.LoadConflist()
		return err == nil && filepath.Base(f) == ownedFile
	})
	a.stop(ctx)
	if _, f, err := node.LoadConflist(); err != nil || filepath.Base(f) != ownedFile {
		t.Fatalf("after a plain stop the runtime picks %s (%v), want the entry kept in %s", f, err, ownedFile)
	}

	kniSocket := a.agentPath("kni", "kni.sock")
	kniArgs := []string{"--kni-socket", kniSocket, "--kni-upstream", rt.Socket, "--kni-enroll-timeout", "20s"}

	// Interposer and installer together: refused.
	a.Args = append(slices.Clone(cniArgs), kniArgs...)
	a.launch()
	waitCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	err := a.Proc.Wait(waitCtx)
	cancel()
	if err == nil || !strings.Contains(a.Proc.Output(), "pass the gate twice") {
		t.Fatalf("the agent with --kni-socket and --cni-install exited with %v, want a refusal saying why:\n%s", err, a.Proc.Output())
	}

	kubelet := knipb.NewKNIClient(dialUnixGRPC(t, kniSocket))
	attach := func(p *harness.Pod) []*gatepb.Enrollment {
		t.Helper()
		callCtx, cancel := context.WithTimeout(ctx, 60*time.Second)
		defer cancel()
		if _, err := kubelet.AttachInterface(callCtx, kniRequest(p)); err != nil {
			t.Fatalf("attach %s: %v", p.Name, err)
		}
		var recs []*gatepb.Enrollment
		for _, e := range a.list(ctx).GetEnrollments() {
			if e.GetAttachment().GetContainerId() == p.ContainerID {
				recs = append(recs, e)
			}
		}
		if _, err := kubelet.DetachInterface(callCtx, kniDetachRequest(p)); err != nil {
			t.Fatalf("detach %s: %v", p.Name, err)
		}
		if n := len(a.list(ctx).GetEnrollments()); n != 0 {
			t.Fatalf("after the detach of %s the agent still lists %d records", p.Name, n)
		}
		return recs
	}
	sources := func(recs []*gatepb.Enrollment) []string {
		var out []string
		for _, e := range recs {
			out = append(out, e.GetSource().String()+"/"+e.GetAttachment().GetNetwork())
		}
		slices.Sort(out)
		return out
	}

	// The interposer alone, the old entry still in place: two passes.
	a.Args = append(slices.Clone(cniArgs), append(kniArgs, "--cni-install=false")...)
	a.launchReady(ctx)
	if got := sources(attach(node.NewPod(t, "shop", "stale-entry"))); !slices.Equal(got, []string{"SOURCE_CNI/meshnet", "SOURCE_KNI/kni"}) {
		t.Fatalf("with the old chain entry in place the pod was recorded as %v, want a CNI and a KNI record", got)
	}
	a.stop(ctx)

	// The install's step before a KNI agent starts: the entry goes.
	a.Args = append(slices.Clone(cniArgs), "--datapath=none")
	a.uninstall(ctx)
	if _, f, err := node.LoadConflist(); err != nil || filepath.Base(f) != primaryFile {
		t.Fatalf("after the uninstall step the runtime picks %s (%v), want the primary's %s", f, err, primaryFile)
	}

	a.Args = append(slices.Clone(cniArgs), append(kniArgs, "--cni-install=false")...)
	a.launchReady(ctx)
	p := node.NewPod(t, "shop", "kni-only")
	if got := sources(attach(p)); !slices.Equal(got, []string{"SOURCE_KNI/kni"}) {
		t.Fatalf("the pod was recorded as %v, want one KNI record", got)
	}
	if calls := rt.CallsOf("AttachInterface"); len(calls) != 2 || calls[1].Err != nil {
		t.Fatalf("the runtime's attaches: %+v", calls)
	}
	if _, f, err := node.LoadConflist(); err != nil || filepath.Base(f) != primaryFile {
		t.Fatalf("the KNI agent put a chain entry back: the runtime picks %s (%v)", f, err)
	}
}
