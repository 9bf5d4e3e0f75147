# gpudra — one place for the versions the project is tested against.
# Test a newer Kubernetes the same way: make test KUBE_VERSION=v1.36.3 (needs hack/kube-tools pins too).
KUBE_VERSION ?= v1.35.4
ETCD_VERSION ?= v3.6.16
PYTHON ?= python3
VENV ?= .venv
PYTEST_ARGS ?=

export KUBE_VERSION ETCD_VERSION
BIN := $(VENV)/bin

.PHONY: help venv kube-bin test unit demo demo-down bench protos clean
help:
	@echo "make demo       local control plane with simulated GPU nodes (Ctrl-C stops it)"
	@echo "make test       the whole suite against a real Kubernetes $(KUBE_VERSION) control plane"
	@echo "make unit       unit tests only (no cluster)"
	@echo "make kube-bin   fetch or build etcd $(ETCD_VERSION) + Kubernetes $(KUBE_VERSION) binaries"
	@echo "make bench      benchmarks (not part of make test)"
	@echo "make protos     regenerate the kubelet plugin's gRPC stubs"

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c 'import sys; assert sys.version_info >= (3, 11), "gpudra needs Python >= 3.11"'
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	@touch $@

kube-bin:
	@hack/kube-bin.sh

test: venv
	@bin_dir="$$(hack/kube-bin.sh | tail -n 1)" && test -n "$$bin_dir" && \
	  GPUDRA_KUBE_BIN="$$bin_dir" $(BIN)/pytest $(PYTEST_ARGS)

unit: venv
	$(BIN)/pytest tests/unit $(PYTEST_ARGS)

demo: venv
	@bin_dir="$$(hack/kube-bin.sh | tail -n 1)" && test -n "$$bin_dir" && \
	  GPUDRA_KUBE_BIN="$$bin_dir" $(BIN)/gpudra demo

demo-down:
	@$(BIN)/gpudra demo --down

bench: venv
	@bin_dir="$$(hack/kube-bin.sh | tail -n 1)" && GPUDRA_KUBE_BIN="$$bin_dir" $(BIN)/python -m bench

# The kubelet plugin's gRPC stubs (committed) from driver/gpudra_driver/plugin/protos/.
protos:
	$(BIN)/pip install --quiet -e '.[dev]'
	PYTHON=$(BIN)/python hack/gen-protos.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
