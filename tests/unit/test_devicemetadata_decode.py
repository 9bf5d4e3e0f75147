"""The agent's device metadata files, read by the official decoder of Kubernetes 1.36 (v1alpha1, the
only version it knows: it skips the v1beta1 object first in the stream) and of 1.37 (v1beta1, with
its validation): each finds its version, and the same claim, request and attributes (tests/metadatacheck.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from metadatacheck import decode, decode_valid
from plugin_fixtures import DRIVER, NODE, result
from test_devicemetadata import TEMPLATE_ANNOTATION, UID, prepared

from gpudra_driver.plugin import devicemetadata as dm
from gpudra_driver.plugin.model import ClaimMetadata


def written(tmp_path: Path, *results: dict[str, Any], request: str = "gpu", **kwargs: Any) -> Path:
    claim = prepared(*results, **kwargs)
    files = dm.MetadataFiles(tmp_path, DRIVER)
    files.write(claim)
    return dm.host_path(tmp_path, claim.uid, request)


@pytest.mark.parametrize("case", ["gpu", "static-mig", "share", "template"])
def test_both_releases_decode_our_files_each_in_its_own_version(tmp_path: Path, case: str) -> None:
    path = {
        "gpu": lambda: written(tmp_path, result("gpu-3", request="gpus/big"), result("gpu-5", request="gpus/big"),
                               request="gpus"),
        "static-mig": lambda: written(tmp_path, result("gpu-0-mig-1g10gb-9-0"), profile="a100-80gb-mig"),
        "share": lambda: written(tmp_path, result("gpu-3", shareID="5f0e7a1c-share",
                                                  consumedCapacity={"memory": "20Gi"})),
        "template": lambda: written(tmp_path, result("gpu-3"), annotations=TEMPLATE_ANNOTATION),
    }[case]()
    readings = decode_valid(path)
    assert readings["v1.36"]["apiVersion"] == "metadata.resource.k8s.io/v1alpha1"
    assert readings["v1.37"]["apiVersion"] == "metadata.resource.k8s.io/v1beta1"  # the newest it knows
    for reading in readings.values():
        obj = reading["metadata"]
        assert (obj["metadata"]["name"], obj["metadata"]["namespace"], obj["metadata"]["uid"]) == ("c1", "ns", UID)
        assert obj.get("podClaimName") == ("gpus" if case == "template" else None)
        (request,) = obj["requests"]
        assert request["name"] == ("gpus/big" if case == "gpu" else "gpu")
        assert all(d["driver"] == DRIVER and d["pool"] == NODE for d in request["devices"])
        for device in request["devices"]:
            assert device["attributes"]["uuid"]["string"].startswith("MIG-" if case == "static-mig" else "GPU-")
        if case == "share":
            assert request["devices"][0]["attributes"]["consumedMemory"] == {"int": 20 * 2**30}
    assert readings["v1.36"]["metadata"]["requests"] == readings["v1.37"]["metadata"]["requests"]


def test_the_checker_does_validate_what_it_reads(tmp_path: Path) -> None:
    """A pod claim name no DNS label (which the agent never writes): 1.37's validation says so."""
    claim = prepared(result("gpu-3"))
    bad = dm.MetadataFiles(tmp_path, DRIVER)
    bad.write(claim.__class__(claim.ref, claim.devices, ClaimMetadata(("gpu",), "Not_A_Label")))
    reading = decode(dm.host_path(tmp_path, UID, "gpu"), "v1.37")
    assert "podClaimName" in reading["validation"]
