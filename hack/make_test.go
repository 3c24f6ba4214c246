package hack

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestUnitRedirectTestsExist holds the Makefile's UNIT_REDIRECT, the data
// path's tests make test-unit runs by name, to tests internal/redirect has:
// a name that matches nothing would leave them out without a word (go test
// -run passes when nothing matches).
func TestUnitRedirectTestsExist(t *testing.T) {
	t.Parallel()
	mk, err := os.ReadFile("../Makefile")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^UNIT_REDIRECT := (.*)$`).FindSubmatch(mk)
	if m == nil {
		t.Fatal("the Makefile has no UNIT_REDIRECT line")
	}
	names := strings.Fields(string(m[1]))
	if len(names) == 0 {
		t.Fatal("UNIT_REDIRECT names no test")
	}
	files, err := filepath.Glob("../internal/redirect/*_test.go")
	if err != nil {
		t.Fatal(err)
	}
	var src strings.Builder
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		src.Write(b)
	}
	for _, n := range names {
		if !strings.Contains(src.String(), "\nfunc "+n+"(t *testing.T) {") {
			t.Errorf("UNIT_REDIRECT names %s, which internal/redirect has no test of", n)
		}
	}
}
