"""The node agent, as a subprocess on simulated NVML, publishes exact ResourceSlices that the real
scheduler allocates from, restores them when deleted, and republishes when devices change."""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import pytest
import yaml

from gpudra_driver.discovery import scan
from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_driver.nvml import load_nvml
from gpudra_driver.publishing.plan import plan_publish
from gpudra_dev.localcluster.agents import AgentProcess
from gpudra_dev.localcluster.waiting import wait_for

SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
DEVICE_CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")
CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")
POD = resource_type("v1", "Pod")
PROFILES = Path(__file__).resolve().parents[2] / "driver" / "gpudra_driver" / "profiles"


@pytest.fixture
def driver() -> str:
    return f"a{secrets.token_hex(4)}.gpudra.io"




async def node_slices(kube: Kube, driver: str, node: str) -> list[Obj]:
    return [s async for s in kube.list(SLICE, field_selector=f"spec.driver={driver},spec.nodeName={node}")]


def published(kube: Kube, driver: str, node: str, devices: int, agent: AgentProcess):
    async def probe() -> list[Obj] | None:
        assert agent.process.poll() is None, f"agent exited:\n{agent.log_tail()}"
        slices = await node_slices(kube, driver, node)
        return slices if sum(len(s["spec"].get("devices") or []) for s in slices) == devices else None
    return probe


async def test_agent_publishes_the_nodes_gpus(kube: Kube, fake_nodes, agents, driver: str) -> None:
    node = await fake_nodes("h100")
    name = node["metadata"]["name"]
    agent = agents(name, "fake:dgx-h100", driver)
    slices = await wait_for(published(kube, driver, name, 8, agent), timeout=30, what="8 published H100s")
    assert len(slices) == 1
    slice_ = slices[0]
    assert slice_["spec"]["pool"] == {"name": name, "generation": 1, "resourceSliceCount": 1}
    owner = slice_["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == ("Node", name,
                                                                                node["metadata"]["uid"], True)
    gpu0 = next(d for d in slice_["spec"]["devices"] if d["name"] == "gpu-0")
    assert gpu0["attributes"]["type"] == {"string": "gpu"}
    assert gpu0["attributes"]["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert gpu0["attributes"]["cudaComputeCapability"] == {"version": "9.0.0"}
    assert gpu0["attributes"]["index"] == {"int": 0}
    assert "resource.kubernetes.io/pciBusID" in gpu0["attributes"]
    # KEP-6072's standard numaNode, stored beside the driver's own; no pcieRoot on simulated NVML
    gpu4 = next(d for d in slice_["spec"]["devices"] if d["name"] == "gpu-4")
    assert gpu4["attributes"]["resource.kubernetes.io/numaNode"] == gpu4["attributes"]["numaNode"] == {"int": 1}
    assert "resource.kubernetes.io/pcieRoot" not in gpu4["attributes"]
    # What the API server returns is exactly what the agent would write: no write loop on read-back.
    devices = scan(load_nvml("fake:dgx-h100")).devices
    plan = plan_publish(driver, name, node["metadata"]["uid"], devices, {slice_["metadata"]["name"]: slice_}, 1)
    assert plan.empty and plan.generation == 1


async def test_scheduler_places_the_seed_claim_on_64gi_gpus_only(kube: Kube, namespace: str, fake_nodes,
                                                                 agents, driver: str) -> None:
    big = await fake_nodes("h100")
    small = await fake_nodes("a100-40")
    agent_big = agents(big["metadata"]["name"], "fake:dgx-h100", driver)
    agent_small = agents(small["metadata"]["name"], "fake:dgx-a100-40gb", driver)
    await wait_for(published(kube, driver, big["metadata"]["name"], 8, agent_big), timeout=30, what="H100s")
    await wait_for(published(kube, driver, small["metadata"]["name"], 8, agent_small), timeout=30, what="A100s")
    class_name = driver  # a class named like the driver, as NVIDIA's gpu.nvidia.com
    await kube.create({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": class_name},
                       "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]}})
    try:
        selector = f'device.capacity["{driver}"].memory.compareTo(quantity("64Gi")) >= 0'
        await kube.create({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "gpu-64gi", "namespace": namespace},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": class_name, "selectors": [{"cel": {"expression": selector}}]}}]}}},
        })
        for i in range(3):
            await kube.create({
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"train-{i}", "namespace": namespace},
                "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu-64gi"}],
                         "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                                         "resources": {"claims": [{"name": "gpu"}]}}]},
            })
        h100_devices = {d["name"]: d for s in await node_slices(kube, driver, big["metadata"]["name"])
                        for d in s["spec"]["devices"]}
        for i in range(3):
            async def scheduled() -> Obj | None:
                pod = await kube.get(POD, f"train-{i}", namespace)
                return pod if pod and pod["spec"].get("nodeName") else None

            pod = await wait_for(scheduled, timeout=30, what=f"pod train-{i} to be scheduled")
            assert pod["spec"]["nodeName"] == big["metadata"]["name"]
            claim = await kube.get(CLAIM, pod["status"]["resourceClaimStatuses"][0]["resourceClaimName"], namespace)
            (result,) = claim["status"]["allocation"]["devices"]["results"]
            assert result["pool"] == big["metadata"]["name"]
            memory = h100_devices[result["device"]]["capacity"]["memory"]["value"]
            assert _bytes(memory) >= 64 * 1024**3
    finally:
        await kube.delete(DEVICE_CLASS, class_name)


async def test_scheduler_aligns_gpus_on_the_standard_numa_node(kube: Kube, namespace: str, fake_nodes, agents,
                                                                driver: str) -> None:
    """The real scheduler reads resource.kubernetes.io/numaNode (KEP-6072) in a selector and in a
    matchAttribute constraint, as a claim aligning a GPU with another driver's NIC would: dgx-h100
    has GPUs 0-3 on NUMA node 0 and 4-7 on node 1."""
    node = await fake_nodes("h100")
    name = node["metadata"]["name"]
    agent = agents(name, "fake:dgx-h100", driver)
    await wait_for(published(kube, driver, name, 8, agent), timeout=30, what="8 published H100s")
    class_name = driver
    await kube.create({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": class_name},
                       "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]}})
    try:
        numa = 'device.attributes["resource.kubernetes.io"].numaNode == 1'
        await kube.create({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "numa-1", "namespace": namespace},
            "spec": {"devices": {
                "requests": [
                    {"name": "pinned", "exactly": {"deviceClassName": class_name,
                                                   "selectors": [{"cel": {"expression": numa}}]}},
                    {"name": "aligned", "exactly": {"deviceClassName": class_name, "count": 2}},
                ],
                "constraints": [{"requests": ["pinned", "aligned"],
                                 "matchAttribute": "resource.kubernetes.io/numaNode"}],
            }},
        })
        await kube.create({
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "numa-1", "namespace": namespace},
            "spec": {"resourceClaims": [{"name": "gpus", "resourceClaimName": "numa-1"}],
                     "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                                     "resources": {"claims": [{"name": "gpus"}]}}]},
        })

        async def allocated() -> Obj | None:
            claim = await kube.get(CLAIM, "numa-1", namespace)
            return claim if claim and (claim.get("status") or {}).get("allocation") else None

        claim = await wait_for(allocated, timeout=30, what="the NUMA-aligned claim to be allocated")
        results = claim["status"]["allocation"]["devices"]["results"]
        assert sorted(r["request"] for r in results) == ["aligned", "aligned", "pinned"]
        assert {r["pool"] for r in results} == {name}
        # all three on NUMA node 1 (gpu-4..7), the two unpinned ones aligned by the constraint alone
        assert len({r["device"] for r in results}) == 3
        assert {r["device"] for r in results} <= {"gpu-4", "gpu-5", "gpu-6", "gpu-7"}
    finally:
        await kube.delete(DEVICE_CLASS, class_name)


async def test_deleted_slice_is_restored_within_two_seconds(kube: Kube, fake_nodes, agents, driver: str) -> None:
    node = await fake_nodes("l4")
    name = node["metadata"]["name"]
    agent = agents(name, "fake:l4x2", driver)
    (slice_,) = await wait_for(published(kube, driver, name, 2, agent), timeout=30, what="2 L4s")
    await kube.delete(SLICE, slice_["metadata"]["name"])
    deleted_at = time.monotonic()

    async def restored() -> Obj | None:
        slices = await node_slices(kube, driver, name)
        return next((s for s in slices if s["metadata"]["uid"] != slice_["metadata"]["uid"]), None)

    back = await wait_for(restored, timeout=2, what="the deleted slice to be restored")
    elapsed = time.monotonic() - deleted_at
    assert back["spec"]["pool"]["generation"] > slice_["spec"]["pool"]["generation"]
    assert len(back["spec"]["devices"]) == 2
    print(f"restored in {elapsed:.3f}s")

    # A foreign edit of our slice is converged back to ours.
    edited = await kube.patch(SLICE, back["metadata"]["name"], {"spec": {"devices": back["spec"]["devices"][:1]}})
    assert len(edited["spec"]["devices"]) == 1

    async def converged() -> bool:
        slices = await node_slices(kube, driver, name)
        return len(slices) == 1 and len(slices[0]["spec"].get("devices") or []) == 2

    await wait_for(converged, timeout=5, what="the foreign-edited slice to be converged")


async def test_changed_devices_are_republished(kube: Kube, fake_nodes, agents, driver: str, tmp_path: Path) -> None:
    profile = yaml.safe_load((PROFILES / "dgx-h100.yaml").read_text())
    gpus = profile["gpus"]
    # 130 devices: two slices (128 + 2) of one pool.
    profile["gpus"] = [dict(gpus[i % len(gpus)], uuid=f"GPU-{i:08x}-0000-4000-8000-000000000000",
                            busId=f"00000000:{i // 32 + 0x10:02x}:{i % 32:02x}.0") for i in range(130)]
    path = tmp_path / "profile.yaml"
    write_atomically(path, yaml.safe_dump(profile))
    node = await fake_nodes("big")
    name = node["metadata"]["name"]
    agent = agents(name, f"fake:{path}", driver, rescan_interval=0.5)
    first = await wait_for(published(kube, driver, name, 130, agent), timeout=30, what="130 devices")
    assert len(first) == 2 and {s["spec"]["pool"]["resourceSliceCount"] for s in first} == {2}
    generation = first[0]["spec"]["pool"]["generation"]

    profile["gpus"] = profile["gpus"][:3]
    write_atomically(path, yaml.safe_dump(profile))  # the agent rescans it every 0.5 s
    after = await wait_for(published(kube, driver, name, 3, agent), timeout=15, what="3 devices after the change")
    assert len(after) == 1
    assert after[0]["spec"]["pool"] == {"name": name, "generation": generation + 1, "resourceSliceCount": 1}


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(quantity[: -len(suffix)]) * factor
    return int(quantity)
