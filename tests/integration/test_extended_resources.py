"""Extended resources backed by DRA (KEP-5004): a DeviceClass entry's extendedResourceName lets a
pod that asks for `resources.limits: {nvidia.com/gpu: 1}`, with no ResourceClaim of its own, get a
GPU published by gpudra: the migration path from NVIDIA's device plugin.

The DRAExtendedResource gate is beta and on from Kubernetes 1.36 (GA in 1.37), alpha and off in
1.35, where the API server drops the field: there the config says so in DeviceClassesReady and
Degraded. One test, whose expectation follows the release under test: CI runs it on 1.35.4 with
the whole suite, and on 1.36.3 and 1.37.2 (`make test KUBE_VERSION=... PYTEST_ARGS=<this file>`).
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import pytest_asyncio

from counting import CountingKube
from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_operator.events import EventRecorder
from gpudra_operator.reconcile import Reconciler
from gpudra_dev.localcluster.controlplane import ControlPlane
from gpudra_dev.localcluster.kubelet_sim import KubeletSimulator
from gpudra_dev.localcluster.operatorproc import start_operator
from gpudra_dev.localcluster.waiting import wait_for

CONFIG = resource_type("gpudra.io/v1alpha1", "GpuDraConfig")
DEVICE_CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")
POD = resource_type("v1", "Pod")
CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")


async def minor_version(kube: Kube) -> int:
    return int("".join(ch for ch in (await kube.request("GET", "/version"))["minor"] if ch.isdigit()))


@pytest_asyncio.fixture(loop_scope="session")
async def operator(cluster: ControlPlane, crd_installed: Obj, tmp_path: Path):  # type: ignore[no-untyped-def]
    process = start_operator(kubeconfig=cluster.kubeconfig, log_path=tmp_path / "operator.log",
                             env={"GPUDRA_DRIFT_INTERVAL": "3"})
    try:
        yield process
    finally:
        process.stop()


async def test_a_pod_asking_for_nvidia_com_gpu_gets_a_gpu_from_gpudra(
        kube: Kube, operator: Any, namespace: str, fake_nodes, agents) -> None:
    suffix = secrets.token_hex(3)
    driver, name, resource = f"x{suffix}.gpudra.io", f"ext-{suffix}", f"example.com/gpu-{suffix}"
    node = (await fake_nodes("ext"))["metadata"]["name"]  # no GPU label: no DaemonSet pod (the agent is a process)
    agent = agents(node, "fake:l4x2", driver, rescan_interval=0.5)
    await kube.create({"apiVersion": "v1", "kind": "ServiceAccount",
                       "metadata": {"name": "gpudra-agent", "namespace": namespace}})
    class_name = f"gpu-{suffix}.gpudra.io"
    await kube.create({"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig", "metadata": {"name": name},
                       "spec": {"driverName": driver, "agent": {"namespace": namespace},
                                "deviceClasses": [{"name": class_name, "template": "full-gpu",
                                                   "extendedResourceName": resource}]}})
    try:
        if await minor_version(kube) < 36:
            await _dropped_on_1_35(kube, name, class_name, resource)
        else:
            await _served(kube, namespace, node, driver, class_name, resource, agent)
    finally:
        await kube.delete(CONFIG, name)

        async def gone() -> bool:
            return await kube.get(CONFIG, name) is None

        await wait_for(gone, timeout=60, what=f"GpuDraConfig {name} to be finalized")


async def _dropped_on_1_35(kube: Kube, name: str, class_name: str, resource: str) -> None:
    async def reported() -> Obj | None:
        config = await kube.get(CONFIG, name)
        conditions = {c["type"]: c for c in ((config or {}).get("status") or {}).get("conditions") or []}
        ready = conditions.get("DeviceClassesReady")
        return conditions if ready and ready["status"] == "False" and "DRAExtendedResource" in ready["message"] else None

    conditions = await wait_for(reported, timeout=60, what="DeviceClassesReady=False naming the feature gate")
    assert f"spec.extendedResourceName {resource} was dropped by the API server" in conditions["DeviceClassesReady"]["message"]
    assert conditions["Degraded"]["status"] == "True" and conditions["Degraded"]["reason"] == "ApplyFailed"
    assert await kube.get(DEVICE_CLASS, class_name)  # the class itself is applied, without the field

    # Applying it again would change nothing: a reconcile that saw the field dropped compares the
    # class without it from then on, and still reports it (no write of the class per drift tick).
    counting = CountingKube(kube.api, "gpudra-operator")
    reconciler = Reconciler(counting, EventRecorder(counting))
    await reconciler.reconcile(await kube.get(CONFIG, name))
    counting.requests.clear()
    outcome = await reconciler.reconcile(await kube.get(CONFIG, name))
    assert [r for r in counting.requests if r[0] != "GET" and "/deviceclasses/" in r[1]] == [], counting.requests
    assert any("was dropped by the API server" in e.message for e in outcome.apply_errors)


async def _served(kube: Kube, namespace: str, node: str, driver: str, class_name: str, resource: str,
                  agent: Any) -> None:
    async def class_applied() -> Obj | None:
        live = await kube.get(DEVICE_CLASS, class_name)
        return live if live and live["spec"].get("extendedResourceName") == resource else None

    await wait_for(class_applied, timeout=60, what=f"DeviceClass {class_name} with extendedResourceName")
    simulator = KubeletSimulator(kube)
    import asyncio

    running = asyncio.create_task(simulator.run())
    try:
        pod = await kube.create({
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "legacy", "namespace": namespace},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": node},
                     "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                                     "resources": {"limits": {resource: "1"}}}]}})
        assert pod["spec"]["containers"][0]["resources"]["limits"] == {resource: "1"}

        async def scheduled() -> Obj | None:
            live = await kube.get(POD, "legacy", namespace)
            status = (live or {}).get("status") or {}
            return live if live and live["spec"].get("nodeName") and status.get("extendedResourceClaimStatus") else None

        live = await wait_for(scheduled, timeout=60, what="the pod scheduled with an extended-resource claim")
        assert live["spec"]["nodeName"] == node
        claim_status = live["status"]["extendedResourceClaimStatus"]
        (mapping,) = claim_status["requestMappings"]
        assert (mapping["containerName"], mapping["resourceName"]) == ("main", resource)
        claim = await kube.get(CLAIM, claim_status["resourceClaimName"], namespace)
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert (result["driver"], result["pool"]) == (driver, node)
        assert result["device"] in ("gpu-0", "gpu-1")
    finally:
        running.cancel()
