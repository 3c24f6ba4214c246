// Package hack holds the scripts that prepare a machine for the build and
// the tests; its tests keep the README's package line equal to their list
// and the Makefile's names of tests to tests that exist.
package hack

import (
	"bufio"
	"os"
	"strings"
	"testing"

	"github.com/mesh-cni/mesh-cni/test/harness"
)

// readPackages returns the package names of a hack/deps.sh list, in order.
func readPackages(t *testing.T, file string) []string {
	t.Helper()
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var pkgs []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line, _, _ := strings.Cut(sc.Text(), "#")
		pkgs = append(pkgs, strings.Fields(line)...)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return pkgs
}

// TestReadmePackages holds the README's apt-get line to hack/packages.txt,
// the list `make demo` and `make test` install (and so CI, which runs them):
// a newcomer who installs by hand gets exactly what the tests need.
func TestReadmePackages(t *testing.T) {
	pkgs := readPackages(t, "packages.txt")
	if len(pkgs) == 0 {
		t.Fatal("hack/packages.txt lists no package")
	}
	want := "```sh\napt-get install -y " + strings.Join(pkgs, " ") + "\n```\n"
	harness.DocSection(t, "README.md",
		"<!-- begin packages: generated from hack/packages.txt by go test ./hack/ -->",
		"<!-- end packages -->", want)
}

// TestCIInstallsNoPackages keeps CI on the README's path: .ci/run installs
// nothing itself, so every package the tests need comes from a list a make
// target installs.
func TestCIInstallsNoPackages(t *testing.T) {
	data, err := os.ReadFile("../.ci/run")
	if err != nil {
		t.Fatal(err)
	}
	for _, word := range []string{"apt-get", "apt ", "dpkg", "hack/build-", "hack/peers.sh"} {
		if strings.Contains(string(data), word) {
			t.Errorf(".ci/run runs %q itself: packages and peers belong to the make targets the README runs", word)
		}
	}
}
