// Package gate is the protocol between the mesh-cni plugin and the node agent:
// a gRPC service (gatepb) on a Unix socket that only root reaches, with the
// caller's credentials checked on every connection (SO_PEERCRED).
//
// The plugin calls Add for a pod and waits, holding the pod's start, until the
// agent is ready and has enrolled it; Del, Check, GC and Status follow the CNI
// verbs. What both sides validate (pod identity, namespace paths, sizes) is
// here, so the agent and any other client refuse the same inputs. gateclient is
// the plugin's own client: the same calls without grpc-go, for a small binary
// that starts fast.
package gate
