package agentcli

import (
	"fmt"

	"go.uber.org/zap"

	"github.com/mesh-cni/mesh-cni/internal/agent"
	"github.com/mesh-cni/mesh-cni/internal/nodetaint"
)

// DefaultStartupTaint is the key the install's admission policy lets the
// agent remove from its own node, and the one docs/install.md registers
// nodes with. The flag's own default is off.
const DefaultStartupTaint = "mesh-cni.io/agent-not-ready"

// startupTaintConfig is what --startup-taint asks for: nil when off.
func (e enrollOptions) startupTaintConfig(log *zap.Logger) (*agent.StartupTaintConfig, error) {
	if e.startupTaint == "" {
		return nil, nil
	}
	if err := nodetaint.ValidateKey(e.startupTaint); err != nil {
		return nil, fmt.Errorf("--startup-taint: %w", err)
	}
	node, err := e.node("--startup-taint")
	if err != nil {
		return nil, err
	}
	client, _, err := e.client(log, node, "--startup-taint")
	if err != nil {
		return nil, err
	}
	return &agent.StartupTaintConfig{
		Key:   e.startupTaint,
		Node:  node,
		Taint: nodetaint.Remover{Nodes: client.CoreV1().Nodes(), Node: node, Key: e.startupTaint},
	}, nil
}
