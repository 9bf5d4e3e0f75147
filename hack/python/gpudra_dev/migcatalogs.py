"""Simulated nodes of each MIG catalog the simulated NVML ships (driver/gpudra_driver/profiles/mig/):
one profile per GPU model, for the docs' per-GPU tables (tests/unit/test_mig_docs.py) and the
slice sizes ``make bench`` reports (bench/mig_prepare.py)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import yaml

from gpudra_driver.nvml.fake import FakeNvml, load_profile

PRODUCTS = {"a100-sxm4-40gb": "NVIDIA A100-SXM4-40GB", "a100-sxm4-80gb": "NVIDIA A100-SXM4-80GB",
            "h100-sxm5-80gb": "NVIDIA H100 80GB HBM3", "h200-sxm-141gb": "NVIDIA H200",
            "b200-180gb": "NVIDIA B200"}
# NVML's architecture of each: whether its whole GPU is offered (MIG mode switched without a reset)
ARCHITECTURES = {"a100-sxm4-40gb": "AMPERE", "a100-sxm4-80gb": "AMPERE", "b200-180gb": "BLACKWELL"}


def catalog_profile(model: str, gpus: int = 1) -> dict[str, Any]:
    """A simulated node of ``gpus`` MIG-enabled GPUs of ``model``, without MIG devices."""
    return {"description": model, "driverVersion": "570.133.20", "cudaDriverVersion": 12080,
            "gpus": [{"name": PRODUCTS[model], "uuid": f"GPU-00000000-0000-4000-8000-{i:012d}",
                      "brand": "NVIDIA", "architecture": ARCHITECTURES.get(model, "HOPPER"),
                      "cudaComputeCapability": "9.0", "memoryMiB": 81920, "pciDeviceId": 0x233010DE,
                      "busId": f"00000000:{0x18 + i:02x}:00.0", "numaNode": 0, "migCapable": True,
                      "migMode": "enabled", "maxMigDevices": 7, "migCatalog": model} for i in range(gpus)]}


def catalog_nvml(model: str, gpus: int = 1) -> FakeNvml:
    """The simulated NVML of :func:`catalog_profile` (its profile parsed from a file, as agents do)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{model}.yaml"
        path.write_text(yaml.safe_dump(catalog_profile(model, gpus)))
        return FakeNvml(load_profile(str(path)))
