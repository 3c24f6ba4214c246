package agentcli

import (
	"bytes"
	"context"
	"strings"
	"testing"
)

// TestZDSNeedsServiceAccounts: with ZDS on (its default) and an enrollment
// source that cannot know service accounts, mesh-agent run refuses to start
// and says what to do, before it opens anything.
func TestZDSNeedsServiceAccounts(t *testing.T) {
	dir := t.TempDir()
	base := []string{"--socket", dir + "/gate.sock", "--state-dir", dir + "/pods", "--bpffs-root", dir + "/bpf",
		"--cni-install=false", "--metrics-addr=", "--zds-socket", dir + "/zds/ztunnel.sock"}
	for _, mode := range []string{EnrollmentAll, EnrollmentFile} {
		t.Run(mode, func(t *testing.T) {
			var stderr bytes.Buffer
			code := runCommand(context.Background(), append(base, "--enrollment", mode), &stderr)
			if code != 2 {
				t.Fatalf("exit %d, want 2 (invalid configuration); stderr:\n%s", code, stderr.String())
			}
			for _, want := range []string{"--enrollment=" + mode, "service account", "--zds-without-service-accounts", "--zds-socket="} {
				if !strings.Contains(stderr.String(), want) {
					t.Errorf("the refusal does not mention %q:\n%s", want, stderr.String())
				}
			}
		})
	}
	for _, tc := range []struct {
		name string
		opts options
	}{
		{"kubernetes", options{zdsSocket: "/run/z.sock", enroll: enrollOptions{mode: EnrollmentKubernetes}}},
		{"zds off", options{zdsSocket: "", enroll: enrollOptions{mode: EnrollmentAll}}},
		{"explicit opt-in", options{zdsSocket: "/run/z.sock", zdsNoServiceAcct: true, enroll: enrollOptions{mode: EnrollmentFile}}},
	} {
		if err := checkZDSServiceAccounts(tc.opts); err != nil {
			t.Errorf("%s: %v, want accepted", tc.name, err)
		}
	}
}
