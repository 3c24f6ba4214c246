package kernels

import (
	_ "embed"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
)

// matrixFile is the expectation table, kept as text so that moving a kernel from
// fail to pass is a one-word change that reads well in a diff.
//
//go:embed matrix.txt
var matrixFile string

// skipsFile lists the tests each kernel is expected to skip, and why.
//
//go:embed skips.txt
var skipsFile string

// Outcome is what a suite did on a kernel, or must do.
type Outcome string

const (
	Pass Outcome = "pass"
	Fail Outcome = "fail"
)

// Kernel is one row of the matrix.
type Kernel struct {
	Name     string
	Required bool
	Archive  string
	Suites   []string // the archive's suites (bookworm, bookworm-security, ...)
	Packages []string // with "*" for the build
	// Expect is each test suite's required outcome, by suite name.
	Expect map[string]Outcome
	// Skips are the tests expected to skip on this kernel, by suite and
	// test, with why (skips.txt).
	Skips map[string]map[string]string
}

// Matrix is the whole table, rows in file order.
type Matrix struct {
	Kernels []Kernel
}

// LoadMatrix parses the matrix built into this package, with its expected
// skips.
func LoadMatrix() (*Matrix, error) {
	m, err := ParseMatrix(matrixFile, Suites)
	if err != nil {
		return nil, err
	}
	if err := m.ParseSkips(skipsFile, Suites); err != nil {
		return nil, err
	}
	return m, nil
}

// fixedColumns come before the suite columns, in this order.
var fixedColumns = []string{"kernel", "need", "archive", "suites", "packages"}

var kernelName = regexp.MustCompile(`^[a-z0-9][a-z0-9.]*$`)

// ParseMatrix reads a table whose header names fixedColumns and then exactly the
// given suites, each once. Every error names its line.
func ParseMatrix(text string, suites []Suite) (*Matrix, error) {
	var (
		m      Matrix
		header []string
	)
	for i, line := range strings.Split(text, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		fields := strings.Fields(line)
		at := func(format string, args ...any) error {
			return fmt.Errorf("kernel matrix line %d: "+format, append([]any{i + 1}, args...)...)
		}
		if header == nil {
			if err := checkHeader(fields, suites); err != nil {
				return nil, at("%w", err)
			}
			header = fields
			continue
		}
		if len(fields) != len(header) {
			return nil, at("%d columns, the header has %d", len(fields), len(header))
		}
		k := Kernel{Name: fields[0], Archive: fields[2], Expect: map[string]Outcome{}, Skips: map[string]map[string]string{}}
		if !kernelName.MatchString(k.Name) {
			return nil, at("kernel name %q: lower-case letters, digits and dots only", k.Name)
		}
		if slices.ContainsFunc(m.Kernels, func(o Kernel) bool { return o.Name == k.Name }) {
			return nil, at("kernel %s is listed twice", k.Name)
		}
		switch fields[1] {
		case "required":
			k.Required = true
		case "optional":
		default:
			return nil, at("need %q: want required or optional", fields[1])
		}
		if _, ok := archives[k.Archive]; !ok {
			return nil, at("archive %q: want one of %s", k.Archive, strings.Join(archiveNames(), ", "))
		}
		k.Suites = strings.Split(fields[3], ",")
		if slices.Contains(k.Suites, "") {
			return nil, at("empty suite in %q", fields[3])
		}
		k.Packages = strings.Split(fields[4], ",")
		if err := checkPackages(k.Packages); err != nil {
			return nil, at("%w", err)
		}
		for j, suite := range header[len(fixedColumns):] {
			o := Outcome(fields[len(fixedColumns)+j])
			if o != Pass && o != Fail {
				return nil, at("%s: %q, want pass or fail", suite, o)
			}
			k.Expect[suite] = o
		}
		m.Kernels = append(m.Kernels, k)
	}
	if header == nil {
		return nil, errors.New("kernel matrix: no header line")
	}
	if !slices.ContainsFunc(m.Kernels, func(k Kernel) bool { return k.Required }) {
		return nil, errors.New("kernel matrix: no required kernel")
	}
	return &m, nil
}

// allKernels in skips.txt stands for every kernel of the matrix.
const allKernels = "*"

var testName = regexp.MustCompile(`^Test[A-Za-z0-9_]*$`)

// ParseSkips reads the expected skips (skips.txt) into the matrix's kernels:
// each line names a kernel of the matrix or *, a suite, a test and why. A
// test is listed at most once for a kernel, * included. Every error names its
// line.
func (m *Matrix) ParseSkips(text string, suites []Suite) error {
	for i, line := range strings.Split(text, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		at := func(format string, args ...any) error {
			return fmt.Errorf("kernel skips line %d: "+format, append([]any{i + 1}, args...)...)
		}
		fields := strings.Fields(line)
		if len(fields) < 4 {
			return at("%d fields, want kernel, suite, test and why", len(fields))
		}
		kernel, suite, test := fields[0], fields[1], fields[2]
		if !slices.ContainsFunc(suites, func(s Suite) bool { return s.Name == suite }) {
			return at("suite %q is not one of suites.go", suite)
		}
		if !testName.MatchString(test) {
			return at("%q is not a top-level test's name", test)
		}
		var rows []*Kernel
		for j := range m.Kernels {
			if kernel == allKernels || m.Kernels[j].Name == kernel {
				rows = append(rows, &m.Kernels[j])
			}
		}
		if len(rows) == 0 {
			return at("kernel %q is not in the matrix", kernel)
		}
		why := strings.Join(fields[3:], " ")
		for _, k := range rows {
			if _, dup := k.Skips[suite][test]; dup {
				return at("%s %s is listed twice for kernel %s", suite, test, k.Name)
			}
			if k.Skips[suite] == nil {
				k.Skips[suite] = map[string]string{}
			}
			k.Skips[suite][test] = why
		}
	}
	return nil
}

func checkHeader(fields []string, suites []Suite) error {
	if len(fields) < len(fixedColumns) || !slices.Equal(fields[:len(fixedColumns)], fixedColumns) {
		return fmt.Errorf("header %q: want it to start with %s", strings.Join(fields, " "), strings.Join(fixedColumns, " "))
	}
	var names []string
	for _, s := range suites {
		names = append(names, s.Name)
	}
	if got := fields[len(fixedColumns):]; !slices.Equal(got, names) {
		return fmt.Errorf("suite columns %s, want %s (suites.go)", strings.Join(got, " "), strings.Join(names, " "))
	}
	return nil
}

// checkPackages wants every package to hold exactly one "*": the first package's
// "*" is what is looked up, so the others are the same build of the same kernel.
func checkPackages(pkgs []string) error {
	for _, p := range pkgs {
		if strings.Count(p, "*") != 1 {
			return fmt.Errorf("package %q: want exactly one * for the build", p)
		}
		if !debName.MatchString(strings.Replace(p, "*", "0", 1)) {
			return fmt.Errorf("package %q: not a Debian package name", p)
		}
	}
	return nil
}

var debName = regexp.MustCompile(`^[a-z0-9][a-z0-9.+-]+$`)

// pattern turns a package column into a regexp matching the archive's package
// names; the one group is the build. A build never holds a "-", so that the row
// for linux-image-6.1.0-*-amd64 does not also pick linux-image-6.1.0-*-cloud-amd64.
func pattern(pkg string) *regexp.Regexp {
	before, after, _ := strings.Cut(pkg, "*")
	return regexp.MustCompile("^" + regexp.QuoteMeta(before) + "([0-9][^-]*)" + regexp.QuoteMeta(after) + "$")
}

// Select returns the rows whose whole kernel name matches re ("" keeps all):
// "6.1" is that row alone, "6.1|6.12" both.
func (m *Matrix) Select(re string) ([]Kernel, error) {
	if re == "" {
		return m.Kernels, nil
	}
	r, err := regexp.Compile("^(?:" + re + ")$")
	if err != nil {
		return nil, fmt.Errorf("kernel filter: %w", err)
	}
	var out []Kernel
	for _, k := range m.Kernels {
		if r.MatchString(k.Name) {
			out = append(out, k)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("kernel filter %q matches no kernel of the matrix", re)
	}
	return out, nil
}
