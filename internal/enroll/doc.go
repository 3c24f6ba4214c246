// Package enroll decides which pods join the mesh: the agent's enrollment
// policy. The plugin never holds credentials and never calls the API server;
// the agent asks a source from this package inside the gate's Add.
//
// # Selectors and precedence
//
// A pod is enrolled when its namespace or the pod itself matches the profile's
// label selectors and the pod does not opt out:
//
//	profile   enrolls (namespace or pod label)   opts out (pod label or annotation)
//	mesh-cni  mesh-cni.io/dataplane-mode=enabled mesh-cni.io/dataplane-mode=disabled
//	istio     istio.io/dataplane-mode=ambient    istio.io/dataplane-mode=none, or the
//	                                             annotation sidecar.istio.io/status
//	                                             (the pod runs an Istio sidecar)
//
// Under the istio profile the Kubernetes source enrolls a pod Istio injected
// with a sidecar for istio-cni in sidecar mode instead, captured for its own
// proxy container as istio-cni's plugin would (IstioSidecarPod,
// IstioSidecarCapture), unless its namespace enforces the mesh.
//
// When labels disagree: a pod opt-out wins over everything, then the pod's own
// enable label, then its namespace. A namespace labelled mesh-cni.io/enforce=true
// overrules its pods' opt-outs (and the istio profile's
// ambient.istio.io/bypass-inbound-capture and dns-capture=false): they are ignored, the reason says so,
// and the Kubernetes source puts a Warning Event MeshOptOutIgnored on the pod. A pod labelled disabled in an enabled
// namespace stays out; a pod labelled enabled is in whatever its namespace
// says. Only the chosen profile's labels count: an Istio label means nothing
// under the mesh-cni profile, and the reverse.
//
// # Sources
//
// FileSource (standalone, no cluster needed) reads a policy file and watches it:
// an edit is in force within about a second, without a restart. An edit that
// does not parse or validate is logged and ignored, and the last good policy
// stays in force; until a first good file is read the source is not synced, so
// the agent is not ready and pods wait at the gate. CNI requests carry only the
// pod's namespace and name, so the file matches them by name; KNI and hook
// requests also carry the pod's labels and annotations, which the profile's pod
// selectors and opt-outs then read.
//
// KubeSource reads labels from client-go shared informers: pods on this node
// (field selector spec.nodeName) and namespaces. A pod not yet in the cache is
// awaited from the watch for a moment (watchGrace), then fetched with a direct GET, from the API server's watch cache first
// (resourceVersion=0) and from etcd only when that lacks it, retried with
// jittered back-off up to the API timeout; when
// the answer cannot be had, Decide returns an error and the ADD fails with it,
// never a guess that would start the pod unmeshed. It is synced once both caches
// have their first list. Labelling a namespace or pod later fires Changed; the
// agent then re-decides every pod it knows. Each outcome is written to the pod
// as the annotation mesh-cni.io/redirection=enabled|disabled|failed (a merge
// patch carrying the pod's uid), except "disabled" for a pod that carries no
// redirection annotation (nothing reads it there: one write and one watch
// event per pod start outside the mesh saved), and a failure also becomes a Warning Event
// (reason MeshEnrollmentFailed), both in the background with retries. Others
// can write the annotations too (where no admission policy stops them): on each
// reconcile pass the agent hands the source its records (AuditOutcomes), and a
// pod of the node whose annotations disagree is rewritten.
// The agent's identity needs: pods get/list/watch/patch, namespaces
// get/list/watch, events create.
//
// # Policy file
//
// YAML (or JSON); unknown fields are errors.
//
//	# Which labels enroll or opt out pods whose labels the request carries
//	# (KNI, hook): mesh-cni (default: the agent's --selector-profile) or istio.
//	profile: mesh-cni
//	# Every pod in these namespaces is enrolled. Shell glob patterns.
//	namespaces: [shop, "team-*"]
//	# Single pods; namespace and name are glob patterns, both required.
//	pods:
//	  - {namespace: legacy, name: "billing-*"}
//	# Never enrolled, whatever else matches; no name means the whole namespace.
//	exclude:
//	  - {namespace: shop, name: "db-*"}
//	  - {namespace: shop-batch}
//	# Optional: replace the profile's pod selectors (Kubernetes label-selector
//	# syntax; each list is "any of"). A list given, even empty, replaces the
//	# profile's; a list left out keeps it. Namespace selectors are refused:
//	# without the Kubernetes source no request tells the agent namespace labels.
//	selectors:
//	  pod: ["app.kubernetes.io/part-of=shop"]
//	  podOptOut: ["mesh-cni.io/dataplane-mode=disabled"]
//	  podOptOutAnnotation: ["mesh-cni.io/dataplane-mode=disabled"]
//
// Precedence in the file, first match wins: exclude; a pod opt-out label or
// annotation; pods; a pod enable label; namespaces. Anything else is not
// enrolled. An empty file is refused (it is what an editor leaves for a moment
// when it truncates before writing); {} is the policy that enrolls nothing by
// name.
package enroll
