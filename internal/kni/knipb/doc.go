// Package knipb holds the generated protobuf and gRPC code of the KNI network
// runtime service (kni.proto, proto package "kni"). Regenerate with `make generate`.
package knipb
