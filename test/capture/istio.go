package capture

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"
)

// IstioBinary is the name of the helper (hack/istio-inpod, built by
// hack/build-istio.sh) that applies istio-cni's own in-pod rules.
const IstioBinary = "istio-inpod"

// InstallIstio applies istio-cni's in-pod rules to the namespace at
// netnsPath with helper, the hack/istio-inpod binary: the exact rules, policy
// route and mark rule an Istio ambient pod gets, written by istio-cni's own
// code. The cleanup removes them the way istio-cni does when a pod leaves the
// mesh.
func InstallIstio(ctx context.Context, helper, netnsPath string) (Cleanup, error) {
	run := func(ctx context.Context, args ...string) error {
		cmd := exec.CommandContext(ctx, helper, append([]string{"-netns", netnsPath}, args...)...)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("%s %s: %w: %s", helper, strings.Join(cmd.Args[1:], " "), err, bytes.TrimSpace(out.Bytes()))
		}
		return nil
	}
	cleanup := func(ctx context.Context) error {
		if gone(netnsPath) {
			return nil
		}
		return run(ctx, "-delete")
	}
	if err := run(ctx); err != nil {
		return nil, errors.Join(fmt.Errorf("install istio-cni's rules in %s: %w", netnsPath, err), cleanup(ctx))
	}
	return cleanup, nil
}
