# mesh-cni. Most targets need root (network namespaces, BPF, cgroups).
SHELL := /bin/bash
GO ?= go
BIN := $(CURDIR)/bin
TOOLS := $(BIN)/tools
# Tests and the demo take prebuilt binaries from here instead of building their own.
export MESH_CNI_BIN_DIR := $(BIN)

.PHONY: all build test demo generate check-generated lint bench fuzz fuzz-short clean

all: build

# The product binaries, the reference proxy, and the reference CNI plugins the
# tests and the demo use as the node's primary network (versions from go.mod).
build:
	@mkdir -p $(BIN)
	$(GO) build -o $(BIN)/ ./cmd/mesh-cni ./cmd/mesh-agent ./test/cmd/refproxy
	$(GO) build -o $(BIN)/ github.com/containernetworking/plugins/plugins/main/bridge \
		github.com/containernetworking/plugins/plugins/ipam/host-local \
		github.com/containernetworking/plugins/plugins/main/loopback \
		github.com/containernetworking/plugins/plugins/meta/portmap

# The whole suite, as root, on the real kernel.
test: build
	$(GO) test -count=1 -timeout 40m ./...

# A simulated node: real namespaces, the real chain and agent, narrated.
demo: build
	@MESH_DEMO=1 $(GO) test -count=1 -v -run '^TestDemo$$' ./test/demo/ | grep -v -e '^=== RUN' -e '^--- PASS' -e '^PASS$$' -e '^ok '

# The same node in ambient mode: no proxy in any pod, one node proxy (in
# ztunnel's role) takes every pod from the agent over ZDS.
.PHONY: demo-ambient
demo-ambient: build
	@MESH_DEMO=1 $(GO) test -count=1 -v -run '^TestDemoAmbient$$' ./test/demo/ | grep -v -e '^=== RUN' -e '^--- PASS' -e '^PASS$$' -e '^ok '

# Generated code is committed; CI runs check-generated to prove it is current.
# Tool versions are pinned: protoc-gen-go, protoc-gen-go-grpc and bpf2go by
# go.mod's tool directives, protoc (3.21.12) and clang (14) by Debian 12.
generate:
	@mkdir -p $(TOOLS)
	GOBIN=$(TOOLS) $(GO) install google.golang.org/protobuf/cmd/protoc-gen-go google.golang.org/grpc/cmd/protoc-gen-go-grpc
	protoc --plugin=protoc-gen-go=$(TOOLS)/protoc-gen-go --plugin=protoc-gen-go-grpc=$(TOOLS)/protoc-gen-go-grpc \
		--go_out=. --go_opt=paths=source_relative --go-grpc_out=. --go-grpc_opt=paths=source_relative \
		$$(find . -name '*.proto' -not -path './bin/*' -not -path './.git/*' | sed 's|^\./||' | sort)
	$(GO) generate ./...

check-generated: generate
	@if [ -n "$$(git status --porcelain --untracked-files=all)" ]; then \
		echo "generated code is stale: run 'make generate' and commit the result:"; \
		git status --porcelain --untracked-files=all; git diff --stat; exit 1; \
	fi
	@echo "generated code is current"

lint:
	@bad=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$bad" ]; then echo "gofmt needed: $$bad"; exit 1; fi
	$(GO) vet ./...
	$(GO) tool staticcheck ./...

# The performance suite (issue #9), as root, on this one machine: every benchmark
# in test/bench (about 10 minutes on 2 CPUs; MESH_BENCH_QUICK=1 for a quick check
# that it all runs), raw samples into bin/bench, then docs/benchmarks.md and its
# figures in docs/bench from those samples.
bench: build
	@rm -rf $(BIN)/bench && mkdir -p $(BIN)/bench
	set -o pipefail; MESH_BENCH_OUT=$(BIN)/bench $(GO) test -run '^$$' -bench . -benchtime 1x -timeout 60m ./test/bench/ 2>&1 | tee $(BIN)/bench/bench.txt
	$(GO) run ./test/bench/cmd/benchreport -in $(BIN)/bench -out docs/benchmarks.md -figs docs/bench

# Every fuzz target for FUZZTIME each (11 targets: 5m each is about an hour);
# `make test` already replays the committed seeds and crashers.
FUZZTIME ?= 5m
fuzz: build
	hack/fuzz.sh $(FUZZTIME)

# The short run CI does.
fuzz-short: build
	hack/fuzz.sh 10s

clean:
	rm -rf $(BIN)
