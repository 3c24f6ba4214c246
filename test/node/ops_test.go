package node

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mesh-cni/mesh-cni/test/harness"
	"github.com/mesh-cni/mesh-cni/test/node/nodeenv"
)

// opCommand is one command of docs/install.md, run by
// the test exactly as written, with bash, from a checkout.
type opCommand struct {
	// Run is the bash command (a heredoc included).
	Run string
	// OnNode runs it on the node, as root there (ctr, the runtime's
	// client), rather than where kubectl runs.
	OnNode bool
}

// opBlock is one code block of docs/install.md.
type opBlock struct {
	// Name marks the block in docs/install.md: <!-- begin install: NAME -->.
	Name string
	Cmds []opCommand
}

const rollout = "kubectl -n mesh-system rollout status ds/mesh-agent --timeout=3m"

// markPatch is the overlay patch that turns on --proxy-mark for the sidecar
// proxies of the walkthrough.
const markPatch = `patches:
  # Sidecar proxies that mark their sockets 0x539 (the reference proxy):
  # an opt-in, since any pod's root can set a mark.
  - target: {kind: DaemonSet, name: mesh-agent}
    patch: |
      - op: add
        path: /spec/template/spec/containers/0/args/-
        value: --proxy-mark=0x539
`

// importAgent puts `make image`'s agent image into the node's containerd.
func importAgent() opCommand {
	return opCommand{Run: "ctr -n k8s.io images import bin/image/mesh-agent.tar", OnNode: true}
}

// opBlocks are docs/install.md's install and uninstall steps. Each is a function
// so that nothing here is shared state.
func opBlocks() []opBlock {
	return []opBlock{
		{Name: "release", Cmds: []opCommand{
			importAgent(),
			{Run: `mkdir -p sidecars
cat > sidecars/kustomization.yaml <<EOF
resources: [../install/kubernetes]
` + markPatch + `EOF`},
			{Run: "kubectl apply -k sidecars/"},
			{Run: rollout},
		}},
		{Name: "own-build", Cmds: []opCommand{
			importAgent(),
			{Run: `mkdir -p overlay/uninstall
cat > overlay/kustomization.yaml <<EOF
resources: [../install/kubernetes]
images:
  - name: ghcr.io/mesh-cni/mesh-agent
    digest: $(cat bin/image/mesh-agent.tar.digest)
` + markPatch + `EOF
cat > overlay/uninstall/kustomization.yaml <<EOF
resources: [../../install/kubernetes/uninstall]
images:
  - name: ghcr.io/mesh-cni/mesh-agent
    digest: $(cat bin/image/mesh-agent.tar.digest)
EOF`},
			{Run: "kubectl apply -k overlay/"},
			{Run: rollout},
		}},
		{Name: "uninstall", Cmds: []opCommand{
			{Run: "kubectl -n mesh-system delete daemonset mesh-agent --cascade=foreground"},
			{Run: `kubectl kustomize overlay/uninstall | sed "s/NODE_NAME/$NODE/g" | kubectl apply -f -`},
			{Run: `kubectl -n mesh-system wait --for=condition=Complete --timeout=3m job/mesh-agent-uninstall-$NODE`},
			{Run: "kubectl delete -k overlay/ --ignore-not-found"},
		}},
		{Name: "helm", Cmds: []opCommand{
			importAgent(),
			{Run: "kubectl apply -f install/kubernetes/namespace.yaml"},
			{Run: `helm install mesh-cni install/helm/mesh-cni -n mesh-system --set proxyMark=0x539 \
  --set plugin.logLevel=debug --set plugin.logFile=/var/run/mesh-cni/plugin.log`},
			{Run: rollout},
		}},
		{Name: "helm-upgrade", Cmds: []opCommand{
			importAgent(),
			{Run: `helm upgrade mesh-cni install/helm/mesh-cni -n mesh-system --reuse-values \
  --set image.digest=$(cat bin/image/mesh-agent.tar.digest)`},
			{Run: rollout},
		}},
		{Name: "helm-rollback", Cmds: []opCommand{
			{Run: "helm rollback mesh-cni -n mesh-system"},
			{Run: rollout},
		}},
		{Name: "startup-taint", Cmds: []opCommand{
			importAgent(),
			{Run: "kubectl apply -f install/kubernetes/namespace.yaml"},
			{Run: `helm install mesh-cni install/helm/mesh-cni -n mesh-system --set startupTaint.enabled=true \
  --set image.digest=$(cat bin/image/mesh-agent.tar.digest) --set proxyMark=0x539`},
			{Run: rollout},
		}},
		{Name: "platform", Cmds: []opCommand{
			importAgent(),
			{Run: "kubectl apply -f install/kubernetes/namespace.yaml"},
			{Run: `helm install mesh-cni install/helm/mesh-cni -n mesh-system --set platform=$PLATFORM \
  --set image.digest=$(cat bin/image/mesh-agent.tar.digest) --set proxyMark=0x539 \
  --set metrics.bindAddress=0.0.0.0 --set metrics.service.enabled=true`},
			{Run: rollout},
		}},
		{Name: "platform-uninstall", Cmds: []opCommand{
			{Run: "helm uninstall mesh-cni -n mesh-system --cascade foreground --wait"},
			{Run: `helm template mesh-cni install/helm/mesh-cni -n mesh-system --set platform=$PLATFORM \
  --set image.digest=$(cat bin/image/mesh-agent.tar.digest) --set uninstall.node=$NODE \
  --show-only templates/uninstall-job.yaml | kubectl apply -f -`},
			{Run: `kubectl -n mesh-system wait --for=condition=Complete --timeout=3m job/mesh-agent-uninstall-$NODE`},
			{Run: "kubectl delete -f install/kubernetes/namespace.yaml"},
		}},
		{Name: "helm-uninstall", Cmds: []opCommand{
			{Run: "helm uninstall mesh-cni -n mesh-system --cascade foreground --wait"},
			{Run: `helm template mesh-cni install/helm/mesh-cni -n mesh-system --set uninstall.node=$NODE \
  --show-only templates/uninstall-job.yaml | kubectl apply -f -`},
			{Run: `kubectl -n mesh-system wait --for=condition=Complete --timeout=3m job/mesh-agent-uninstall-$NODE`},
			{Run: "kubectl delete -f install/kubernetes/namespace.yaml"},
		}},
	}
}

// markdown is the block as docs/install.md shows it.
func (b opBlock) markdown() string {
	var w strings.Builder
	w.WriteString("```sh\n")
	for _, c := range b.Cmds {
		w.WriteString(c.Run)
		if c.OnNode {
			w.WriteString("    # on each node")
		}
		w.WriteString("\n")
	}
	w.WriteString("```\n")
	return w.String()
}

// operator runs the commands of docs/install.md against the node, from a checkout: a
// directory with install/ (the repository's) and bin/image/ (one build's
// images), as after `make image`.
type operator struct {
	t    *testing.T
	n    *nodeenv.Node
	env  []string
	mu   sync.Mutex
	used map[string]bool // block/index of every command run
}

func newOperator(t *testing.T, n *nodeenv.Node) *operator {
	t.Helper()
	path := strings.Join([]string{n.Bins.KubeNode, n.Bins.Helm, n.Bins.Containerd, os.Getenv("PATH")}, ":")
	return &operator{
		t:    t,
		n:    n,
		used: map[string]bool{},
		env: []string{
			"PATH=" + path,
			"KUBECONFIG=" + n.AdminKubeconfig,
			"NODE=" + n.Name,
			// helm's own state (repositories, cache) in the test's directory.
			"HELM_CONFIG_HOME=" + filepath.Join(n.Dir, "helm", "config"),
			"HELM_CACHE_HOME=" + filepath.Join(n.Dir, "helm", "cache"),
			"HELM_DATA_HOME=" + filepath.Join(n.Dir, "helm", "data"),
		},
	}
}

// checkout makes a directory that looks like the repository after
// `make image`: install/ is the repository's, bin/image holds images.
func checkout(t *testing.T, images string) string {
	t.Helper()
	root, err := harness.ModuleRoot(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.Symlink(filepath.Join(root, "install"), filepath.Join(dir, "install")); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(dir, "bin"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(images, filepath.Join(dir, "bin", "image")); err != nil {
		t.Fatal(err)
	}
	return dir
}

// run runs commands idx (all when none) of the named block in the checkout
// dir and fails the test on the first that fails.
func (o *operator) run(ctx context.Context, dir, block string, idx ...int) {
	o.t.Helper()
	var blk *opBlock
	for _, b := range opBlocks() {
		if b.Name == block {
			blk = &b
		}
	}
	if blk == nil {
		o.t.Fatalf("no docs/install.md block %q", block)
	}
	if len(idx) == 0 {
		for i := range blk.Cmds {
			idx = append(idx, i)
		}
	}
	for _, i := range idx {
		c := blk.Cmds[i]
		start := time.Now()
		out, err := o.exec(ctx, dir, c)
		o.t.Logf("$ %s\n%s(%s, %v)", c.Run, out, block, time.Since(start).Round(time.Millisecond))
		if err != nil {
			o.diagnose(ctx)
			o.t.Fatalf("docs/install.md step %q of %s failed: %v", c.Run, block, err)
		}
		o.mu.Lock()
		o.used[fmt.Sprintf("%s/%d", block, i)] = true
		o.mu.Unlock()
	}
}

func (o *operator) exec(ctx context.Context, dir string, c opCommand) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	script := "cd " + dir + "\n" + c.Run
	var cmd *exec.Cmd
	if c.OnNode {
		cmd = o.n.Command(ctx, o.env, "/bin/bash", "-euo", "pipefail", "-c", script)
	} else {
		cmd = exec.CommandContext(ctx, "/bin/bash", "-euo", "pipefail", "-c", script)
		cmd.Env = append(os.Environ(), o.env...)
	}
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	err := cmd.Run()
	return out.String(), err
}

// diagnose logs what an operator would look at when a step fails: the pods,
// mesh-system's events and its pods' logs.
func (o *operator) diagnose(ctx context.Context) {
	o.t.Helper()
	for _, args := range [][]string{
		{"get", "pods", "-A", "-o", "wide"},
		{"-n", "mesh-system", "get", "events", "--sort-by=.lastTimestamp"},
		{"-n", "mesh-system", "logs", "--all-containers", "--prefix", "--tail=40", "-l", "app.kubernetes.io/part-of=mesh-cni"},
	} {
		out, _ := o.exec(ctx, o.t.TempDir(), opCommand{Run: "kubectl " + strings.Join(args, " ")})
		o.t.Logf("kubectl %s:\n%s", strings.Join(args, " "), out)
	}
	out, _ := o.exec(ctx, "/", opCommand{Run: "find /sys/fs/bpf /etc/cni/net.d /opt/cni/bin -ls", OnNode: true})
	o.t.Logf("on the node:\n%s", out)
}

// unused lists the commands of the blocks named that the test never ran: each
// must run, or docs/install.md would show a step the test does not take.
func (o *operator) unused(blocks ...string) []string {
	o.mu.Lock()
	defer o.mu.Unlock()
	var out []string
	for _, b := range opBlocks() {
		for _, name := range blocks {
			if b.Name != name {
				continue
			}
			for i, c := range b.Cmds {
				if !o.used[fmt.Sprintf("%s/%d", b.Name, i)] {
					out = append(out, b.Name+": "+c.Run)
				}
			}
		}
	}
	return out
}
