package harness

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// EnvUpdateDocs names the environment variable that makes DocSection rewrite a
// generated section of a document instead of failing on a difference.
const EnvUpdateDocs = "MESH_UPDATE_DOCS"

// DocSection checks that the module's document doc (a path from the module root,
// such as docs/install.md) holds want between the markers begin and end (each on a
// line of its own, want between them), and returns the document. With
// $MESH_UPDATE_DOCS set it rewrites the section instead. A missing section or a
// difference fails the test, saying how to regenerate it.
func DocSection(tb testing.TB, doc, begin, end, want string) string {
	tb.Helper()
	root, err := ModuleRoot(context.Background())
	if err != nil {
		tb.Fatal(err)
	}
	path := filepath.Join(root, doc)
	data, err := os.ReadFile(path)
	if err != nil {
		tb.Fatal(err)
	}
	text := string(data)
	i, j := strings.Index(text, begin), strings.Index(text, end)
	if i < 0 || j < i {
		tb.Fatalf("%s has no section between %q and %q", doc, begin, end)
	}
	want = "\n" + want
	got := text[i+len(begin) : j]
	if got == want {
		return text
	}
	if os.Getenv(EnvUpdateDocs) == "" {
		tb.Errorf("%s's section %q differs from what the test generates (%s=1 rewrites it):\n--- %s\n%s\n--- generated\n%s", doc, begin, EnvUpdateDocs, doc, got, want)
		return text
	}
	text = text[:i+len(begin)] + want + text[j:]
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		tb.Fatal(err)
	}
	tb.Logf("rewrote the section %q of %s", begin, path)
	return text
}
