# mesh-cni. Most targets need root (network namespaces, BPF, cgroups).
SHELL := /bin/bash
empty :=
space := $(empty) $(empty)
GO ?= go
BIN := $(CURDIR)/bin
TOOLS := $(BIN)/tools
# Tests and the demo take prebuilt binaries from here instead of building their own.
export MESH_CNI_BIN_DIR := $(BIN)

.PHONY: all build image deps peers test test-unit e2e-node demo generate check-generated lint bench fuzz fuzz-short clean

all: build

# The product binaries, the reference proxy, and the reference CNI plugins the
# tests and the demo use as the node's primary network and chain after mesh-cni
# (versions from go.mod; test/harness's ReferencePlugins is the same list).
CNI_PLUGINS := main/bridge main/ptp main/ipvlan main/macvlan ipam/host-local main/loopback \
	meta/portmap meta/bandwidth meta/tuning
build:
	@mkdir -p $(BIN)
	$(GO) build -o $(BIN)/ ./cmd/mesh-cni ./cmd/mesh-agent ./test/cmd/refproxy ./test/cmd/ztunnel
	$(GO) build -o $(BIN)/ $(addprefix github.com/containernetworking/plugins/plugins/,$(CNI_PLUGINS))

# OCI images, built without a container daemon or a registry (hack/image, with
# go-containerregistry) from static builds of the binaries: the agent image
# (mesh-agent with mesh-cni inside) and the node tests' images (reference proxy,
# echo client and server, pause). Each is an OCI layout tar in bin/image that
# `ctr images import` accepts, with its manifest digest in <name>.tar.digest.
# Reproducible: the same sources and Go toolchain give the same digests
# (-trimpath, no VCS stamp: a commit that changes no source keeps them).
AGENT_IMAGE ?= ghcr.io/mesh-cni/mesh-agent
TEST_IMAGE_REPO ?= mesh-cni.test
IMAGE_TAG ?= dev
IMG := cd hack/image && $(GO) run . -arch $$($(GO) env GOARCH)
image:
	@mkdir -p $(BIN)/static $(BIN)/image
	CGO_ENABLED=0 $(GO) build -trimpath -buildvcs=false -o $(BIN)/static/ ./cmd/mesh-cni ./cmd/mesh-agent \
		./test/cmd/refproxy ./test/cmd/echoserver ./test/cmd/echoclient ./test/cmd/pause
	$(IMG) -out $(BIN)/image/mesh-agent.tar -ref $(AGENT_IMAGE):$(IMAGE_TAG) -entrypoint /usr/local/bin/mesh-agent \
		-add $(BIN)/static/mesh-agent=/usr/local/bin/mesh-agent -add $(BIN)/static/mesh-cni=/usr/local/bin/mesh-cni
	@for b in refproxy echoserver echoclient pause; do \
		echo "image $(TEST_IMAGE_REPO)/$$b:$(IMAGE_TAG)"; \
		( $(IMG) -out $(BIN)/image/$$b.tar -ref $(TEST_IMAGE_REPO)/$$b:$(IMAGE_TAG) -entrypoint /usr/local/bin/$$b \
			-add $(BIN)/static/$$b=/usr/local/bin/$$b ) >/dev/null || exit 1; \
	done

# The fast suite: packages whose tests need neither root nor a peer built from
# modules, in-process against real sockets; about a minute. As a user, the few
# tests that need root skip (MESH_CNI_BIN_DIR is unset for that); as root, as
# in CI, they run. .ci/run runs it first. Of the data path (internal/redirect,
# whose other tests send traffic through pods and run in make test), the tests
# that run its programs' decisions without traffic (BPF_PROG_TEST_RUN) and its
# pure ones; TestUnitRedirectTestsExist (hack/) holds UNIT_REDIRECT to
# tests that exist.
UNIT_PKGS := ./internal/agent/... ./internal/agentcli/... ./internal/cniplugin/... \
	./internal/cniinstall/... ./internal/enroll/... ./internal/podstore/... ./internal/runtimecni/... \
	./internal/hostproc/... ./internal/keylock/... ./internal/netns/... ./internal/atomicfile/... ./internal/gaterpc/... ./pkg/... ./install/kubernetes/... ./hack/ \
	./tools/... ./test/fixtures/
UNIT_REDIRECT := TestLookupDecisions TestSecurityFigures TestSettingsValidate TestSettingsRoundTrip TestLPMKeyLayout TestParseCgroup2Mount
test-unit:
	MESH_CNI_BIN_DIR= $(GO) test -short -count=1 $(UNIT_PKGS)
	MESH_CNI_BIN_DIR= $(GO) test -short -count=1 -run '^($(subst $(space),|,$(strip $(UNIT_REDIRECT))))$$' ./internal/redirect/

# The Debian packages of hack/packages.txt (the README's list) that are not
# installed yet; nothing when all are.
deps:
	@bash hack/deps.sh hack/packages.txt

# The real peers the suite runs, built from Go modules into /var/cache/mesh-cni
# before any test's clock starts (about half an hour cold, then cached); the
# test targets take their directories from hack/peers.sh's exports.
PEERS := peers="$$(bash hack/peers.sh)" && eval "$$peers"
peers:
	@$(PEERS) && env | grep '^MESH_CNI_.*_BIN_DIR=' | grep -v '^MESH_CNI_BIN_DIR='

# The whole suite, as root, on the real kernel: first the packages and the
# peers it needs (a first run on a fresh machine installs and builds them).
# ip netns makes /run/netns a shared mount point on its first use, before any
# test mounts a namespace there (test/k8s's istio-cni needs it shared).
test: deps build
	@echo "== the tests' peers (hack/peers.sh: built once into /var/cache/mesh-cni), then go test"
	ip netns add mesh-cni-make-test && ip netns delete mesh-cni-make-test
	$(PEERS) && $(GO) test -count=1 -timeout 40m ./...

# The kernel matrix (tools/kernels/matrix.txt): each kernel booted in a QEMU VM,
# internal/redirect and a subset of test/e2e run inside it, one summary line per
# kernel; any result other than the matrix's, failure or pass, fails the target.
# Kernels and apt state are cached in KERNELS_CACHE, results go to
# bin/kernels/<kernel>/. KERNELS='6.1|6.12' runs only those rows.
KERNELS_CACHE ?= /var/cache/mesh-cni/kernels
KERNELS ?=
.PHONY: test-kernels
test-kernels: deps build
	@bash hack/deps.sh hack/packages-kernels.txt
	$(GO) run ./tools/cmd/kernels -cache $(KERNELS_CACHE) -out $(BIN)/kernels -bin $(BIN) -kernels '$(KERNELS)'

# The node test alone (test/node; make test runs it too): a real node on this
# machine (kubelet, containerd with runc, kube-proxy and the control plane, all
# built from modules and cached), the install and uninstall commands of docs/install.md
# run as written, then its measured times into docs/benchmarks.md's node
# section, leaving the rest of the report as it is.
e2e-node: deps build
	@rm -rf $(BIN)/bench-node && mkdir -p $(BIN)/bench-node
	$(PEERS) && MESH_BENCH_OUT=$(BIN)/bench-node $(GO) test -count=1 -v -run '^Test(Node|ReleaseImageReproducible|ReadmeInstall)$$' -timeout 40m ./test/node/
	$(GO) run ./tools/cmd/benchreport -in $(BIN)/bench-node -only node -out docs/benchmarks.md -figs docs/bench

# A simulated node: real namespaces, the real chain and agent, narrated.
demo: deps build
	@MESH_DEMO=1 $(GO) test -count=1 -v -run '^TestDemo$$' ./test/demo/ | grep -v -e '^=== RUN' -e '^--- PASS' -e '^PASS$$' -e '^ok '

# The same node in ambient mode: no proxy in any pod, one node proxy (in
# ztunnel's role) takes every pod from the agent over ZDS.
.PHONY: demo-ambient
demo-ambient: deps build
	@MESH_DEMO=1 $(GO) test -count=1 -v -run '^TestDemoAmbient$$' ./test/demo/ | grep -v -e '^=== RUN' -e '^--- PASS' -e '^PASS$$' -e '^ok '

# Generated code is committed; CI runs check-generated to prove it is current.
# Tool versions are pinned: protoc-gen-go, protoc-gen-go-grpc and bpf2go by
# go.mod's tool directives, protoc (3.21.12) and clang (14) by Debian 12.
generate: deps
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

# golangci-lint, from its own module (hack/lint) so its dependencies stay out of
# the product's go.mod, runs the project's own rules (.golangci.yml).
$(TOOLS)/golangci-lint: hack/lint/go.mod hack/lint/go.sum
	@mkdir -p $(TOOLS)
	cd hack/lint && $(GO) build -o $@ github.com/golangci/golangci-lint/v2/cmd/golangci-lint

lint: $(TOOLS)/golangci-lint
	@bad=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$bad" ]; then echo "gofmt needed: $$bad"; exit 1; fi
	$(GO) vet ./...
	$(GO) tool staticcheck ./...
	$(TOOLS)/golangci-lint run ./...
	cd hack/image && $(GO) vet ./... && $(GO) test -count=1 ./...
	cd install/helm && $(GO) vet ./... && $(GO) test -count=1 ./...

# The performance suite, as root, on this one machine: every benchmark in
# test/bench, each variant side by side with its baseline (MESH_BENCH_QUICK=1
# for a quick check that it all runs), raw samples into bin/bench, then
# docs/benchmarks.md and its figures in docs/bench from those samples; the
# report gives how long each benchmark took and the machine's load meanwhile.
bench: deps build
	@rm -rf $(BIN)/bench && mkdir -p $(BIN)/bench
	set -o pipefail; $(PEERS) && MESH_BENCH_OUT=$(BIN)/bench $(GO) test -run '^$$' -bench . -benchtime 1x -timeout 60m ./test/bench/ 2>&1 | tee $(BIN)/bench/bench.txt
	$(GO) run ./tools/cmd/benchreport -in $(BIN)/bench -out docs/benchmarks.md -figs docs/bench

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
