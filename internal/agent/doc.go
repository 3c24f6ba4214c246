// Package agent is mesh-agent's node agent: the gate service that admits pods,
// its readiness, the data path behind it, the records it keeps and the passes
// that keep them true. internal/agentcli builds a Config from the command line and
// calls Run.
//
// Each file holds one role:
//
//   - run.go: Config and Run, which wires everything below together in the
//     order the agent becomes ready.
//   - service.go: the gate service (Add, Del, Check, GC, List): enrollment
//     decisions, records, data path calls, serialised per pod attachment by
//     internal/keylock.
//   - status.go: the Status call and the chain entry's state it reports
//     (CNIStatus, from the CNI config installer).
//   - gateserver.go: the gate's gRPC server and health service on the gate
//     socket.
//   - readiness.go: the readiness conditions and waiting for them.
//   - policy.go: the enrollment policy seam (Policy and its optional
//     interfaces, the outcomes reported back) and the loops that follow a
//     policy's sync and changes; reevaluate.go: re-deciding every known pod.
//   - reconcile.go: the reconcile pass (records against the data path and the
//     live namespaces) and the proxy listeners the data path refused.
//   - datapath.go: the Datapath seam and RecordOnly; lazy.go: the data path
//     handed out before it has loaded; redirect.go: internal/redirect's eBPF data
//     path behind the seam.
//   - adopt.go: enrolling pods that ran before the agent, found through the
//     host's procfs; probers.go: following the kubelet, whose probes pass
//     inbound capture.
//   - zdshandoff.go: handing enrolled pods to a node proxy over ZDS.
//   - startuptaint.go: removing the node's startup taint once ready
//     (internal/nodetaint writes it).
//   - metrics.go: the Prometheus metrics; http.go: /metrics, /healthz and
//     /readyz.
package agent
