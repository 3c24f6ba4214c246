package harness

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// EnvUpdateReadme names the environment variable that makes ReadmeSection
// rewrite a generated section of README.md instead of failing on a difference.
const EnvUpdateReadme = "MESH_UPDATE_README"

// ReadmeSection checks that the module's README.md holds want between the
// markers begin and end (each on a line of its own, want between them), and
// returns the README. With $MESH_UPDATE_README set it rewrites the section
// instead. A missing section or a difference fails the test, saying how to
// regenerate it.
func ReadmeSection(tb testing.TB, begin, end, want string) string {
	tb.Helper()
	root, err := ModuleRoot(context.Background())
	if err != nil {
		tb.Fatal(err)
	}
	path := filepath.Join(root, "README.md")
	data, err := os.ReadFile(path)
	if err != nil {
		tb.Fatal(err)
	}
	readme := string(data)
	i, j := strings.Index(readme, begin), strings.Index(readme, end)
	if i < 0 || j < i {
		tb.Fatalf("README.md has no section between %q and %q", begin, end)
	}
	want = "\n" + want
	got := readme[i+len(begin) : j]
	if got == want {
		return readme
	}
	if os.Getenv(EnvUpdateReadme) == "" {
		tb.Errorf("README.md's section %q differs from what the test generates (%s=1 rewrites it):\n--- README\n%s\n--- generated\n%s", begin, EnvUpdateReadme, got, want)
		return readme
	}
	readme = readme[:i+len(begin)] + want + readme[j:]
	if err := os.WriteFile(path, []byte(readme), 0o644); err != nil {
		tb.Fatal(err)
	}
	tb.Logf("rewrote the section %q of %s", begin, path)
	return readme
}
