package agentcli

import (
	"flag"
	"io"
	"regexp"
	"slices"
	"testing"

	"github.com/mesh-cni/mesh-cni/test/fixtures"
)

// TestEveryFlagDocumented keeps docs/configuration.md and the
// flag sets of `mesh-agent run` and `mesh-agent hook` equal, both ways.
func TestEveryFlagDocumented(t *testing.T) {
	documented := fixtures.DocNames(t, "docs/configuration.md", regexp.MustCompile("(?m)^\\| `--([a-z0-9-]+)` \\|"))
	var opts options
	fs := flagSet("mesh-agent run", &opts, io.Discard)
	var declared []string
	fs.VisitAll(func(f *flag.Flag) { declared = append(declared, f.Name) })
	var hook hookOptions
	hookFlagSet(&hook, io.Discard).VisitAll(func(f *flag.Flag) {
		if !slices.Contains(declared, f.Name) {
			declared = append(declared, f.Name)
		}
	})
	for _, name := range declared {
		if !documented[name] {
			t.Errorf("flag --%s is not in docs/configuration.md", name)
		}
	}
	for name := range documented {
		if !slices.Contains(declared, name) {
			t.Errorf("docs/configuration.md documents --%s, which neither mesh-agent run nor hook has", name)
		}
	}
}
