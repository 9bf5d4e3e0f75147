"""Keeps this node's ResourceSlices equal to the discovered devices: the I/O half of publishing.

A watch on our own slices (field selector: our driver on our node) feeds a local cache; any event,
a rescan that changed the devices, or a failed write wakes the sync loop, which plans against the
cache (:func:`gpudra_driver.publishing.plan_publish`) and writes only the difference. A deleted or
foreign-edited slice is therefore restored as soon as its watch event arrives, not on a timer."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence


from gpudra_driver import metrics
from gpudra_driver.devicemodel import Device
from gpudra_driver.kubeapi import Kube, Obj, error_message, is_status, resource_type
from gpudra_driver.publishing import plan_publish

SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
NODE = resource_type("v1", "Node")
log = logging.getLogger(__name__)


class Backoff:
    """Exponential retry delay for an unreachable or failing API server."""

    def __init__(self, initial: float = 0.2, maximum: float = 30.0) -> None:
        self.initial, self.maximum, self.delay = initial, maximum, initial

    def next(self) -> float:
        delay, self.delay = self.delay, min(self.delay * 2, self.maximum)
        return delay

    def reset(self) -> None:
        self.delay = self.initial


class SlicePublisher:
    def __init__(self, kube: Kube, driver: str, node_name: str) -> None:
        self.kube = kube
        self.driver = driver
        self.node_name = node_name
        self.devices: list[Device] | None = None  # None: nothing discovered yet, publish nothing
        self.observed: dict[str, Obj] = {}
        self.synced = asyncio.Event()  # set once the cache holds a full list
        self.last_publish: float | None = None  # wall time of the last successful write or no-op
        self.published = asyncio.Event()  # set once the pool was first confirmed current
        self.generation = 0
        self._wake = asyncio.Event()
        self._node_uid: str | None = None
        self._selector = f"spec.driver={driver},spec.nodeName={node_name}"

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
        backoff = Backoff()
        while True:
            try:
                page = await self.kube.request("GET", SLICE.path(), query={"fieldSelector": self._selector})
                self.observed = {s["metadata"]["name"]: s for s in page.get("items") or []}
                self.synced.set()
                self._wake.set()
                version = page["metadata"]["resourceVersion"]
                backoff.reset()
                async for kind, obj in self.kube.watch(SLICE, field_selector=self._selector,
                                                       resource_version=version, timeout_seconds=300):
                    if kind == "ERROR":  # e.g. 410 Gone: our resourceVersion expired; relist
                        break
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
            except asyncio.CancelledError:
                raise
            except Exception as error:  # API server unreachable or restarting: retry, then relist
                delay = backoff.next()
                log.warning("watching ResourceSlices failed (%s); retrying in %.1fs", _describe(error), delay)
                await asyncio.sleep(delay)

    # --- the writes -----------------------------------------------------------------------
    async def _node_owner_uid(self) -> str:
        if self._node_uid is None:
            node = await self.kube.get(NODE, self.node_name)
            if node is None:
                raise LookupError(f"Node {self.node_name} does not exist")
            self._node_uid = node["metadata"]["uid"]
        return self._node_uid

    async def _sync_loop(self) -> None:
        backoff = Backoff()
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.devices is None or not self.synced.is_set():
                continue
            try:
                await self.sync_once()
                metrics.published(len(self.devices), len(self.observed))
                backoff.reset()
            except asyncio.CancelledError:
                raise
            except Exception as error:
                if is_status(error, 409):  # a precondition or conflict: our cache is stale
                    delay = backoff.next()  # let the watch deliver the newer object before replanning
                    log.info("ResourceSlice write conflicted (%s); replanning in %.1fs", _describe(error), delay)
                    await asyncio.sleep(delay)
                    self._wake.set()
                    continue
                metrics.publish_failed()
                delay = backoff.next()
                log.warning("publishing ResourceSlices failed (%s); retrying in %.1fs", _describe(error), delay)
                await asyncio.sleep(delay)
                self._wake.set()

    async def sync_once(self) -> None:
        assert self.devices is not None
        node_uid = await self._node_owner_uid()
        plan = plan_publish(self.driver, self.node_name, node_uid, self.devices, self.observed,
                            self.generation)
        if plan.empty:
            self.generation = plan.generation
            self.last_publish = time.time()
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
        self.generation = plan.generation
        self.last_publish = time.time()
        self.published.set()
        count = sum(len(s["spec"].get("devices") or []) for s in plan.apply)
        log.info("published %d device(s) in %d ResourceSlice(s), pool %s generation %d",
                 count, len(plan.apply), self.node_name, plan.generation)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error_message(error)}"[:300]
