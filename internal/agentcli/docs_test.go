package agentcli

import (
	"flag"
	"io"
	"os"
	"regexp"
	"slices"
	"testing"
)

// TestEveryFlagDocumented keeps docs/configuration.md and the
// flag set of `mesh-agent run` equal, both ways.
func TestEveryFlagDocumented(t *testing.T) {
	readme, err := os.ReadFile("../../docs/configuration.md")
	if err != nil {
		t.Fatal(err)
	}
	documented := map[string]bool{}
	for _, m := range regexp.MustCompile("(?m)^\\| `--([a-z0-9-]+)` \\|").FindAllSubmatch(readme, -1) {
		documented[string(m[1])] = true
	}
	var opts options
	fs := flagSet("mesh-agent run", &opts, io.Discard)
	var declared []string
	fs.VisitAll(func(f *flag.Flag) { declared = append(declared, f.Name) })
	for _, name := range declared {
		if !documented[name] {
			t.Errorf("flag --%s is not in docs/configuration.md", name)
		}
	}
	for name := range documented {
		if !slices.Contains(declared, name) {
			t.Errorf("docs/configuration.md documents --%s, which mesh-agent run does not have", name)
		}
	}
}
