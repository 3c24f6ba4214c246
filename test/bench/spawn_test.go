package bench

import (
	"runtime"
	"testing"

	"github.com/mesh-cni/mesh-cni/test/harness"
)

// spawner starts long-lived child processes from one OS thread that stays
// alive until the benchmark's cleanup. harness.StartProcess gives its children
// Pdeathsig=SIGKILL, which the kernel sends when the *thread* that forked them
// exits, and internal/netns.Create ends the thread it ran on (it exits locked after
// unshare). A child forked from an ordinary pool thread (or, for a process in a
// pod, from netns.Do's thread) is therefore killed at random once a later
// netns.Create happens to run on that thread; with hundreds of pods made per
// benchmark it happens (an agent died mid-run that way). Forking from a thread
// that is locked for the whole benchmark avoids it.
type spawner struct {
	jobs chan func()
}

func newSpawner(tb testing.TB) *spawner {
	s := &spawner{jobs: make(chan func())}
	stopped := make(chan struct{})
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		defer close(stopped)
		for job := range s.jobs {
			job()
		}
	}()
	// Registered before any process it starts, so it runs after their kills.
	tb.Cleanup(func() {
		close(s.jobs)
		<-stopped
	})
	return s
}

// start runs harness.StartProcess on the spawner's thread. A process for a pod
// is started through nsenter (see inPod) rather than with opts.NetNSPath,
// which would fork from another thread.
func (s *spawner) start(tb testing.TB, opts harness.ProcessOptions) *harness.Process {
	tb.Helper()
	var p *harness.Process
	done := make(chan struct{})
	s.jobs <- func() {
		// StartProcess reports a failure itself (and then ends this
		// goroutine, which is why done is closed by defer).
		defer close(done)
		p = harness.StartProcess(tb, opts)
	}
	<-done
	if p == nil {
		tb.FailNow()
	}
	return p
}

// inPod makes opts run its program inside the network namespace at netnsPath
// through nsenter, which execs the program (same process, so Pdeathsig holds).
func inPod(netnsPath string, opts harness.ProcessOptions) harness.ProcessOptions {
	opts.Args = append([]string{"--net=" + netnsPath, opts.Path}, opts.Args...)
	opts.Path = "nsenter"
	return opts
}
