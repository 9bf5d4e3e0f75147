"""The ResourceSlice GC against the real control plane, one pass at a time, in process.

Each test drives :class:`SliceCollector` passes directly with a fake grace-period clock, so a
grace period is crossed by moving the clock, not by waiting; everything else is real: the API
server's field selectors, pagination, metadata-only lists, preconditioned deletes, status.gc and
Events. One test per rule (the fifth rule, the finalizer's, is in test_slice_gc_operator.py) and
per never-rule, the list/delete race, and dry-run. docs/gc.md is the specification."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest_asyncio

from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_operator.events import EventRecorder
from gpudra_dev.localcluster.controlplane import ControlPlane
from gpudra_dev.localcluster.objects import create_fake_node, delete_node, events_about, fake_slice
from gpudra_operator.render import agent_labels
from gpudra_operator.slicegc.apply import GcResult, SliceCollector
from gpudra_operator.slicegc.plan import NODE_GONE, NODE_UNSELECTED, OWNER_UID_MISMATCH, SUPERSEDED_GENERATION

CONFIG = resource_type("gpudra.io/v1alpha1", "GpuDraConfig")
SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
NODE = resource_type("v1", "Node")
POD = resource_type("v1", "Pod")
GRACE = 30.0  # the CRD's minimum gracePeriod


def slice_body(name: str, driver: str, node: str, *, generation: int = 1, owner_uid: str | None = None) -> Obj:
    return fake_slice(name, driver, node, generation=generation, owner_uid=owner_uid, labels={"gpudra.io/test": "gc"})


class Scene:
    """One test's GpuDraConfig (reconciled as far as the GC cares), its slices, agent pods and a
    collector with a fake clock."""

    def __init__(self, kube: Kube, namespace: str, suffix: str) -> None:
        self.kube, self.namespace, self.suffix = kube, namespace, suffix
        self.name, self.driver = f"gc-{suffix}", f"gc{suffix}.gpudra.io"
        self.selector = {"gpudra.io/gc-test": suffix}
        self.now = 1000.0
        self.slices: list[str] = []
        self.collector = SliceCollector(kube, EventRecorder(kube), clock=lambda: self.now)

    async def create_config(self, **gc: Any) -> Obj:
        body = {"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig", "metadata": {"name": self.name},
                "spec": {"driverName": self.driver,
                         "agent": {"namespace": self.namespace, "nodeSelector": self.selector},
                         "resourceSliceGC": {"gracePeriod": f"{GRACE:.0f}s", **gc}}}
        created = await self.kube.create(body)
        # What the reconciler writes (no operator runs in this module): reconciled, no conflict.
        return await self.kube.patch(CONFIG, self.name, {"status": {
            "observedGeneration": created["metadata"]["generation"], "devices": 7,
            "conditions": [{"type": "Degraded", "status": "False", "reason": "AsExpected", "message": "",
                            "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}, subresource="status")

    async def slice(self, node: str, *, generation: int = 1, owner_uid: str | None = None,
                    driver: str | None = None) -> Obj:
        name = f"{node}-g{generation}-{secrets.token_hex(2)}"
        self.slices.append(name)
        return await self.kube.create(slice_body(name, driver or self.driver, node, generation=generation,
                                                 owner_uid=owner_uid))

    async def agent_pod(self, node: str) -> Obj:
        return await self.kube.create({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"agent-{node}", "namespace": self.namespace, "labels": agent_labels(self.name)},
            "spec": {"nodeName": node, "containers": [{"name": "agent", "image": "example.com/gpudra:test"}]}})

    async def run(self) -> GcResult:
        result = await self.collector.run_pass(await self.kube.get(CONFIG, self.name))
        assert result is not None
        return result

    async def exists(self, obj: Obj) -> bool:
        return await self.kube.get(SLICE, obj["metadata"]["name"]) is not None

    async def cleanup(self) -> None:
        for name in self.slices:
            await self.kube.delete(SLICE, name)
        await self.kube.delete(CONFIG, self.name)


def verdicts(result: GcResult, which: str = "condemned") -> dict[str, str]:
    return {v.slice.name: v.rule for v in getattr(result, which)}


@pytest_asyncio.fixture(loop_scope="session")
async def scene(kube: Kube, crd_installed: Obj, namespace: str) -> AsyncIterator[Scene]:
    s = Scene(kube, namespace, secrets.token_hex(3))
    try:
        yield s
    finally:
        await s.cleanup()


@contextlib.contextmanager
def kube_gc_paused(cluster: ControlPlane) -> Iterator[None]:
    """Freeze kube-controller-manager: its garbage collector deletes a dependent whose owner UID no
    longer resolves, and this test must show gpudra's rule acting on its own (clusters run kcm with
    lag, or slices carry owners kcm cannot see)."""
    kcm = next(c for c in cluster.components if c.name == "kube-controller-manager")
    assert kcm.process is not None
    os.kill(kcm.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(kcm.process.pid, signal.SIGCONT)


async def gc_events(kube: Kube, name: str, reason: str) -> list[Obj]:
    return [e for e in await events_about(kube, name) if e["reason"] == reason]


# --- rules -----------------------------------------------------------------------------------

async def test_rule_node_gone(scene: Scene, fake_nodes: Callable[..., Any], kube: Kube) -> None:
    node = await fake_nodes("gc", labels=scene.selector)
    await scene.create_config()
    await scene.agent_pod(node["metadata"]["name"])
    healthy = await scene.slice(node["metadata"]["name"], owner_uid=node["metadata"]["uid"])
    orphan = await scene.slice(f"gone-{scene.suffix}")  # no owner: the Kubernetes GC never sees it

    result = await scene.run()
    assert verdicts(result) == {orphan["metadata"]["name"]: NODE_GONE}
    assert [v.slice.name for v in result.deleted] == [orphan["metadata"]["name"]]
    assert not await scene.exists(orphan) and await scene.exists(healthy)
    assert (result.slices, result.agent_pods) == (2, 1) and result.nodes >= 1

    status = (await kube.get(CONFIG, scene.name))["status"]
    assert {k: v for k, v in status["gc"].items() if k != "lastRun"} == {
        "found": 1, "deleted": 1, "errors": 0, "pending": 0, "skipped": 0, "dryRun": False}
    # The merge patch touched status.gc only: the reconciler's fields are intact.
    assert status["observedGeneration"] == 1 and status["devices"] == 7
    assert [c["type"] for c in status["conditions"]] == ["Degraded"]
    [event] = await gc_events(kube, scene.name, "StaleSlicesDeleted")
    assert event["type"] == "Normal" and orphan["metadata"]["name"] in event["message"]
    assert f"{NODE_GONE} 1" in event["message"]


async def test_rule_owner_uid_of_an_older_node(scene: Scene, cluster: ControlPlane, kube: Kube) -> None:
    await scene.create_config()
    name = f"reborn-{scene.suffix}"
    with kube_gc_paused(cluster):
        old = await create_fake_node(kube, name, scene.selector)
        stale = await scene.slice(name, owner_uid=old["metadata"]["uid"])
        await delete_node(kube, name)
        new = await create_fake_node(kube, name, scene.selector)  # same name, new UID
        try:
            current = await scene.slice(name, generation=1, owner_uid=new["metadata"]["uid"])
            result = await scene.run()
            assert verdicts(result) == {stale["metadata"]["name"]: OWNER_UID_MISMATCH}
            assert new["metadata"]["uid"] in result.condemned[0].reason
            assert not await scene.exists(stale) and await scene.exists(current)
        finally:
            await delete_node(kube, name)


async def test_rule_node_unselected_without_agent_after_grace(scene: Scene, fake_nodes: Callable[..., Any]) -> None:
    await scene.create_config()
    dropped = await fake_nodes("gc", labels={"gpudra.io/gc-test": "not-any-more"})
    selected = await fake_nodes("gc", labels=scene.selector)  # selected, agent not there (yet): kept
    stale = await scene.slice(dropped["metadata"]["name"], owner_uid=dropped["metadata"]["uid"])
    keep = await scene.slice(selected["metadata"]["name"], owner_uid=selected["metadata"]["uid"])

    first = await scene.run()
    assert verdicts(first, "pending") == {stale["metadata"]["name"]: NODE_UNSELECTED} and first.condemned == []
    scene.now += GRACE - 1
    almost = await scene.run()
    assert almost.condemned == [] and await scene.exists(stale)
    scene.now += 1
    due = await scene.run()
    assert verdicts(due) == {stale["metadata"]["name"]: NODE_UNSELECTED}
    assert not await scene.exists(stale) and await scene.exists(keep)


async def test_rule_superseded_generation_after_grace(scene: Scene, fake_nodes: Callable[..., Any]) -> None:
    await scene.create_config()
    node = await fake_nodes("gc", labels=scene.selector)
    name, uid = node["metadata"]["name"], node["metadata"]["uid"]
    await scene.agent_pod(name)
    old = await scene.slice(name, generation=1, owner_uid=uid)
    new = await scene.slice(name, generation=2, owner_uid=uid)

    first = await scene.run()
    assert verdicts(first, "pending") == {old["metadata"]["name"]: SUPERSEDED_GENERATION}
    assert first.condemned == [] and await scene.exists(old)
    scene.now += GRACE
    due = await scene.run()
    assert verdicts(due) == {old["metadata"]["name"]: SUPERSEDED_GENERATION}
    assert not await scene.exists(old) and await scene.exists(new)


# --- never-rules -----------------------------------------------------------------------------

async def test_never_current_generation_on_a_node_with_an_agent_pod(scene: Scene,
                                                                   fake_nodes: Callable[..., Any]) -> None:
    await scene.create_config()
    # No longer selected (labels changed), but the DaemonSet controller has not removed the pod yet.
    node = await fake_nodes("gc", labels={"gpudra.io/gc-test": "not-any-more"})
    await scene.agent_pod(node["metadata"]["name"])
    current = await scene.slice(node["metadata"]["name"], owner_uid=node["metadata"]["uid"])
    for _ in range(2):
        result = await scene.run()
        assert result.condemned == [] and result.pending == [] and result.agent_pods == 1
        scene.now += GRACE * 10
    assert await scene.exists(current)


async def test_never_another_drivers_slices(scene: Scene) -> None:
    await scene.create_config()
    gone = f"gone-{scene.suffix}"
    foreign = await scene.slice(gone, driver=f"other{scene.suffix}.example.com")
    ours = await scene.slice(gone)
    result = await scene.run()
    assert verdicts(result) == {ours["metadata"]["name"]: NODE_GONE} and result.slices == 1
    assert await scene.exists(foreign) and not await scene.exists(ours)


async def test_never_anything_in_dry_run_but_it_reports(scene: Scene, fake_nodes: Callable[..., Any],
                                                        kube: Kube) -> None:
    await scene.create_config(dryRun=True)
    dropped = await fake_nodes("gc", labels={"gpudra.io/gc-test": "not-any-more"})
    orphan = await scene.slice(f"gone-{scene.suffix}")
    unselected = await scene.slice(dropped["metadata"]["name"], owner_uid=dropped["metadata"]["uid"])
    await scene.run()
    scene.now += GRACE
    result = await scene.run()
    assert verdicts(result) == {orphan["metadata"]["name"]: NODE_GONE,
                                unselected["metadata"]["name"]: NODE_UNSELECTED}
    assert result.deleted == [] and await scene.exists(orphan) and await scene.exists(unselected)
    gc = (await kube.get(CONFIG, scene.name))["status"]["gc"]
    assert (gc["found"], gc["deleted"], gc["dryRun"]) == (2, 0, True)
    assert await gc_events(kube, scene.name, "StaleSlicesDeleted") == []


# --- the race between list and delete ----------------------------------------------------------

class RacingKube(Kube):
    """Updates each slice right before the GC's delete reaches the API server."""

    async def delete(self, rtype: Any, name: str, namespace: str | None = None, **kwargs: Any) -> bool:
        if rtype == SLICE:
            await self.patch(SLICE, name, {"metadata": {"labels": {"gpudra.io/touched": "yes"}}})
        return await super().delete(rtype, name, namespace, **kwargs)


async def test_slice_updated_between_list_and_delete_is_not_deleted(scene: Scene, kube: Kube) -> None:
    await scene.create_config()
    orphan = await scene.slice(f"gone-{scene.suffix}")
    racing = RacingKube(kube.api, "gpudra-operator")
    scene.collector = SliceCollector(racing, EventRecorder(racing), clock=lambda: scene.now)
    result = await scene.run()
    assert verdicts(result) == {orphan["metadata"]["name"]: NODE_GONE}
    assert result.deleted == [] and result.errors == [] and [v.slice.name for v in result.skipped] == [
        orphan["metadata"]["name"]]
    live = await kube.get(SLICE, orphan["metadata"]["name"])
    assert live is not None and live["metadata"]["labels"]["gpudra.io/touched"] == "yes"
    assert (await kube.get(CONFIG, scene.name))["status"]["gc"]["skipped"] == 1
    # The next pass decides again on the new version, and deletes it.
    scene.collector = SliceCollector(kube, EventRecorder(kube), clock=lambda: scene.now)
    again = await scene.run()
    assert [v.slice.name for v in again.deleted] == [orphan["metadata"]["name"]]


async def test_no_pass_for_a_config_in_conflict_or_disabled(scene: Scene, kube: Kube) -> None:
    body = await scene.create_config()
    orphan = await scene.slice(f"gone-{scene.suffix}")
    conflicted = {**body, "status": {**body["status"], "conditions": [
        {"type": "Degraded", "status": "True", "reason": "Conflict", "message": "driver claimed",
         "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}
    assert await scene.collector.run_pass(conflicted) is None
    disabled = {**body, "spec": {**body["spec"], "resourceSliceGC": {"enabled": False}}}
    assert await scene.collector.run_pass(disabled) is None
    assert await scene.exists(orphan) and "gc" not in (await kube.get(CONFIG, scene.name))["status"]


async def test_nodes_are_listed_as_metadata_only(kube: Kube, fake_nodes: Callable[..., Any]) -> None:
    await fake_nodes("gc")
    nodes = [n async for n in kube.list(NODE, metadata_only=True, page_size=1)]
    assert len(nodes) >= 1
    assert all(n["kind"] == "PartialObjectMetadata" and "status" not in n and n["metadata"]["uid"] for n in nodes)
