"""Events on a config's children (its DaemonSets and DeviceClasses), turned into as little work as
they call for.

A reconcile's own writes echo back as events, and a DaemonSet rollout over a fleet moves its status
thousands of times: each event is judged against what the last reconcile wanted (pure:
:func:`child_event_action`), only the newest event of a child waits to be judged, and a burst of
them needs one reconcile after the running one, not one each."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from gpudra_core.diff import contains
from gpudra_core.kubeapi import NETWORK_ERRORS, Obj, error_message

from gpudra_operator.configlocks import Coalesced
from gpudra_operator.reconcile import Outcome, Reconciler
from gpudra_operator.render import Rendered
from gpudra_operator.statusrefresh import StatusRefresh

log = logging.getLogger("gpudra.operator")


def child_key(obj: Mapping[str, Any]) -> tuple[str, str | None, str]:
    meta = obj["metadata"]
    return obj["kind"], meta.get("namespace"), meta["name"]


def _wanted(rendered: Rendered, child: Mapping[str, Any]) -> Obj | None:
    """What a reconcile that rendered ``rendered`` wrote for ``child`` (None: it wants no such object)."""
    key = child_key(child)
    return next((o for o in rendered.objects if child_key(o) == key), None)


def child_event_action(event_type: str | None, child: Mapping[str, Any],
                       desired: Mapping[str, Any] | None, *, reconciled: bool) -> str:
    """What an event on one of a config's children calls for (pure), given what the config's last
    full reconcile wanted of that child (``desired``; None: nothing) and whether there was one.

    ``"reconcile"``: a deletion or hand edit of a wanted child, a child that should not be there,
    or no reconcile to compare with (the operator just started). ``"none"``: the deletion of an
    unwanted child (the echo of a prune), or a DeviceClass as wanted (the echo of its apply).
    ``"status"``: a DaemonSet as wanted, whose status may have moved. A DaemonSet rollout over a
    fleet moves its status thousands of times; each move then costs a status refresh (two GETs,
    a PATCH when the numbers changed) instead of a full reconcile."""
    if not reconciled:
        return "reconcile"
    if event_type == "DELETED":
        return "none" if desired is None else "reconcile"
    if desired is None or not contains(child, desired):
        return "reconcile"
    return "status" if child.get("kind") == "DaemonSet" else "none"


class ChildEvents:
    """The child events of every config, judged in the background, each after the reconcile
    running on its config has finished."""

    def __init__(self, reconciler: Reconciler, status: StatusRefresh) -> None:
        self.reconciler = reconciler
        self.status = status
        self._reconciles = Coalesced(reconciler.locks)
        self._newest: dict[tuple[str, str, str | None, str], tuple[str | None, Obj]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def in_flight(self) -> frozenset[asyncio.Task[None]]:
        """The events being judged now (:meth:`on_event_soon`)."""
        return frozenset(self._tasks)

    async def reconcile(self, name: str) -> Outcome | None:
        """Reconcile after a child event. A burst of events (ten classes applied at once) needs one
        reconcile after the running one, not ten: a trigger that finds one already queued is dropped."""
        return await self._reconciles.run(name, lambda: self.reconciler.reconcile_current(name))

    async def on_event(self, name: str, event_type: str | None, child: Obj) -> None:
        """An event on a child of config ``name`` (see :func:`child_event_action`), judged after
        a reconcile running now has finished: the echo of its own writes is then as it wanted.
        An event that comes while an older one of the same child waits replaces it: the child is
        judged as it is now, so the newest event is the only one that matters."""
        key = (name, *child_key(child))
        waiting = key in self._newest
        self._newest[key] = (event_type, child)
        if waiting:
            return
        async with self.reconciler.locks.lock(name):
            event_type, child = self._newest.pop(key)
            last = self.reconciler.last(name)
            action = child_event_action(event_type, child, _wanted(last.rendered, child) if last else None,
                                        reconciled=last is not None)
        if action == "reconcile":
            await self.reconcile(name)
        elif action == "status":
            await self.status.refresh(name)

    def on_event_soon(self, name: str, event_type: str | None, child: Obj) -> None:
        """:meth:`on_event` in a task of its own, so kopf's handler returns at once. kopf queues
        every event of an object and hands them to its handler one at a time; during a rollout the
        DaemonSet's status events come faster than status refreshes, and queued there, each keeps
        a whole DaemonSet in memory (thousands on a large fleet). Here only the newest waits."""
        task = asyncio.create_task(self._on_event_logged(name, event_type, child))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Cancel the child events still being judged (:meth:`on_event_soon`): the operator is
        stopping, its client is about to close, and kopf would wait for these tasks (up to 5 s)
        before the Lease is released. The next active replica reconciles every config anyway."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _on_event_logged(self, name: str, event_type: str | None, child: Obj) -> None:
        try:
            await self.on_event(name, event_type, child)
        except ApiException as error:
            log.warning("reconcile of GpuDraConfig %s after a child event failed: %s", name, error_message(error))
        except NETWORK_ERRORS as error:  # the drift check retries
            log.warning("reconcile of GpuDraConfig %s after a child event failed: %r", name, error)
