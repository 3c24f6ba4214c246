// Package k8s runs mesh-cni's Kubernetes enrollment against a real
// kube-apiserver and etcd, built from Go modules by hack/build-kube.sh into a
// cache outside the repository (see kubeenv). Both run as processes on
// loopback with a self-made CA and static tokens; nothing leaves the machine.
//
// The tests create namespaces and pods in the API server (pods are bound to a
// test node by spec.nodeName; no kubelet runs them), drive the real CNI chain
// [bridge, mesh-cni] for the same pods through libcni, and run the real
// mesh-agent process with --enrollment=kubernetes, its own kubeconfig and a
// least-privilege ClusterRole (kubeenv.AgentRules).
//
// What "the plugin cannot read any credential" means here. On a real node the
// plugin runs as root, exec'd by the container runtime, and a root process can
// open any file on the host: file modes cannot keep it from a credential it
// goes looking for. What the design guarantees, and these tests assert, is that
// the plugin is given none and has no use for one: the chain entry the agent
// installs carries no kubeconfig, token, certificate or path to them; the
// plugin's binary links no Kubernetes client at all; the agent's kubeconfig is
// a 0600 file read only by the agent (in the DaemonSet, the service-account
// token is mounted into the agent's container only); and every enrollment
// decision, including the ones with the API server down, is the agent's.
//
// TestAgentAdmissionPolicy runs its own API server as a cluster's is
// (ServiceAccount admission, Node authorization, NodeRestriction), applies
// install/kubernetes as shipped and gives the agent the token node A's kubelet
// mints for the agent's pod there: a TokenRequest bound to the pod, whose node
// the API server then names in every request. The ValidatingAdmissionPolicy
// lets that token set mesh-cni.io/redirection on node A's pods and refuses
// everything else, and the real agent still annotates its node's pods with it.
package k8s
