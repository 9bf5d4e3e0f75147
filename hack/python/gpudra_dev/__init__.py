"""gpudra's development tooling, never shipped: the local control plane with simulated GPU nodes
(:mod:`.localcluster`), `gpudra-dev demo`, the kubelet's side of the DRA protocol
(:mod:`.kubelet_client`), the mock NVML's reader. `make demo`, `make test` and `make bench` install
it from the checkout (hack/python); no wheel and no image carries it, and the product never
imports it (import-linter, `make typecheck`)."""

from pathlib import Path

# It runs from a checkout: hack/python/gpudra_dev -> the repository (build/, manifests/samples).
REPO = Path(__file__).resolve().parents[3]
