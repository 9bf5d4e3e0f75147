"""Builders shared by the kubelet-plugin unit tests: simulated devices and ResourceClaims."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

from gpudra_driver.discovery import scan
from gpudra_driver.driverroot import DriverRoot
from gpudra_driver.plugin.driverfiles import DriverFilesCache
from gpudra_dev.localcluster.fakedriverroot import make_driver_root
from gpudra_driver.nvml.fake import FakeNvml, load_profile
from gpudra_driver.plugin.devicenodes import NodeDevice, node_devices

DRIVER = "gpu.gpudra.io"
NODE = "node-a"


@cache
def fake_root(profile: str = "dgx-h100") -> DriverRoot:
    """A fake driver root for ``profile`` (mock NVML, driver files, mknod'd device nodes), made
    once per process; tests read it only."""
    path = Path(tempfile.mkdtemp(prefix=f"gpudra-root-{profile}-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return DriverRoot.at(str(make_driver_root(path, profile)))


def driver_files(profile: str = "dgx-h100") -> DriverFilesCache:
    return DriverFilesCache(fake_root(profile))


def devices(profile: str = "dgx-h100") -> dict[str, NodeDevice]:
    return node_devices(scan(FakeNvml(load_profile(profile))).devices)


def claim(uid: str = "0c1d2e3f-0000-4000-8000-000000000001", *, name: str = "c1", namespace: str = "ns",
          results: list[dict[str, Any]] | None = None, allocated: bool = True,
          node_selector_node: str | None = NODE) -> dict[str, Any]:
    obj: dict[str, Any] = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                           "metadata": {"name": name, "namespace": namespace, "uid": uid}, "spec": {}, "status": {}}
    if allocated:
        allocation: dict[str, Any] = {"devices": {"results": results if results is not None else [
            result("gpu-3")]}}
        if node_selector_node:
            allocation["nodeSelector"] = {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node_selector_node]}]}]}
        obj["status"]["allocation"] = allocation
    return obj


def result(device: str, *, request: str = "gpu", driver: str = DRIVER, pool: str = NODE, **extra: Any) -> dict[str, Any]:
    return {"request": request, "driver": driver, "pool": pool, "device": device, **extra}
