// Command mesh-cni is the chained CNI plugin that holds a pod's start until the
// mesh-agent on the node has enrolled it in the mesh.
package main

import "github.com/mesh-cni/mesh-cni/internal/cniplugin"

func main() { cniplugin.Main() }
