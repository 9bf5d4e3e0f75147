"""The ResourceSlice GC inside the running operator (a `gpudra operator` subprocess): the per-config
loop runs a pass on its own once the config is reconciled and reports in status.gc, an Event and
its log; and the fifth rule, "driver no longer managed": once the GpuDraConfig is deleted (at once:
no finalizer), the operator's teardown deletes its driver's slices when no agent pod is left, and
nobody else's."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio

from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_dev.localcluster.controlplane import ControlPlane
from gpudra_dev.localcluster.kubelet_sim import KubeletSimulator
from gpudra_dev.localcluster.objects import events_about, fake_slice
from gpudra_dev.localcluster.operatorproc import OperatorProcess, start_operator
from gpudra_dev.localcluster.waiting import wait_for
from gpudra_operator.slicegc.plan import NODE_GONE

CONFIG = resource_type("gpudra.io/v1alpha1", "GpuDraConfig")
SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def operator(cluster: ControlPlane, kube: Kube, crd_installed: Obj,
                   tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[OperatorProcess]:
    operator = start_operator(kubeconfig=cluster.kubeconfig,
                              log_path=tmp_path_factory.mktemp("gc-operator") / "operator.log",
                              env={"GPUDRA_DRIFT_INTERVAL": "3", "GPUDRA_GC_TICK": "0.2"})
    simulator = asyncio.create_task(KubeletSimulator(kube).run())
    try:
        yield operator
    finally:
        simulator.cancel()
        operator.stop()
        print(f"\n--- operator log tail ({operator.log_path}) ---\n{operator.log_tail()}")


class Cluster:
    """A test's config, driver, agent namespace and slices; all removed afterwards."""

    def __init__(self, kube: Kube, namespace: str) -> None:
        self.kube, self.namespace = kube, namespace
        self.suffix = secrets.token_hex(3)
        self.name, self.driver = f"gcop-{self.suffix}", f"gcop{self.suffix}.gpudra.io"
        self.selector = {"gpudra.io/gc-test": self.suffix}
        self.slices: list[str] = []

    async def config(self) -> Obj:
        await self.kube.create({"apiVersion": "v1", "kind": "ServiceAccount",
                                "metadata": {"name": "gpudra-agent", "namespace": self.namespace}})
        return await self.kube.create({
            "apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig", "metadata": {"name": self.name},
            "spec": {"driverName": self.driver, "agent": {"namespace": self.namespace, "nodeSelector": self.selector},
                     "resourceSliceGC": {"gracePeriod": "30s"}}})

    async def slice(self, node: str, *, owner_uid: str | None = None, driver: str | None = None) -> Obj:
        name = f"{node}-{secrets.token_hex(2)}"
        self.slices.append(name)
        return await self.kube.create(fake_slice(name, driver or self.driver, node, owner_uid=owner_uid))

    async def gc_status(self) -> Obj | None:
        config = await self.kube.get(CONFIG, self.name)
        return ((config or {}).get("status") or {}).get("gc")

    async def cleanup(self) -> None:
        await self.kube.delete(CONFIG, self.name)
        await wait_for(lambda: _absent(self.kube, self.name), timeout=60, what=f"GpuDraConfig {self.name} gone")
        for name in self.slices:
            await self.kube.delete(SLICE, name)


async def _absent(kube: Kube, name: str) -> bool:
    return await kube.get(CONFIG, name) is None


async def _absent_slice(kube: Kube, name: str) -> bool:
    return await kube.get(SLICE, name) is None


@pytest_asyncio.fixture(loop_scope="session")
async def scene(kube: Kube, operator: OperatorProcess, namespace: str) -> AsyncIterator[Cluster]:
    c = Cluster(kube, namespace)
    try:
        yield c
    finally:
        await c.cleanup()


async def test_operator_collects_stale_slices_and_reports(scene: Cluster, kube: Kube, operator: OperatorProcess,
                                                          fake_nodes: Callable[..., Any]) -> None:
    node = await fake_nodes("gcop", labels=scene.selector)
    healthy = await scene.slice(node["metadata"]["name"], owner_uid=node["metadata"]["uid"])
    orphan = await scene.slice(f"gone-{scene.suffix}")
    await scene.config()

    async def collected() -> Obj | None:
        gc = await scene.gc_status()
        return gc if gc and gc.get("deleted") else None

    gc = await wait_for(collected, timeout=60, what="a GC pass that deleted the orphaned slice")
    assert (gc["found"], gc["deleted"], gc["errors"], gc["dryRun"]) == (1, 1, 0, False) and gc["lastRun"]
    assert await kube.get(SLICE, orphan["metadata"]["name"]) is None
    assert await kube.get(SLICE, healthy["metadata"]["name"]) is not None

    async def event() -> Obj | None:
        events = await events_about(kube, scene.name)
        return next((e for e in events if e["reason"] == "StaleSlicesDeleted"), None)

    assert orphan["metadata"]["name"] in (await wait_for(event, timeout=15, what="a StaleSlicesDeleted Event"))["message"]
    line = next(line for line in operator.log().splitlines() if f"ResourceSlice {orphan['metadata']['name']} " in line)
    assert f"by rule {NODE_GONE}" in line and line.rstrip().endswith("deleted"), line


async def test_rule_driver_no_longer_managed(scene: Cluster, kube: Kube, fake_nodes: Callable[..., Any]) -> None:
    """The teardown's rule: once the config is deleted and its agents are gone, every slice of its
    driver goes — here a healthy one the GC itself had kept — and another driver's stays."""
    node = await fake_nodes("gcop", labels=scene.selector)
    ours = await scene.slice(node["metadata"]["name"], owner_uid=node["metadata"]["uid"])
    foreign = await scene.slice(node["metadata"]["name"], owner_uid=node["metadata"]["uid"],
                                driver=f"other{scene.suffix}.example.com")
    await scene.config()

    async def agent_up_and_gc_ran() -> bool:
        config = await kube.get(CONFIG, scene.name)
        status = (config or {}).get("status") or {}
        return status.get("agents", {}).get("ready") == 1 and bool(status.get("gc", {}).get("lastRun"))

    await wait_for(agent_up_and_gc_ran, timeout=60, what="the agent pod Ready and a GC pass")
    assert (await scene.gc_status())["found"] == 0
    assert await kube.get(SLICE, ours["metadata"]["name"]) is not None

    await kube.delete(CONFIG, scene.name)
    assert await kube.get(CONFIG, scene.name) is None  # no finalizer holds it
    await wait_for(lambda: _absent_slice(kube, ours["metadata"]["name"]), timeout=60,
                   what="the deleted config's teardown to delete its driver's slice")
    assert await kube.get(SLICE, foreign["metadata"]["name"]) is not None
