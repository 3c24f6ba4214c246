// Package gaterpc is the agent's side of the gate protocol (pkg/gate) and the
// plumbing every gRPC endpoint of the agent shares: the root-only Unix socket
// and its hand-over between an old and a new agent, the peer-credential check
// on each connection, the server with its failure codes, the grpc-go client the
// agent's own commands (status, check, hook) dial with, and the release of a
// sandbox that the KNI interposer and the runtime hook both perform.
//
// It is internal: clients outside the agent speak pkg/gate's protocol, and the
// plugin does so with pkg/gate/gateclient, which does not link grpc-go.
package gaterpc
