package kubernetes

import (
	"io/fs"
	"strings"
	"testing"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
)

// uninstallJob decodes uninstall/job.yaml strictly.
func uninstallJob(t *testing.T) *batchv1.Job {
	t.Helper()
	data, err := fs.ReadFile(Manifests(), "uninstall/job.yaml")
	if err != nil {
		t.Fatal(err)
	}
	docs, err := splitDocuments(data)
	if err != nil || len(docs) != 1 {
		t.Fatalf("uninstall/job.yaml: want one document (%v)", err)
	}
	obj, err := decodeStrict(strictDecoder(t), docs[0])
	if err != nil {
		t.Fatalf("uninstall/job.yaml: %v", err)
	}
	job, ok := obj.(*batchv1.Job)
	if !ok {
		t.Fatalf("uninstall/job.yaml holds a %T, want a Job", obj)
	}
	return job
}

// The uninstall Job finds what the agent installed: every path flag it passes
// is the DaemonSet's, and each of its mounts is the DaemonSet's mount of the
// same host directory.
func TestUninstallJobMatchesDaemonSet(t *testing.T) {
	job := uninstallJob(t)
	_, agent := agentContainer(t, loadObjects(t))
	pod := job.Spec.Template.Spec
	if job.Namespace != Namespace || !strings.HasSuffix(job.Name, "-"+UninstallNode) || pod.NodeName != UninstallNode {
		t.Errorf("Job %s/%s on node %q: want namespace %s, the node's name %s in its name and nodeName", job.Namespace, job.Name, pod.NodeName, Namespace, UninstallNode)
	}
	if !pod.HostNetwork {
		t.Error("hostNetwork: want true (a pod network would make its ADD wait for the agent that is gone)")
	}
	if pod.RestartPolicy != corev1.RestartPolicyNever {
		t.Errorf("restartPolicy %q, want Never (the Job's backoff retries)", pod.RestartPolicy)
	}
	if len(pod.Containers) != 1 {
		t.Fatalf("%d containers, want 1", len(pod.Containers))
	}
	c := pod.Containers[0]
	if c.Image != agent.Image {
		t.Errorf("image %q, want the agent's %q", c.Image, agent.Image)
	}
	if len(c.Args) == 0 || c.Args[0] != "uninstall" {
		t.Fatalf("args %q: want the uninstall subcommand first", c.Args)
	}
	// flagArgs wants "run" first; the rest of the rules are the same.
	run := c
	run.Args = append([]string{"run"}, c.Args[1:]...)
	flags := flagArgs(t, run)
	agentFlags := flagArgs(t, agent)
	for _, pf := range AgentPathFlags() {
		if v, ok := flags[pf.Flag]; ok && v != agentFlags[pf.Flag] {
			t.Errorf("--%s=%s, the DaemonSet passes %s", pf.Flag, v, agentFlags[pf.Flag])
		}
	}
	for _, f := range []string{"socket", "bpffs-root", "cgroup-root"} {
		if _, ok := flags[f]; !ok {
			t.Errorf("args lack --%s: uninstall would look in the default place, not where the DaemonSet put things", f)
		}
	}
	// The CNI directories are decided as the agent decides them: from the
	// runtime's process, which needs the host's PID namespace.
	for _, f := range []string{"cni-bin-dir", "cni-conf-dir"} {
		if v, ok := flags[f]; ok != (agentFlags[f] != "") || v != agentFlags[f] {
			t.Errorf("--%s=%q, the DaemonSet passes %q: uninstall would look elsewhere than the agent installed", f, v, agentFlags[f])
		}
	}
	if !pod.HostPID {
		t.Error("hostPID: want true, to find the container runtime's CNI directories as the agent does")
	}
	if sc := c.SecurityContext; sc == nil || sc.Privileged == nil || !*sc.Privileged {
		t.Error("securityContext.privileged: want true, as the agent's")
	}

	hostPaths := map[string]string{}
	for _, v := range pod.Volumes {
		if v.HostPath == nil {
			t.Errorf("volume %q is not a hostPath volume", v.Name)
			continue
		}
		hostPaths[v.Name] = v.HostPath.Path
	}
	table := map[string]Mount{}
	for _, m := range AgentMounts() {
		table[m.Volume] = m
	}
	for _, m := range c.VolumeMounts {
		want, ok := table[m.Name]
		if !ok {
			t.Errorf("mount %q is none of the DaemonSet's", m.Name)
			continue
		}
		prop := ""
		if m.MountPropagation != nil && *m.MountPropagation != corev1.MountPropagationNone {
			prop = string(*m.MountPropagation)
		}
		got := Mount{Volume: m.Name, HostPath: hostPaths[m.Name], Path: m.MountPath, ReadOnly: m.ReadOnly, Propagation: prop}
		if got != want {
			t.Errorf("mount of volume %q:\n got %+v\nwant %+v", m.Name, got, want)
		}
	}
}
