"""Keeps this node's ResourceSlices equal to the discovered devices: the I/O half of publishing.

A watch on our own slices (field selector: our driver on our node) feeds a local cache; any event,
a rescan that changed the devices, or a failed write wakes the sync loop, which plans against the
cache (:func:`gpudra_driver.publishing.plan.plan_publish`) and writes only the difference. A deleted or
foreign-edited slice is therefore restored as soon as its watch event arrives, not on a timer.

An unreachable or failing API server is retried with exponential backoff (:mod:`tenacity`): a
fresh retry sequence per list and per sync, so a success resets the wait. Each wait is up to a
fifth shorter, at random: the agents of a whole fleet that lost the API server together come back
spread out, not all in the same second."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from functools import partial

from tenacity import RetryCallState

from gpudra_driver import metrics
from gpudra_core.devicemodel import Device
from gpudra_driver.publishing.apisupport import taints_dropped
from gpudra_core.kubeapi import Kube, Obj, error_message, is_status, resource_type
from gpudra_driver.publishing.plan import plan_publish
from gpudra_driver.retrying import RETRY_INITIAL, retrying

SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
NODE = resource_type("v1", "Node")
log = logging.getLogger(__name__)


class SlicePublisher:
    def __init__(self, kube: Kube, driver: str, node_name: str) -> None:
        self.kube = kube
        self.driver = driver
        self.node_name = node_name
        self.devices: list[Device] | None = None  # None: nothing discovered yet, publish nothing
        self.observed: dict[str, Obj] = {}
        self.synced = asyncio.Event()  # set once the cache holds a full list
        self.published = asyncio.Event()  # set once the pool was first confirmed current
        self.generation = 0
        self._wake = asyncio.Event()
        self._node_uid: str | None = None
        self._selector = f"spec.driver={driver},spec.nodeName={node_name}"
        # called when the API server stored a slice we wrote with device taints without them
        # (Kubernetes 1.35, DRADeviceTaints off): device health then stops publishing taints
        self.on_taints_dropped: Callable[[], None] | None = None

    def set_devices(self, devices: Sequence[Device]) -> bool:
        """Publish ``devices`` from now on; True when they differ from the previous set."""
        devices = list(devices)
        changed = self.devices != devices
        self.devices = devices
        if changed:
            self._wake.set()
        return changed

    async def run(self) -> None:
        """Watch and sync until cancelled (SIGTERM leaves the slices in place, see docs)."""
        await asyncio.gather(self._watch_loop(), self._sync_loop())

    # --- the cache ------------------------------------------------------------------------
    async def _watch_loop(self) -> None:
        while True:
            version: str = await retrying(partial(_log_retry, "listing ResourceSlices"))(self._relist)
            try:
                await self._follow(version)
            except Exception as error:  # cut or refused: relist, after a first delay so it cannot spin
                log.warning("watching ResourceSlices failed (%s); retrying in %.1fs", _describe(error),
                            RETRY_INITIAL)
                await asyncio.sleep(RETRY_INITIAL)

    async def _relist(self) -> str:
        """Fill the cache from a list; the resourceVersion to watch from."""
        page = await self.kube.request("GET", SLICE.path(), query={"fieldSelector": self._selector})
        self.observed = {s["metadata"]["name"]: s for s in page.get("items") or []}
        self.synced.set()
        self._wake.set()
        return str(page["metadata"]["resourceVersion"])

    async def _follow(self, version: str) -> None:
        """Keep the cache current from a watch until it ends (then relist)."""
        async for kind, obj in self.kube.watch(SLICE, field_selector=self._selector,
                                               resource_version=version):
            if kind == "ERROR":  # e.g. 410 Gone: our resourceVersion expired; relist
                return
            if kind == "BOOKMARK":
                continue
            name = obj["metadata"]["name"]
            if kind == "DELETED":
                self.observed.pop(name, None)
                # The garbage collector deletes slices whose Node owner is gone: a Node
                # recreated under the same name has a new UID, so read it again.
                self._node_uid = None
            else:
                self.observed[name] = obj
            self._wake.set()

    # --- the writes -----------------------------------------------------------------------
    async def _node_owner_uid(self) -> str:
        if self._node_uid is None:
            node = await self.kube.get(NODE, self.node_name)
            if node is None:
                raise LookupError(f"Node {self.node_name} does not exist")
            self._node_uid = node["metadata"]["uid"]
        return self._node_uid

    async def _sync_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.devices is None or not self.synced.is_set():
                continue
            await retrying(_sync_failed)(self.sync_once)  # each attempt plans afresh
            metrics.published(len(self.devices), len(self.observed),
                              sum(d.allow_multiple_allocations for d in self.devices))

    async def sync_once(self) -> None:
        assert self.devices is not None
        node_uid = await self._node_owner_uid()
        plan = plan_publish(self.driver, self.node_name, node_uid, self.devices, self.observed,
                            self.generation)
        if plan.empty:
            self.generation = plan.generation
            self.published.set()
            log.debug("pool %s generation %d is up to date", self.node_name, plan.generation)
            return
        for ref in plan.delete:  # obsolete first, so the pool never shows more slices than it has
            log.info("deleting obsolete ResourceSlice %s", ref.name)
            await self.kube.delete(SLICE, ref.name, uid=ref.uid, resource_version=ref.resource_version)
            self.observed.pop(ref.name, None)
        for desired in plan.apply:
            name = desired["metadata"]["name"]
            self.observed[name] = await self.kube.apply(desired)
            if self.on_taints_dropped is not None and taints_dropped(desired, self.observed[name]):
                self.on_taints_dropped()
        self.generation = plan.generation
        self.published.set()
        count = sum(len(s["spec"].get("devices") or []) for s in plan.apply)
        log.info("published %d device(s) in %d ResourceSlice(s), pool %s generation %d",
                 count, len(plan.apply), self.node_name, plan.generation)


def _failure(state: RetryCallState) -> tuple[BaseException, float]:
    """What failed in the attempt ``state`` describes, and the seconds until the next one."""
    error = state.outcome.exception() if state.outcome is not None else None
    assert error is not None and state.next_action is not None  # tenacity sleeps only after a failure
    return error, state.next_action.sleep


def _log_retry(what: str, state: RetryCallState) -> None:
    error, delay = _failure(state)
    log.warning("%s failed (%s); retrying in %.2fs", what, _describe(error), delay)


def _sync_failed(state: RetryCallState) -> None:
    error, delay = _failure(state)
    if is_status(error, 409):  # a precondition or conflict: our cache is stale
        # Not an error: the wait lets the watch deliver the newer object before the replan.
        log.info("ResourceSlice write conflicted (%s); replanning in %.2fs", _describe(error), delay)
        return
    metrics.publish_failed()
    log.warning("publishing ResourceSlices failed (%s); retrying in %.2fs", _describe(error), delay)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error_message(error)}"[:300]
