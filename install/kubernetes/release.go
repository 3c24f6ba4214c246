package kubernetes

// The agent image the manifests pin (kustomization.yaml, and the Helm
// chart's default values): what `make image` builds from ReleaseCommit with
// ReleaseGo. The build is reproducible, so anyone can rebuild it from that
// commit and get ReleaseDigest; test/node does, and installs it.
//
// Why a pinned release and not the digest of every commit: the digest
// changes with every change to the agent's sources, and a test demanding the
// current tree's digest here would fail every commit but the ones that edit
// this file. The node test runs the current tree's build through an overlay
// instead, as an operator deploys their own build.
//
// To move the pin: pick a commit, run `make image` at it, and put the commit,
// the Go version and bin/image/mesh-agent.tar.digest here and in
// kustomization.yaml (TestReleasePinned checks they agree).
const (
	ReleaseCommit = "cb2f7a12230086351a416f472e8f5ab6484ddf6a"
	ReleaseGo     = "go1.26.8"
	ReleaseDigest = "sha256:704d36021bbca66e30c4a116c6c7f86e429cf1c4151d74ce41d73023029932c7"
)
