package agentcli

import (
	"flag"
	"io"
	"os"
	"regexp"
	"slices"
	"testing"
)

// TestEveryFlagDocumented keeps the README's configuration reference and the
// flag set of `mesh-agent run` equal, both ways.
func TestEveryFlagDocumented(t *testing.T) {
	readme, err := os.ReadFile("../../README.md")
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
			t.Errorf("flag --%s is not in the README's configuration reference", name)
		}
	}
	for name := range documented {
		if !slices.Contains(declared, name) {
			t.Errorf("the README documents --%s, which mesh-agent run does not have", name)
		}
	}
}
