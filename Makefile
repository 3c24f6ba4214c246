# mesh-cni. Most targets need root (network namespaces, BPF, cgroups).
SHELL := /bin/bash
GO ?= go
BIN := $(CURDIR)/bin
TOOLS := $(BIN)/tools
export MESH_CNI_BIN_DIR ?= $(BIN)

BINARIES := mesh-cni mesh-agent
TEST_BINARIES := refproxy mesh-demo

.PHONY: all build test test-short demo generate check-generated lint bench fuzz clean

all: build

build:
	@mkdir -p $(BIN)
	$(GO) build -o $(BIN)/ ./cmd/mesh-cni ./cmd/mesh-agent ./test/cmd/refproxy ./test/cmd/mesh-demo
	$(GO) build -o $(BIN)/cni/ github.com/containernetworking/plugins/plugins/main/bridge \
		github.com/containernetworking/plugins/plugins/ipam/host-local \
		github.com/containernetworking/plugins/plugins/main/loopback \
		github.com/containernetworking/plugins/plugins/meta/portmap

# The whole suite, as root, on the real kernel.
test: build
	$(GO) test -count=1 -timeout 40m ./...

demo: build
	$(BIN)/mesh-demo --bin-dir $(BIN)

# Generated code is committed; CI runs check-generated to prove it is current.
# Tool versions are pinned: protoc-gen-go and protoc-gen-go-grpc and bpf2go by
# go.mod's tool directives, protoc (3.21.12) and clang (14) by Debian 12.
generate:
	@mkdir -p $(TOOLS)
	GOBIN=$(TOOLS) $(GO) install google.golang.org/protobuf/cmd/protoc-gen-go google.golang.org/grpc/cmd/protoc-gen-go-grpc
	protoc --plugin=protoc-gen-go=$(TOOLS)/protoc-gen-go --plugin=protoc-gen-go-grpc=$(TOOLS)/protoc-gen-go-grpc \
		--go_out=. --go_opt=paths=source_relative --go-grpc_out=. --go-grpc_opt=paths=source_relative \
		$$(find . -name '*.proto' -not -path './bin/*' -not -path './.git/*' | sed 's|^\./||' | sort)
	$(GO) generate ./...

check-generated: generate
	@if [ -n "$$(git status --porcelain --untracked-files=all -- '*.go' '*.o' '*.h' '*.proto')" ]; then \
		echo "generated code is stale: run 'make generate' and commit the result:"; \
		git status --porcelain --untracked-files=all -- '*.go' '*.o' '*.h' '*.proto'; \
		git diff --stat; exit 1; \
	fi
	@echo "generated code is current"

lint:
	@bad=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$bad" ]; then echo "gofmt needed: $$bad"; exit 1; fi
	$(GO) vet ./...
	$(GO) tool staticcheck ./...

bench: build
	$(GO) test -run '^$$' -bench . -benchtime 200x -timeout 60m ./test/bench/...

fuzz:
	@echo "see issue: fuzz targets" 

clean:
	rm -rf $(BIN)
