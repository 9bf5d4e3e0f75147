"""What the operator does once a GpuDraConfig is deleted: its children in a safe order, then the
driver's ResourceSlices of every node.

Nothing here blocks the deletion (no finalizer): the children are owned by the config, so the
garbage collector removes them without an operator, and each agent removes its own node's slices
and files as it stops for an uninstall (gpudra_driver.uninstall). The operator, when it runs,
makes that ordered and complete: DeviceClasses first (no new allocations), then the agents, and
only once no agent of the config is left to republish them, the driver's slices on every node,
those of nodes whose agent could not clean up included. The config may have been re-created under
the same name meanwhile: only children owned by the deleted one (its UID) are touched, and a
driver that a live config manages keeps its slices."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from gpudra_core.kubeapi import Kube, Obj, resource_type

from gpudra_operator import metrics
from gpudra_operator.configlocks import ConfigLocks
from gpudra_operator.devicecount import SLICE
from gpudra_operator.reconcile import CONFIG, DAEMONSET, DEVICE_CLASS
from gpudra_operator.render import AGENT_NAME, agent_selector, child_selector
from gpudra_operator.spec import GpuDraConfig
from gpudra_operator.slicegc.apply import SliceCollector

POD = resource_type("v1", "Pod")
AGENTS_GONE_WITHIN = 600.0  # past this, the agents' own cleanup and the kubelet's wiping remain
log = logging.getLogger("gpudra.operator")


def owned_by(obj: Mapping[str, Any], uid: str | None) -> bool:
    return bool(uid) and any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or [])


def driver_still_managed(configs: list[Obj], deleted: GpuDraConfig) -> bool:
    """Whether a live config other than ``deleted`` (by UID: the same name may be back) manages its
    driver, whose slices are then that config's. Pure."""
    return any(o["metadata"].get("uid") != deleted.uid and not o["metadata"].get("deletionTimestamp")
               and GpuDraConfig.from_body(o).spec.driver_name == deleted.spec.driver_name for o in configs)


class Teardown:
    """Tears down deleted configs, each once, in the background."""

    def __init__(self, kube: Kube, locks: ConfigLocks, slice_gc: SliceCollector, *,
                 forget_driver: Callable[[str], None], poll: float = 2.0,
                 agents_gone_within: float = AGENTS_GONE_WITHIN) -> None:
        self.kube, self.locks, self.slice_gc = kube, locks, slice_gc
        self.forget_driver = forget_driver  # the device count of a driver no config manages
        self.poll, self.agents_gone_within = poll, agents_gone_within
        self._running: dict[str, asyncio.Task[None]] = {}  # config UID -> its teardown

    def start(self, body: Mapping[str, Any]) -> None:
        """Tear down the config ``body`` (deleted, or being deleted) unless that is under way."""
        uid = body["metadata"].get("uid") or ""
        if uid and uid not in self._running:
            task = asyncio.create_task(self._tear_down(GpuDraConfig.from_body(body)), name=f"teardown {uid}")
            self._running[uid] = task
            task.add_done_callback(lambda _: self._running.pop(uid, None))

    @property
    def in_flight(self) -> frozenset[asyncio.Task[None]]:
        return frozenset(self._running.values())

    async def close(self) -> None:
        """Stop every teardown: a new leader does not know of them, and the garbage collector, the
        agents and the kubelet finish what they would have done."""
        for task in self._running.values():
            task.cancel()
        await asyncio.gather(*self._running.values(), return_exceptions=True)

    async def _tear_down(self, config: GpuDraConfig) -> None:
        metrics.forget_config(config.name)  # a config of that name back sets them again
        try:
            await self._remove_children(config)
            if not await self._agents_gone(config):
                return
            if driver_still_managed([o async for o in self.kube.list(CONFIG)], config):
                log.info("driver %s is still managed by another GpuDraConfig; its slices stay", config.spec.driver_name)
                return
            self.forget_driver(config.spec.driver_name)
            deleted = 0
            async for slice_ in self.kube.list(SLICE, field_selector=f"spec.driver={config.spec.driver_name}"):
                async with self.slice_gc.limiter:  # the same delete rate limit as the GC's passes
                    deleted += await self.kube.delete(SLICE, slice_["metadata"]["name"], uid=slice_["metadata"]["uid"])
            log.info("GpuDraConfig %s removed: its DeviceClasses, agents and %d ResourceSlice(s) are gone",
                     config.name, deleted)
        except Exception as error:  # the garbage collector, the agents and the kubelet still clean up
            log.warning("teardown of the deleted GpuDraConfig %s stopped: %r", config.name, error)

    async def _remove_children(self, config: GpuDraConfig) -> None:
        """The deleted config's DeviceClasses (no new allocations), then its agent DaemonSet, both
        as the garbage collector would, but now and in this order. Under the config's lock, so that
        a reconcile in flight has finished writing."""
        async with self.locks.held(config.name):
            async for device_class in self.kube.list(DEVICE_CLASS, label_selector=child_selector(config.name)):
                if owned_by(device_class, config.uid):
                    await self.kube.delete(DEVICE_CLASS, device_class["metadata"]["name"],
                                           uid=device_class["metadata"]["uid"])
            daemonset = await self.kube.get(DAEMONSET, AGENT_NAME, config.spec.agent.namespace)
            if daemonset is not None and owned_by(daemonset, config.uid):
                await self.kube.delete(DAEMONSET, AGENT_NAME, config.spec.agent.namespace,
                                       uid=daemonset["metadata"]["uid"], propagation="Foreground")

    async def _agents_gone(self, config: GpuDraConfig) -> bool:
        """Wait until no agent pod of the config is left to republish its slices (False: a live
        config took the driver over, or they outlived the wait)."""
        deadline = time.monotonic() + self.agents_gone_within
        while True:
            pods = [p async for p in self.kube.list(POD, config.spec.agent.namespace,
                                                    label_selector=agent_selector(config.name), metadata_only=True)]
            if not pods:
                return True
            if driver_still_managed([o async for o in self.kube.list(CONFIG)], config):
                log.info("driver %s is managed by a GpuDraConfig again; its slices stay", config.spec.driver_name)
                return False
            if time.monotonic() > deadline:
                log.warning("GpuDraConfig %s: %d agent pod(s) still there after %.0fs; their agents and the kubelet "
                            "remove what is left of the driver's slices", config.name, len(pods), self.agents_gone_within)
                return False
            await asyncio.sleep(self.poll)
