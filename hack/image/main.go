// Command image builds an OCI image from files on disk, without a container
// daemon or a registry, and writes it as an OCI image layout in a tar file that
// `ctr images import` accepts. The output is reproducible: the same files give
// the same bytes and the same digest (one layer, entries sorted, fixed owner,
// modes and timestamps, a fixed creation time in the config).
//
//	go run . -out bin/image/mesh-agent.tar -ref ghcr.io/mesh-cni/mesh-agent:dev \
//		-add bin/static/mesh-agent=/usr/local/bin/mesh-agent \
//		-add bin/static/mesh-cni=/usr/local/bin/mesh-cni \
//		-entrypoint /usr/local/bin/mesh-agent
//
// It prints the manifest digest (sha256:...) on stdout and writes it next to
// the tar as <out>.digest, for manifests that pin the image by digest. The
// layout names the image twice, by -ref and by repository@digest, so that
// `ctr images import` makes it resolvable by the digest a pod spec pins.
//
// It is a module of its own so that go-containerregistry stays out of the
// product's module graph.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"strings"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// fileList collects repeated -add SRC=DST flags.
type fileList []File

func (l *fileList) String() string { return fmt.Sprint(*l) }

func (l *fileList) Set(v string) error {
	src, dst, ok := strings.Cut(v, "=")
	if !ok || src == "" || dst == "" {
		return fmt.Errorf("want SRC=DST, got %q", v)
	}
	*l = append(*l, File{Src: src, Dst: dst})
	return nil
}

// labelMap collects repeated -label KEY=VALUE flags.
type labelMap map[string]string

func (m labelMap) String() string { return fmt.Sprint(map[string]string(m)) }

func (m labelMap) Set(v string) error {
	k, val, ok := strings.Cut(v, "=")
	if !ok || k == "" {
		return fmt.Errorf("want KEY=VALUE, got %q", v)
	}
	if _, dup := m[k]; dup {
		return fmt.Errorf("label %q given twice", k)
	}
	m[k] = val
	return nil
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("image", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var spec Spec
	var files fileList
	out := fs.String("out", "", "the OCI layout tar to write")
	fs.StringVar(&spec.Ref, "ref", "", "image name the tar carries (what `ctr images import` names it)")
	fs.Var(&files, "add", "SRC=DST: put file SRC at absolute path DST in the image, mode 0755 (repeatable)")
	labels := labelMap{}
	fs.Var(labels, "label", "KEY=VALUE: a label of the image config, e.g. org.opencontainers.image.version=v0.1.0 (repeatable)")
	entrypoint := fs.String("entrypoint", "", "entrypoint, space separated")
	fs.StringVar(&spec.Arch, "arch", runtime.GOARCH, "the image's architecture (the binaries' GOARCH)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if *out == "" || spec.Ref == "" || len(files) == 0 || fs.NArg() != 0 {
		fmt.Fprintln(stderr, "image: -out, -ref and at least one -add are required; no arguments")
		return 2
	}
	spec.Files = files
	if len(labels) > 0 {
		spec.Labels = labels
	}
	spec.Entrypoint = strings.Fields(*entrypoint)
	digest, err := Build(ctx, spec, *out)
	if err != nil {
		fmt.Fprintf(stderr, "image: %v\n", err)
		return 1
	}
	if err := os.WriteFile(*out+".digest", []byte(digest+"\n"), 0o644); err != nil {
		fmt.Fprintf(stderr, "image: %v\n", err)
		return 1
	}
	fmt.Fprintln(stdout, digest)
	return 0
}
