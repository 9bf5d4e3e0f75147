# gpudra — one place for the versions the project is tested against.
# Test a newer Kubernetes the same way: make test KUBE_VERSION=v1.36.3 (its Go module is generated from that release).
KUBE_VERSION ?= v1.35.4
ETCD_VERSION ?= v3.6.16
PYTHON ?= python3
VENV ?= .venv
PYTEST_ARGS ?=
BENCH_ARGS ?=

export KUBE_VERSION ETCD_VERSION
BIN := $(VENV)/bin

.PHONY: help venv allocator kube-bin helm-bin chart-schema chart-package chart-push sbom sbom-images syft actionlint release-check ci debian-packages cdi-schema cdi-tools metadata-check nvidia-ctk mock-nvml mock-nvidia-smi mock-mps-control containerd registry dra-example-driver promtool test unit typecheck demo demo-down bench fuzz explain-diff chaos protos wheels images image-operator image-agent base-image images-multiarch images-push mock-nvml-arm64 previous-release clean
help:
	@echo "make demo       local control plane with simulated GPU nodes (Ctrl-C stops it)"
	@echo "make test       the whole suite against a real Kubernetes $(KUBE_VERSION) control plane"
	@echo "make unit       unit tests only (no cluster)"
	@echo "make typecheck  mypy over the operator, the driver and the benches (CI runs it)"
	@echo "make allocator  build gpudra-allocator (Kubernetes' own DRA allocator and CEL per release) into the package"
	@echo "make kube-bin   fetch or build etcd $(ETCD_VERSION) + Kubernetes $(KUBE_VERSION) binaries"
	@echo "make cdi-schema fetch the pinned official CDI JSON schema the tests validate CDI specs against"
	@echo "make cdi-tools  build cdi-validate (hack/cdi-tools): the official CDI Go library the tests check every CDI spec with"
	@echo "make metadata-check  build the official device metadata decoders of 1.36 and 1.37 (hack/metadata-check) the tests read the agent's files with"
	@echo "make nvidia-ctk build NVIDIA's nvidia-ctk and nvidia-cdi-hook (pinned, from the Go module proxy) the tests compare specs with"
	@echo "make mock-nvml  build the mock libnvidia-ml.so.1 (tests/mocknvml) the tests run pynvml and nvidia-ctk against"
	@echo "make mock-nvidia-smi mock-mps-control  the fake driver roots' nvidia-smi and nvidia-cuda-mps-control (tests/mocknvml)"
	@echo "make registry   build CNCF Distribution's registry (pinned, from the Go module proxy) the getting-started test pushes to"
	@echo "make dra-example-driver  build Kubernetes' reference DRA driver (pinned, from the Go module proxy) that make bench times the agent against"
	@echo "make promtool   build Prometheus' promtool (pinned, from the Go module proxy) the tests check the alerts and the dashboard's PromQL with"
	@echo "make bench      benchmarks (not part of make test; BENCH_ARGS=\"gc prepare_latency\" runs some)"
	@echo "make fuzz       the tenant-input fuzz suite (tests/fuzz) with many more examples than make test runs (FUZZ_EXAMPLES=...)"
	@echo "make previous-release  the previous release's images and chart (hack/previous-release pins it), for the upgrade tests"
	@echo "make chaos      pods with claims created and deleted while the API server, etcd, agents, operator replicas and kubelets restart, one node a real kubelet on containerd + runc (CHAOS_DURATION=600 s, CHAOS_SEED=...); docs/chaos.md"
	@echo "make explain-diff  gpudra explain vs the real scheduler on 300 random cases (EXPLAIN_SEED=..., EXPLAIN_CASES=...)"
	@echo "make protos     regenerate the kubelet plugin's gRPC stubs"
	@echo "make wheels     the wheels (linux amd64/arm64 and macOS arm64, each with its gpudra-allocator; a pure one) and the sdist, in dist/"
	@echo "make images     build the operator and agent images (podman or docker; cached by content: hack/images.sh; PLATFORM=linux/arm64)"
	@echo "make base-image build the stand-in Python base the images use where the official one cannot be pulled"
	@echo "make images-multiarch  both images for linux/amd64 and linux/arm64 (emulated), each pair one manifest list (PLATFORMS=...)"
	@echo "make images-push       make images-multiarch, then push the manifest lists with all their images (IMAGE_REGISTRY=..., PUSH_FLAGS=...)"
	@echo "make chart-package  the Helm chart as a .tgz in build/chart (CHART_VERSION=..., default Chart.yaml's)"
	@echo "make chart-push CHART_REGISTRY=oci://host/path  push it as an OCI artifact (CHART_PUSH_FLAGS=\"--ca-file ca.crt\")"
	@echo "make chart-schema  copy the GpuDraConfig CRD's spec schema into the chart's values.schema.json"
	@echo "make sbom       a CycloneDX SBOM of the Python distribution in dist/ (docs/releasing.md)"
	@echo "make sbom-images  a CycloneDX SBOM of each image per platform in dist/ (Debian, Python and Go packages; by syft; PLATFORMS=..., SBOM_IMAGES=agent)"
	@echo "make syft       build Anchore's syft (pinned, from the Go module proxy) that make sbom-images scans the images with"
	@echo "make actionlint check .github/workflows with rhysd/actionlint (pinned, from the Go module proxy)"
	@echo "make release-check  pyproject.toml, Chart.yaml and the tag (RELEASE_TAG, default \$$GITHUB_REF_NAME) name one version"
	@echo "make ci         what CI runs: .ci/run (as root; through sudo when not)"
	@echo "make debian-packages  the Debian packages the builds and tests need (hack/debian-packages.sh)"

venv: $(VENV)/.installed $(VENV)/.bytecode-opt2
# The product (editable, with its test extras) and the development package (hack/python/gpudra_dev:
# the local cluster, the demo, the kubelet stand-in), which no wheel or image carries.
$(VENV)/.installed: pyproject.toml hack/python/pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c 'import sys; assert sys.version_info >= (3, 11), "gpudra needs Python >= 3.11"'
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]' -e hack/python
	@touch $@

# The agent runs at optimization level 2 (PYTHONOPTIMIZE, the DaemonSet's env, which the local
# harness applies too): bytecode for it of the installed dependencies, as the agent image has, or
# every agent the tests start compiles them at start (gpudra's own modules, editable, it compiles
# as before: $PYTHONDONTWRITEBYTECODE keeps caches out of the source tree).
$(VENV)/.bytecode-opt2: $(VENV)/.installed
	$(BIN)/python -OO -m compileall -q -j 0 "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	@touch $@

# gpudra-allocator (operator/gpudra-allocator: Kubernetes' own DRA allocator and CEL, one binary per
# supported release), built for this machine, cached under ~/.cache/gpudra/gpudra-allocator, and
# copied into the package (operator/gpudra_operator/bin, ignored by git) where the editable install
# finds it: explain, the operator's class counts, the tests and the demo run it.
allocator:
	@hack/allocator-bin.sh --into operator/gpudra_operator/bin >/dev/null

kube-bin:
	@hack/kube-bin.sh

helm-bin:
	@hack/helm-bin.sh

# The previous release (hack/previous-release pins its commit): its images (tag previous-<sha12>) and
# chart, from a git worktree under the cache; what the Helm lifecycle test upgrades from (docs/upgrade.md).
previous-release:
	@hack/previous-release.sh

# From the Go module proxy (GOPROXY), checked against the SHA-256 pinned in tests/cdispec.py,
# cached under ~/.cache/gpudra/cdi-schema; the tests would fetch it on first use too.
cdi-schema: venv
	@$(BIN)/python tests/cdispec.py >/dev/null

# Built from the pinned hack/cdi-tools module, cached under ~/.cache/gpudra/cdi-tools/<hash of its sources>.
cdi-tools:
	@hack/cdi-tools-bin.sh

# One per release, built from the pinned hack/metadata-check/v1.<minor> modules, cached under
# ~/.cache/gpudra/metadata-check-v1.<minor>/<hash of its sources>.
metadata-check:
	@hack/metadata-check-bin.sh >/dev/null

# Built with cgo from the Go module proxy, cached under ~/.cache/gpudra/nvidia-ctk/<version>.
nvidia-ctk:
	@hack/nvidia-ctk-bin.sh

# The mock NVML (a C libnvidia-ml.so.1 answering from an inventory written from a profile) that the
# tests load into the real pynvml and nvidia-ctk; built here, never committed (build/ is ignored).
MOCK_NVML := build/mock-nvml/libnvidia-ml.so
MOCK_NVML_SRC := tests/mocknvml/mock_nvml.c tests/mocknvml/mock_nvml.h tests/mocknvml/mock_state.h
mock-nvml: $(MOCK_NVML)
$(MOCK_NVML): $(MOCK_NVML_SRC)
	@command -v $(CC) >/dev/null || { echo "make mock-nvml: no C compiler ($(CC)) found: apt-get install gcc" >&2; exit 1; }
	@mkdir -p $(@D)
	$(CC) -Wall -Wextra -Werror -O2 -fPIC -shared -Wl,-soname,libnvidia-ml.so.1 -o $@ tests/mocknvml/mock_nvml.c -ldl -lpthread

# The same for arm64 (cross-compiled on another machine): tests/integration/test_images_arm64.py mounts
# it into the arm64 agent image, run under emulation. Cross compiler: hack/debian-packages.sh.
MOCK_NVML_ARM64 := build/mock-nvml-arm64/libnvidia-ml.so
ARM64_CC ?= $(if $(filter aarch64 arm64,$(shell uname -m)),$(CC),aarch64-linux-gnu-gcc)
mock-nvml-arm64: $(MOCK_NVML_ARM64)
$(MOCK_NVML_ARM64): $(MOCK_NVML_SRC)
	@command -v $(ARM64_CC) >/dev/null || { echo "make mock-nvml-arm64: no arm64 C compiler ($(ARM64_CC)): apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross (hack/debian-packages.sh)" >&2; exit 1; }
	@mkdir -p $(@D)
	$(ARM64_CC) -Wall -Wextra -Werror -O2 -fPIC -shared -Wl,-soname,libnvidia-ml.so.1 -o $@ tests/mocknvml/mock_nvml.c -ldl -lpthread

# The fake driver roots' nvidia-smi: static (CDI mounts it into containers without the host's libc),
# no NVML; make_driver_root installs it with the root's inventory appended.
MOCK_NVIDIA_SMI := build/mock-nvml/nvidia-smi
mock-nvidia-smi: $(MOCK_NVIDIA_SMI)
MOCK_TOOL_HEADERS := tests/mocknvml/mock_state.h tests/mocknvml/mock_inventory.h
$(MOCK_NVIDIA_SMI): tests/mocknvml/nvidia_smi.c $(MOCK_TOOL_HEADERS)
	@command -v $(CC) >/dev/null || { echo "make mock-nvidia-smi: no C compiler ($(CC)) found: apt-get install gcc libc6-dev" >&2; exit 1; }
	@mkdir -p $(@D)
	$(CC) -Wall -Wextra -Werror -O2 -static -o $@ $<

# The fake driver roots' nvidia-cuda-mps-control (MPS control daemon and client, no CUDA): static
# for the same reason; make_driver_root installs it with the root's inventory appended.
MOCK_MPS_CONTROL := build/mock-nvml/nvidia-cuda-mps-control
mock-mps-control: $(MOCK_MPS_CONTROL)
$(MOCK_MPS_CONTROL): tests/mocknvml/mps_control.c $(MOCK_TOOL_HEADERS)
	@command -v $(CC) >/dev/null || { echo "make mock-mps-control: no C compiler ($(CC)) found: apt-get install gcc libc6-dev" >&2; exit 1; }
	@mkdir -p $(@D)
	$(CC) -Wall -Wextra -Werror -O2 -static -o $@ $<

# containerd, its runc shim, ctr and crictl for tests/e2e/test_real_runtime.py, built from the Go
# module proxy, cached under ~/.cache/gpudra/containerd/<version>.
containerd:
	@hack/containerd-bin.sh

# CNCF Distribution's registry for tests/e2e/test_getting_started.py (the README's images pushed and
# pulled as written), built from the Go module proxy, cached under ~/.cache/gpudra/registry/<version>.
registry:
	@hack/registry-bin.sh

# Kubernetes' reference DRA driver (sigs.k8s.io/dra-example-driver's kubelet plugin) that
# bench/prepare_latency.py times beside the agent, built from the Go module proxy, cached under
# ~/.cache/gpudra/dra-example-driver/<version>.
dra-example-driver:
	@hack/dra-example-driver.sh

# Prometheus' promtool for tests/monitoring (the alerts' unit tests, the PromQL of the rules and the
# Grafana dashboard), built from the Go module proxy, cached under ~/.cache/gpudra/promtool/<version>.
promtool:
	@hack/promtool-bin.sh >/dev/null

test: venv allocator cdi-schema metadata-check mock-nvml mock-nvidia-smi mock-mps-control promtool
	@bin_dir="$$(hack/kube-bin.sh | tail -n 1)" && test -n "$$bin_dir" && \
	  helm="$$(hack/helm-bin.sh | tail -n 1)" && test -n "$$helm" && \
	  nvctk="$$(hack/nvidia-ctk-bin.sh | tail -n 1)" && test -n "$$nvctk" && \
	  cdi_tools="$$(hack/cdi-tools-bin.sh | tail -n 1)" && test -n "$$cdi_tools" && \
	  containerd_dir="$$(hack/containerd-bin.sh | tail -n 1)" && test -n "$$containerd_dir" && \
	  registry_dir="$$(hack/registry-bin.sh | tail -n 1)" && test -n "$$registry_dir" && \
	  promtool_dir="$$(hack/promtool-bin.sh | tail -n 1)" && test -n "$$promtool_dir" && \
	  actionlint_dir="$$(hack/actionlint-bin.sh | tail -n 1)" && test -n "$$actionlint_dir" && \
	  syft_dir="$$(hack/syft-bin.sh | tail -n 1)" && test -n "$$syft_dir" && \
	  images="$$(PLATFORM= IMAGE_REGISTRY=$(IMAGE_REGISTRY) IMAGE_TAG=$(IMAGE_TAG) hack/images.sh operator agent | tail -n 1)" && test -n "$$images" && \
	  GPUDRA_KUBE_BIN="$$bin_dir" GPUDRA_HELM="$$helm" GPUDRA_NVIDIA_CTK_DIR="$$nvctk" \
	  GPUDRA_CDI_TOOLS_DIR="$$cdi_tools" GPUDRA_CONTAINERD_DIR="$$containerd_dir" GPUDRA_REGISTRY_DIR="$$registry_dir" \
	  GPUDRA_PROMTOOL_DIR="$$promtool_dir" GPUDRA_ACTIONLINT_DIR="$$actionlint_dir" GPUDRA_SYFT_DIR="$$syft_dir" GPUDRA_TEST_OPERATOR_IMAGE="$${images%% *}" GPUDRA_TEST_AGENT_IMAGE="$${images##* }" $(BIN)/pytest $(PYTEST_ARGS)

unit: venv allocator cdi-schema cdi-tools metadata-check mock-nvml mock-nvidia-smi mock-mps-control promtool
	$(BIN)/pytest tests/unit $(PYTEST_ARGS)

# mypy, and the layering contracts in pyproject.toml ([tool.importlinter]).
typecheck: venv
	$(BIN)/mypy
	$(BIN)/lint-imports

demo: venv allocator mock-nvml
	@bin_dir="$$(hack/kube-bin.sh | tail -n 1)" && test -n "$$bin_dir" && \
	  GPUDRA_KUBE_BIN="$$bin_dir" $(BIN)/gpudra-dev demo

demo-down:
	@$(BIN)/gpudra-dev demo --down

# The scheduler bench's second control plane (consumable capacity) runs this release; its binaries
# are fetched or built once and cached by version, like the current release's.
BENCH_SCHED_NEXT_VERSION ?= v1.36.3
bench: venv allocator mock-nvml mock-nvidia-smi mock-mps-control
	@bin_dir="$$(hack/kube-bin.sh | tail -n 1)" && test -n "$$bin_dir" && \
	  next_bin_dir="$${BENCH_SCHED_NEXT_KUBE_BIN:-$$(KUBE_VERSION=$(BENCH_SCHED_NEXT_VERSION) hack/kube-bin.sh | tail -n 1)}" && \
	  test -n "$$next_bin_dir" && \
	  dra_example="$$(hack/dra-example-driver.sh | tail -n 1)" && test -n "$$dra_example" && \
	  containerd_dir="$$(hack/containerd-bin.sh | tail -n 1)" && test -n "$$containerd_dir" && \
	  GPUDRA_KUBE_BIN="$$bin_dir" BENCH_SCHED_NEXT_VERSION=$(BENCH_SCHED_NEXT_VERSION) \
	  BENCH_SCHED_NEXT_KUBE_BIN="$$next_bin_dir" GPUDRA_DRA_EXAMPLE_DIR="$$dra_example" \
	  GPUDRA_CONTAINERD_DIR="$$containerd_dir" $(BIN)/python -m bench $(BENCH_ARGS)

# The longer run of the fuzz suite over tenant input (make test runs it with the "ci" profile).
FUZZ_EXAMPLES ?= 5000
fuzz: venv allocator cdi-schema mock-nvml mock-nvidia-smi mock-mps-control
	@bin_dir="$$(hack/kube-bin.sh | tail -n 1)" && test -n "$$bin_dir" && \
	  GPUDRA_KUBE_BIN="$$bin_dir" GPUDRA_FUZZ_PROFILE=long GPUDRA_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) \
	  $(BIN)/pytest tests/fuzz $(PYTEST_ARGS)

# The larger run of tests/integration/test_explain_differential.py (make test runs 80 cases).
EXPLAIN_SEED ?= 2026
EXPLAIN_CASES ?= 300
explain-diff: venv allocator
	@bin_dir="$$(hack/kube-bin.sh | tail -n 1)" && test -n "$$bin_dir" && \
	  GPUDRA_KUBE_BIN="$$bin_dir" GPUDRA_EXPLAIN_SEED=$(EXPLAIN_SEED) GPUDRA_EXPLAIN_CASES=$(EXPLAIN_CASES) \
	  $(BIN)/pytest tests/integration/test_explain_differential.py -s --timeout 900 $(PYTEST_ARGS)

# Chaos under load (docs/chaos.md): a local cluster of its own whose API server, etcd, agents,
# operator replicas and kubelets restart at random while pods with claims come and go; prints the
# report and fails on any invariant violation. make test runs a short one (tests/integration/test_chaos.py).
# Its real node is tests/realruntime.py's (containerd + runc + the kubelet; root), hence tests/ on PYTHONPATH.
CHAOS_DURATION ?= 600
CHAOS_SEED ?=
chaos: venv allocator mock-nvml mock-nvidia-smi mock-mps-control containerd
	@bin_dir="$$(hack/kube-bin.sh | tail -n 1)" && test -n "$$bin_dir" && \
	  containerd_dir="$$(hack/containerd-bin.sh | tail -n 1)" && test -n "$$containerd_dir" && \
	  GPUDRA_KUBE_BIN="$$bin_dir" GPUDRA_CONTAINERD_DIR="$$containerd_dir" PYTHONPATH="$(CURDIR)/tests" \
	  CHAOS_DURATION=$(CHAOS_DURATION) CHAOS_SEED=$(CHAOS_SEED) $(BIN)/python -m gpudra_dev.chaos

# The kubelet plugin's gRPC stubs (committed) from driver/gpudra_driver/plugin/protos/.
protos:
	$(BIN)/pip install --quiet -e '.[dev]'
	PYTHON=$(BIN)/python hack/gen-protos.sh

# The distributions, by hack/wheels.sh, in dist/: a wheel per platform with its gpudra-allocator
# binaries (cross-built by hack/allocator-bin.sh, cached), the pure wheel the agent image installs,
# and the sdist. WHEEL_PLATFORMS picks some: linux-amd64 linux-arm64 darwin-arm64 any sdist.
WHEEL_PLATFORMS ?=
wheels:
	@hack/wheels.sh --out dist $(WHEEL_PLATFORMS)

# Container images (images/*.Dockerfile), by hack/images.sh: podman (with hack/podman/containers.conf)
# or docker (CONTAINER_ENGINE=podman|docker; default podman if installed). Skipped when an image of the
# same inputs (label io.gpudra.inputs) exists. Where the official python base cannot be pulled, on a
# stand-in from Debian packages (make base-image; or PYTHON_IMAGE=localhost/gpudra-python-base:bookworm).
# podman, runc, debootstrap: hack/debian-packages.sh. PLATFORM=linux/arm64 (or linux/amd64) builds for
# that architecture, tagged <tag>-arm64 when it is not this machine's, under qemu-user-static.
IMAGE_REGISTRY ?= ghcr.io/gpudra
IMAGE_TAG ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
PLATFORM ?=
images:
	@IMAGE_REGISTRY=$(IMAGE_REGISTRY) IMAGE_TAG=$(IMAGE_TAG) PLATFORM=$(PLATFORM) hack/images.sh operator agent
image-operator image-agent: image-%:
	@IMAGE_REGISTRY=$(IMAGE_REGISTRY) IMAGE_TAG=$(IMAGE_TAG) PLATFORM=$(PLATFORM) hack/images.sh $*
base-image:
	@PLATFORM=$(PLATFORM) hack/images.sh base
# Both architectures under one name (hack/image-manifests.sh): each platform's image by hack/images.sh
# (cached as above; the other architecture's under qemu-user-static, which hack/emulation.sh registers),
# then a podman manifest list $(IMAGE_REGISTRY)/gpudra-operator:$(IMAGE_TAG) and .../gpudra:$(IMAGE_TAG)
# of them; each image keeps <tag>-<arch>. images-push pushes the lists and their images (podman
# manifest push --all; log in first, or PUSH_FLAGS="--authfile FILE").
PLATFORMS ?= linux/amd64 linux/arm64
PUSH_FLAGS ?=
images-multiarch:
	@IMAGE_REGISTRY=$(IMAGE_REGISTRY) IMAGE_TAG=$(IMAGE_TAG) PLATFORMS="$(PLATFORMS)" hack/image-manifests.sh operator agent
images-push:
	@IMAGE_REGISTRY=$(IMAGE_REGISTRY) IMAGE_TAG=$(IMAGE_TAG) PLATFORMS="$(PLATFORMS)" PUSH_FLAGS="$(PUSH_FLAGS)" hack/image-manifests.sh --push operator agent

# The release (docs/releasing.md; .github/workflows/release.yml runs these and nothing else).
# The chart as an OCI artifact, by hack/chart.sh: helm lint --strict, helm package into CHART_OUT,
# helm push to CHART_REGISTRY (oci://host/path; the chart lands at <path>/gpudra:<version>).
CHART_VERSION ?= $(shell sed -n 's/^version: *//p' manifests/helm/gpudra/Chart.yaml)
CHART_APP_VERSION ?=
CHART_OUT ?= build/chart
CHART_REGISTRY ?=
CHART_PUSH_FLAGS ?=
CHART_ENV = CHART_VERSION="$(CHART_VERSION)" CHART_APP_VERSION="$(CHART_APP_VERSION)" CHART_OUT="$(CHART_OUT)" \
  CHART_REGISTRY="$(CHART_REGISTRY)" CHART_PUSH_FLAGS="$(CHART_PUSH_FLAGS)"
chart-package:
	@$(CHART_ENV) hack/chart.sh package
chart-push:
	@$(CHART_ENV) hack/chart.sh push

# values.schema.json's definitions.gpuDraConfigSpec from crds/gpudraconfig.yaml (a test holds them equal).
chart-schema: venv
	@$(BIN)/python hack/chart-schema.py

# CycloneDX (JSON) of gpudra and the dependencies pip resolves for it, by hack/sbom.sh, in SBOM_OUT.
SBOM_OUT ?= dist
sbom: venv
	@SBOM_OUT="$(SBOM_OUT)" VENV="$(VENV)" PYTHON="$(PYTHON)" hack/sbom.sh

# CycloneDX (JSON) of each image per platform (PLATFORMS, as images-multiarch), by hack/sbom-images.sh:
# hack/images.sh's images (cached by content), podman save, Anchore's syft (hack/syft-bin.sh, cached
# under ~/.cache/gpudra/syft/<version>), in SBOM_OUT. SBOM_IMAGES picks some: operator agent.
SBOM_IMAGES ?= operator agent
sbom-images: venv
	@SBOM_OUT="$(SBOM_OUT)" VENV="$(VENV)" PLATFORMS="$(PLATFORMS)" IMAGE_REGISTRY=$(IMAGE_REGISTRY) IMAGE_TAG=$(IMAGE_TAG) \
	  hack/sbom-images.sh $(SBOM_IMAGES)
syft:
	@hack/syft-bin.sh >/dev/null

# rhysd/actionlint over .github/workflows/*.yml, built by hack/actionlint-bin.sh, cached under
# ~/.cache/gpudra/actionlint/<version>. Without shellcheck: every run step is one make command.
actionlint:
	@dir="$$(hack/actionlint-bin.sh | tail -n 1)" && test -n "$$dir" && "$$dir/actionlint" -shellcheck= -pyflakes= -no-color

# One version everywhere: pyproject.toml's, the chart's version and appVersion, and the tag being released.
RELEASE_TAG ?= $(GITHUB_REF_NAME)
release-check:
	@v="$$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)"; \
	  c="$$(sed -n 's/^version: *//p' manifests/helm/gpudra/Chart.yaml)"; \
	  a="$$(sed -n 's/^appVersion: *"*\([^"]*\)"*/\1/p' manifests/helm/gpudra/Chart.yaml)"; \
	  test -n "$$v" && test "$$v" = "$$c" && test "$$v" = "$$a" || { \
	    echo "make release-check: pyproject.toml says '$$v', Chart.yaml version '$$c', appVersion '$$a': bump them together" >&2; exit 1; }; \
	  test -z "$(RELEASE_TAG)" || test "$(RELEASE_TAG)" = "v$$v" || { \
	    echo "make release-check: the tag '$(RELEASE_TAG)' is not v$$v (pyproject.toml, Chart.yaml): tag v$$v, or bump the version first" >&2; exit 1; }; \
	  echo "version $$v$(if $(RELEASE_TAG), (tag $(RELEASE_TAG)))"

# The Debian packages the builds and tests need (hack/debian-packages.sh: only the missing ones,
# through sudo when not root; .ci/run runs it too), e.g. for the release's multi-arch images.
debian-packages:
	@hack/debian-packages.sh

# What CI runs (.ci/run). It needs root (the kubelet, containerd, podman, Debian packages): a CI
# runner's ordinary user goes through sudo, keeping the environment (GOPATH, the caches).
ci:
	@if [ "$$(id -u)" = 0 ]; then .ci/run; else sudo --preserve-env env "PATH=$$PATH" HOME="$$HOME" .ci/run; fi

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
