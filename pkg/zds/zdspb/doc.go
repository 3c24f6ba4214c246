// Package zdspb holds the generated protobuf code of ZDS (zds.proto), the
// ztunnel-compatible handoff protocol between the node agent and a node proxy.
// Regenerate with `make generate`.
package zdspb
