"""The operator's periodic work on each live GpuDraConfig: drift repair and the ResourceSlice GC,
a loop of each per config, started and stopped as the config's watch events say, and the teardown
(:mod:`gpudra_operator.teardown`) of one deleted.

Tasks of the operator's own rather than kopf daemons: kopf guards every object that has a daemon
with its finalizer, and a finalizer outlives an operator that an uninstall (``kubectl delete -k``,
a GitOps prune) removes first, leaving the config, and the CRD with it, Terminating for good."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from gpudra_core.kubeapi import Obj, error_message

from gpudra_operator import metrics
from gpudra_operator.reconcile import Reconciler
from gpudra_operator.slicegc.apply import SliceCollector
from gpudra_operator.teardown import Teardown

log = logging.getLogger("gpudra.operator")


def is_deleted(event_type: str | None, body: Mapping[str, Any]) -> bool:
    return event_type == "DELETED" or bool(body["metadata"].get("deletionTimestamp"))


class ConfigLoops:
    """The loops of every live config, keyed by name and UID (a config deleted and created again
    under its name gets new loops), fed the newest body each watch event brings."""

    def __init__(self, reconciler: Reconciler, slice_gc: SliceCollector, teardown: Teardown, *,
                 drift_interval: float, gc_tick: float, stopping: asyncio.Event) -> None:
        self.reconciler, self.slice_gc, self.teardown = reconciler, slice_gc, teardown
        self.stopping = stopping  # the operator is stopping (its Lease lost or SIGTERM): no new work
        self.drift_interval, self.gc_tick = drift_interval, gc_tick
        self._bodies: dict[str, Obj] = {}
        self._loops: dict[str, tuple[str, list[asyncio.Task[None]]]] = {}  # name -> (UID, its loops)
        self._closed = False  # the operator stops: an event arriving now starts nothing

    def observe(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        """A watch event on a config (None: one of the initial listing)."""
        if self._closed:
            return
        name, uid = body["metadata"]["name"], body["metadata"].get("uid") or ""
        if is_deleted(event_type, body):
            if self._loops.get(name, ("",))[0] == uid:
                self._stop(name)
            self.teardown.start(body)
            return
        if self._loops.get(name, ("",))[0] != uid:
            self._stop(name)  # the loops of a config of this name deleted meanwhile, if any
            self._loops[name] = (uid, [asyncio.create_task(self._repair_drift(name), name=f"drift {name}"),
                                       asyncio.create_task(self._collect_stale_slices(name), name=f"gc {name}")])
        self._bodies[name] = dict(body)  # before the loops first run: they start at the next await

    async def close(self) -> None:
        self._closed = True
        tasks = [task for _, loops in self._loops.values() for task in loops]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loops.clear()
        await self.teardown.close()

    def _stop(self, name: str) -> None:
        if name not in self._loops:
            return
        _, loops = self._loops.pop(name)
        for task in loops:
            task.cancel()
        self._bodies.pop(name, None)
        self.slice_gc.forget(name)

    async def _repair_drift(self, name: str) -> None:
        """Reconcile every drift interval: what the child watches cannot see (a template whose
        output changed, a dropped field to try again)."""
        while True:
            await asyncio.sleep(self.drift_interval)
            if self.stopping.is_set():
                return
            try:
                await self.reconciler.reconcile(self._bodies[name])
            except Exception as error:  # the next tick tries again
                log.warning("drift check of GpuDraConfig %s failed: %s", name,
                            error_message(error) if isinstance(error, ApiException) else repr(error))
            else:
                log.info("GpuDraConfig %s: drift check done", name)

    async def _collect_stale_slices(self, name: str) -> None:
        """The config's ResourceSlice GC (docs/gc.md). Its interval lives in the spec: the loop wakes
        every tick, and runs a pass on the newest body once spec.resourceSliceGC.interval has passed
        since the last one."""
        while not self.stopping.is_set():
            body = self._bodies[name]
            due_in = self.slice_gc.seconds_until_due(body)
            if due_in > 0:
                await asyncio.sleep(min(due_in, self.gc_tick))
                continue
            try:
                result = await self.slice_gc.run_pass(dict(body))
            except Exception as error:  # never let one bad pass end the loop; the next interval retries
                log.exception("ResourceSlice GC pass of GpuDraConfig %s failed: %s", name, error)
                result = None
            if result is None:  # disabled, not ready, or failed: look again next tick
                await asyncio.sleep(self.gc_tick)
            else:
                metrics.record_gc_pass(result.found, len(result.deleted))
