// Package helm holds the tests of the mesh-cni Helm chart (mesh-cni/): with its
// default values the chart renders exactly what the kustomization in
// install/kubernetes builds (less the namespace, which docs/install.md applies from
// there first), and each value lands where it should. It is a module of its
// own so that the Helm SDK and kustomize stay out of the product's module
// graph.
package helm
