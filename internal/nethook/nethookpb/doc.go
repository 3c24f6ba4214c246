// Package nethookpb holds the generated protobuf and gRPC code of the containerd
// network-plugin hook service (nethook.proto, proto package
// "containerd.services.networking.v1"). Regenerate with `make generate`.
package nethookpb
