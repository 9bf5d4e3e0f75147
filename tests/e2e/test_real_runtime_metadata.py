"""Device metadata (KEP-5304) on a node with a real container runtime (tests/e2e/test_real_runtime.py's
node: the release's kubelet on containerd and runc, CDI on; the agent a host process on the mock
NVML of a DGX H100).

A pod whose claim comes from a template, and a pod that names a claim of two GPUs (one request,
its subrequest chosen by firstAvailable), each ``cat`` their metadata file at the standard
container path (``resourceclaimtemplates/<pod's claim name>/...`` and ``resourceclaims/<claim
name>/...``): runc bind-mounted it read-only as the agent's CDI spec says, and the decoders of
Kubernetes 1.36 and 1.37 (tests/metadatacheck.py) read what the container printed, each in its own
version, with the UUID and PCI bus ID of each GPU the claim got. Deleting the pods removes the files
with the claims' specs. The kubelet is not involved beyond the CDI IDs it passes on, so the file
runs on every release; CI runs it on 1.36.3 and 1.37.2 as well."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from metadatacheck import decode_valid
from test_real_runtime import DONE, POD, Node, gpu_pod, printed_output, runtime_node_of, seedobjects, start_host_agent

from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_dev.localcluster.controlplane import ControlPlane
from gpudra_dev.localcluster.waiting import wait_for
from gpudra_driver.plugin import devicemetadata
from gpudra_driver.plugin.cdi import metadata_dir

CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")
PROFILE = "dgx-h100"
BASE = "/var/run/kubernetes.io/dra-device-attributes"

pytestmark = pytest.mark.timeout(600)


@pytest_asyncio.fixture(loop_scope="session")
async def metadata_node(cluster: ControlPlane, kube: Kube) -> AsyncIterator[Node]:
    async with runtime_node_of(cluster, kube, PROFILE) as node:
        await start_host_agent(cluster, node, PROFILE)
        yield node


def script(path: str) -> str:
    """Print the file, then whether the container may write it, then DONE; stay up (the claim prepared)."""
    return (f"cat {path}; echo; if echo x 2>/dev/null >> {path}; then echo writable; else echo read-only; fi; "
            f"echo {DONE}; exec sleep 3600")


async def run_pod(kube: Kube, node: Node, pod: Obj) -> str:
    """Create the pod; its container's output once it printed DONE."""
    await kube.create(pod)
    name, namespace = pod["metadata"]["name"], pod["metadata"]["namespace"]
    started = time.monotonic()
    _, output = await printed_output(kube, node, name, namespace, "print its metadata file")
    print(f"[real-runtime] {name}: created -> output in {time.monotonic() - started:.1f}s")
    return output


def printed_file(output: str, tmp_path: Path, name: str) -> Path:
    """What the container printed of its metadata file (one JSON object a line), as a file."""
    lines = [line for line in output.splitlines() if line.startswith("{")]
    assert len(lines) == len(devicemetadata.VERSIONS), f"the container printed no metadata file:\n{output}"
    assert "read-only" in output.splitlines(), f"the container may write its metadata file:\n{output}"
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


async def allocated(kube: Kube, name: str, namespace: str) -> tuple[Obj, list[str]]:
    claim = await kube.get(CLAIM, name, namespace)
    assert claim is not None and claim["status"].get("allocation"), claim
    return claim, [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]]


def assert_read_by_both_releases(path: Path, claim: Obj, request: str, devices: list[str],
                                 published: dict[str, Obj], pod_claim_name: str | None) -> None:
    """Both decoders read the claim, the request and each device with its UUID and PCI bus ID as
    the slice published them."""
    readings = decode_valid(path)
    assert [r["apiVersion"] for r in readings.values()] == ["metadata.resource.k8s.io/v1alpha1",
                                                           "metadata.resource.k8s.io/v1beta1"]
    for release, reading in readings.items():
        obj = reading["metadata"]
        assert obj["metadata"]["uid"] == claim["metadata"]["uid"], release
        assert obj["metadata"]["name"] == claim["metadata"]["name"], release
        assert obj.get("podClaimName") == pod_claim_name, release
        (got,) = obj["requests"]
        assert got["name"] == request, release
        assert [d["name"] for d in got["devices"]] == devices, release
        for device in got["devices"]:
            slice_attributes = published[device["name"]]["attributes"]
            for attribute in ("uuid", "resource.kubernetes.io/pciBusID", "productName"):
                assert device["attributes"][attribute] == slice_attributes[attribute], (release, attribute)


async def test_a_template_claims_and_a_named_two_gpu_claims_containers_read_their_metadata(
        kube: Kube, namespace: str, metadata_node: Node, tmp_path: Path) -> None:
    node, driver = metadata_node, metadata_node.driver
    published = await seedobjects.published_devices(kube, driver, node.name, 8)

    # a claim from the seed's template: the path names the pod's own name for it ("gpu")
    template, pod = gpu_pod(node, namespace, "train")
    pod["spec"]["containers"][0]["command"] = ["sh", "-c", script(f"{BASE}/resourceclaimtemplates/gpu/gpu/"
                                                                  f"{driver}-metadata.json")]
    await kube.create(template)
    output = await run_pod(kube, node, pod)
    got = await kube.get(POD, "train", namespace)
    assert got is not None
    (status,) = got["status"]["resourceClaimStatuses"]
    claim, devices = await allocated(kube, status["resourceClaimName"], namespace)
    assert_read_by_both_releases(printed_file(output, tmp_path, "template.json"), claim, "gpu", devices,
                                 published, "gpu")

    # a claim the pod names, of two GPUs in one request (its subrequest chosen by firstAvailable)
    await kube.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                       "metadata": {"name": "two-gpus", "namespace": namespace},
                       "spec": {"devices": {"requests": [{"name": "gpus", "firstAvailable": [
                           {"name": "pair", "deviceClassName": driver, "count": 2}]}]}}})
    _, pod = gpu_pod(node, namespace, "train-2")
    spec = pod["spec"]
    spec["resourceClaims"] = [{"name": "mine", "resourceClaimName": "two-gpus"}]
    spec["containers"][0].update(resources={"claims": [{"name": "mine"}]}, command=[
        "sh", "-c", script(f"{BASE}/resourceclaims/two-gpus/gpus/{driver}-metadata.json")])
    output = await run_pod(kube, node, pod)
    claim, devices = await allocated(kube, "two-gpus", namespace)
    assert len(devices) == 2
    assert_read_by_both_releases(printed_file(output, tmp_path, "named.json"), claim, "gpus/pair", devices,
                                 published, None)

    # the pods gone, the claims are unprepared: their metadata files go with their specs
    uids = [c["metadata"]["uid"] for c in [await kube.get(CLAIM, status["resourceClaimName"], namespace), claim] if c]
    root = metadata_dir(node.cdi_dir, driver)
    assert {devicemetadata.claim_uid_of(p.name) for p in root.iterdir()} == set(uids)
    for name in ("train", "train-2"):
        await kube.delete(POD, name, namespace, grace_period_seconds=0)

    async def unprepared() -> bool:
        return not any(node.spec_path(uid).exists() for uid in uids) and not list(root.iterdir())

    await wait_for(unprepared, timeout=60, what="the claims' specs and metadata files removed at unprepare")

