// Command benchreport writes docs/benchmarks.md and its figures from the raw
// results the benchmarks in test/bench wrote (make bench runs both). Run it from
// the module root:
//
//	go run ./tools/cmd/benchreport [-in bin/bench] [-out docs/benchmarks.md] [-figs docs/bench]
//
// With -only NAME it rewrites just that result's section of the report (the
// node test's, from make e2e-node) and leaves the rest as it is.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/mesh-cni/mesh-cni/test/bench/results"
	"github.com/mesh-cni/mesh-cni/tools/benchreport"
)

func main() {
	os.Exit(run(context.Background(), os.Args[1:], os.Stderr))
}

func run(ctx context.Context, args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet("benchreport", flag.ContinueOnError)
	fs.SetOutput(stderr)
	in := fs.String("in", "", "results directory (default $"+results.EnvOut+", else "+results.DefaultOut+" in the module)")
	out := fs.String("out", "docs/benchmarks.md", "report to write (relative to the module root)")
	figs := fs.String("figs", "docs/bench", "directory for the figures (relative to the module root)")
	format := fs.String("format", "svg", "figure format: svg or png")
	only := fs.String("only", "", "rewrite only this result's section of the report")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	root, err := moduleRoot(ctx)
	if err != nil {
		fmt.Fprintf(stderr, "benchreport: %v\n", err)
		return 1
	}
	opts := benchreport.Options{In: *in, Out: abs(root, *out), FigDir: abs(root, *figs), Format: *format}
	if opts.In == "" {
		opts.In = results.Out(root)
	} else {
		opts.In = abs(root, opts.In)
	}
	if *only != "" {
		if err := benchreport.UpdateSection(opts, *only); err != nil {
			fmt.Fprintf(stderr, "benchreport: %v\n", err)
			return 1
		}
		fmt.Fprintf(stderr, "benchreport: rewrote the %s section of %s from %s\n", *only, opts.Out, opts.In)
		return 0
	}
	if err := benchreport.Generate(opts); err != nil {
		fmt.Fprintf(stderr, "benchreport: %v\n", err)
		return 1
	}
	fmt.Fprintf(stderr, "benchreport: wrote %s and figures in %s from %s\n", opts.Out, opts.FigDir, opts.In)
	return 0
}

func abs(root, p string) string {
	if filepath.IsAbs(p) {
		return p
	}
	return filepath.Join(root, p)
}

// moduleRoot is the directory of the go.mod governing the working directory.
func moduleRoot(ctx context.Context) (string, error) {
	outb, err := exec.CommandContext(ctx, "go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %w", err)
	}
	gomod := strings.TrimSpace(string(outb))
	if gomod == "" || gomod == os.DevNull {
		return "", fmt.Errorf("not inside a Go module (run from the mesh-cni checkout)")
	}
	return filepath.Dir(gomod), nil
}
