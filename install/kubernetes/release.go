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
	ReleaseCommit = "aa5d1c1600708824c493c0b6a6c8d4ed37acf088"
	ReleaseGo     = "go1.26.8"
	ReleaseDigest = "sha256:ed0870bfae185183555452f6f252bb648e6cbd574727ecebed6615cdc0d9f1e7"
)
