package agentcli

import (
	"context"
	"errors"
	"flag"
	"io"

	"go.uber.org/zap"

	"github.com/mesh-cni/mesh-cni/pkg/agent"
)

func ebpfOpener(opts options, log *zap.Logger) func(context.Context) (agent.Datapath, func() error, error) {
	return func(context.Context) (agent.Datapath, func() error, error) {
		return nil, nil, errors.New("the eBPF data path is not built into this agent yet")
	}
}

func uninstallCommand(ctx context.Context, args []string, stderr io.Writer) int {
	var opts options
	fs := flagSet(&opts, stderr)
	if err := fs.Parse(args); err != nil {
		return 2
	}
	_ = flag.ErrHelp
	return 0
}
