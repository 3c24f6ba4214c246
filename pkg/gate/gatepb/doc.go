// Package gatepb holds the generated protobuf and gRPC code of the gate API
// (gate.proto). Regenerate with `make generate`.
package gatepb
