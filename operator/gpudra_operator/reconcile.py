"""One idempotent reconcile of a GpuDraConfig: load, decide, apply, report.

Decisions are pure (``render``, ``summarize``, ``find_conflicts``); this module only reads the
live objects, writes the difference with server-side apply, prunes by label and writes status.
Nothing is written when nothing changed, so a drift tick on a converged config costs reads only."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, TypeVar

from kubernetes_asyncio.client.exceptions import ApiException

from gpudra_core.agentcontract import DEVICE_PLUGIN_CONFLICT, DEVICE_PLUGIN_RESOLVED, event_source
from gpudra_core.diff import contains, dropped_fields
from gpudra_core.kubeapi import NETWORK_ERRORS, Kube, Obj, error_message, is_status, resource_type

from gpudra_operator.conditions import (ApplyError, Unsupported, agents_status, apply_conditions, class_matches_no_device,
                         summarize)
from gpudra_operator.classcounts import ClaimWatch, ClassCount, class_selectors
from gpudra_operator.devicecount import DeviceCounts
from . import metrics
from gpudra_operator.events import EVENT_NAMESPACE, EventRecorder
from gpudra_operator.features import CONSUMABLE_CAPACITY_UNSUPPORTED, FeatureProbe
from gpudra_operator.render import (DEFAULT_AGENT_IMAGE, LABEL_CONFIG, LABEL_MANAGED_BY, MANAGED_BY, MPS_NAME, Rendered,
                     child_selector, render)
from gpudra_operator.spec import GpuDraConfig, SpecError

CONFIG = resource_type("gpudra.io/v1alpha1", "GpuDraConfig")
DEVICE_CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")
DAEMONSET = resource_type("apps/v1", "DaemonSet")
EVENT = resource_type("v1", "Event")
T = TypeVar("T")
FIRST_LIST_WAIT = 2.0  # seconds a reconcile waits for a watch's first list before reporting without it
log = logging.getLogger("gpudra.operator")
REUSE_TTL = 10.0  # seconds a read that reconciles in a row would repeat is reused
DROPPED_FIELD_RECHECK = 3600.0  # seconds before a class whose field the API server dropped is applied again
# A reconcile holds its config's lock for at most this many request deadlines (kubeapi.Deadlines):
# each request has its deadline, but a reconcile is a few rounds of them in a row (the config
# LIST, the reads, the dry runs, the applies, status), and a lock held without end would keep the
# config from ever being reconciled again. A reconcile cut off is retried like a failed request.
LOCK_HELD_AT_MOST = 4


@dataclass
class Outcome:
    """What one reconcile did, for status, events, metrics and tests."""

    applied: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)
    apply_errors: list[ApplyError] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    render_errors: list[Any] = field(default_factory=list)
    unsupported: list[Unsupported] = field(default_factory=list)


def _age_key(body: Mapping[str, Any]) -> tuple[str, int, str]:
    """Older first. creationTimestamp has one-second resolution, so on a tie the incumbent (a
    config already reconciled without a conflict) wins, then the name decides."""
    meta, status = body["metadata"], body.get("status") or {}
    degraded: Mapping[str, Any] = next((c for c in status.get("conditions") or [] if c.get("type") == "Degraded"), {})
    incumbent = "observedGeneration" in status and degraded.get("reason") != "Conflict"
    return (meta.get("creationTimestamp") or "", 0 if incumbent else 1, meta["name"])


async def _reused(cache: dict[str, tuple[float, T]], key: str, compute: Callable[[], Awaitable[T]]) -> T:
    """``compute()``'s answer for ``key``, reused for REUSE_TTL seconds."""
    cached, now = cache.get(key), time.monotonic()
    if cached and now - cached[0] < REUSE_TTL:
        return cached[1]
    value = await compute()
    cache[key] = (now, value)
    return value


def _dropped_extended_resource(desired: Obj, stored: Obj | None) -> str | None:
    """The extendedResourceName the API server dropped from ``stored`` (its feature gate is off)."""
    name = (desired.get("spec") or {}).get("extendedResourceName")
    if stored is not None and name and not (stored.get("spec") or {}).get("extendedResourceName"):
        return str(name)
    return None


def _dropped_error(class_name: str, name: str) -> ApplyError:
    """The class is applied without the field; the config says so rather than pretend the class
    serves the name."""
    return ApplyError(
        "DeviceClass", class_name,
        f"spec.extendedResourceName {name} was dropped by the API server: its DRAExtendedResource "
        "feature gate is off (alpha and off in Kubernetes 1.35; beta and on from 1.36), so pods asking "
        f"for {name} are not served by this class. Upgrade to 1.36, enable the gate, or remove the field")


def _without_extended_resource(desired: Obj) -> Obj:
    return {**desired, "spec": {k: v for k, v in desired["spec"].items() if k != "extendedResourceName"}}


def find_conflicts(config: GpuDraConfig, body: Mapping[str, Any], others: Sequence[Mapping[str, Any]]) -> list[str]:
    """What ``config`` claims that an OLDER GpuDraConfig already claims. The older one wins; the
    newer one reports the conflict and touches nothing (pure)."""
    mine = config.spec
    my_classes = {c.name for c in mine.device_classes}
    conflicts: list[str] = []
    for other_body in sorted(others, key=_age_key):
        if other_body["metadata"]["name"] == config.name or _age_key(other_body) > _age_key(body):
            continue
        try:
            other = GpuDraConfig.from_body(other_body)
        except SpecError:
            continue
        who = f"GpuDraConfig {other.name!r}"
        if other.spec.driver_name == mine.driver_name:
            conflicts.append(f"driver name {mine.driver_name} is already claimed by {who}")
        if other.spec.agent.namespace == mine.agent.namespace:
            conflicts.append(f"the agent DaemonSet in namespace {mine.agent.namespace} is already managed by {who}")
        shared = sorted(my_classes & {c.name for c in other.spec.device_classes})
        if shared:
            conflicts.append(f"DeviceClass {', '.join(shared)} already claimed by {who}")
    return conflicts


async def _gather(awaitables: Any, limit: int = 16) -> list[Any]:
    """Run requests concurrently (bounded), results in order."""
    semaphore = asyncio.Semaphore(limit)

    async def one(awaitable: Any) -> Any:
        async with semaphore:
            return await awaitable

    return await _all(*(one(a) for a in awaitables))


def _class_status(applied: list[str], counts: list[ClassCount] | None,
                  old_status: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``status.deviceClasses[]``: each applied class with its counts; while they are not known
    yet, with the counts status held before (none for a class new to status)."""
    if counts is not None:
        return [c.to_status() for c in counts]
    before = {e["name"]: e for e in old_status.get("deviceClasses") or [] if isinstance(e, Mapping) and "name" in e}
    return [dict(before.get(name) or {"name": name}) for name in applied]


async def _all(*awaitables: Any) -> list[Any]:
    """Their results, once every one has finished; then the first error, if any (no write is
    left running behind a failed reconcile, which kopf retries)."""
    results = await asyncio.gather(*awaitables, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


@contextlib.asynccontextmanager
async def _queued_until_locked(queued: set[str], name: str, lock: asyncio.Lock) -> AsyncIterator[None]:
    """Hold ``lock``; ``name`` (added to ``queued`` by the caller) leaves ``queued`` once the lock
    is ours, so that a trigger arriving meanwhile queues the next run (or if waiting is cancelled)."""
    try:
        await lock.acquire()
    finally:
        queued.discard(name)
    try:
        yield
    finally:
        lock.release()


def child_key(obj: Mapping[str, Any]) -> tuple[str, str | None, str]:
    meta = obj["metadata"]
    return obj["kind"], meta.get("namespace"), meta["name"]


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


@dataclass
class _Reconciled:
    """What the last full reconcile of a config decided, for status refreshes between reconciles."""

    uid: str | None
    generation: int | None
    rendered: Rendered
    outcome: Outcome
    driver: str

    def wanted(self, child: Mapping[str, Any]) -> Obj | None:
        """What that reconcile wrote for ``child`` (None: it wants no such object)."""
        key = child_key(child)
        return next((o for o in self.rendered.objects if child_key(o) == key), None)


def _owned_by(live: Obj, config_name: str) -> bool:
    labels = live["metadata"].get("labels") or {}
    return labels.get(LABEL_MANAGED_BY) == MANAGED_BY and labels.get(LABEL_CONFIG) == config_name


class Reconciler:
    def __init__(self, kube: Kube, events: EventRecorder, *, agent_image: str = DEFAULT_AGENT_IMAGE,
                 device_counts: DeviceCounts | None = None, claims: ClaimWatch | None = None) -> None:
        self.agent_image = agent_image
        self.kube = kube
        self.events = events
        # status.devices comes from the operator's watch of the slices; without one (a reconcile
        # run in-process), the count already in status stands.
        self.device_counts = device_counts
        self.claims = claims  # the allocated devices, for status.deviceClasses[]; from one claim watch
        self._locks: dict[str, asyncio.Lock] = {}
        self._queued: set[str] = set()
        self._status_queued: set[str] = set()
        self._child_events: dict[tuple[str, str, str | None, str], tuple[str | None, Obj]] = {}
        self._child_tasks: set[asyncio.Task[None]] = set()
        self._reconciled: dict[str, _Reconciled] = {}
        self._device_plugin_cache: dict[str, tuple[float, list[str]]] = {}  # driver -> (time, nodes)
        self._dropped: dict[str, tuple[float, str]] = {}  # class -> (when, extendedResourceName dropped)
        self.features = FeatureProbe(kube)

    def lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    def _bounded(self) -> asyncio.Timeout:
        """The deadline of work done under a config's lock (:data:`LOCK_HELD_AT_MOST`)."""
        return asyncio.timeout(LOCK_HELD_AT_MOST * self.kube.deadlines.request)

    async def reconcile_by_name(self, name: str) -> Outcome | None:
        """Reconcile after a child event. A burst of events (ten classes applied at once) needs one
        reconcile after the running one, not ten: a trigger that finds one already queued is dropped."""
        if name in self._queued:
            return None
        self._queued.add(name)
        async with _queued_until_locked(self._queued, name, self.lock(name)), self._bounded():
            return await self._reconcile_current(name)

    async def on_child_event(self, name: str, event_type: str | None, child: Obj) -> None:
        """An event on a child of config ``name`` (see :func:`child_event_action`), judged after
        a reconcile running now has finished: the echo of its own writes is then as it wanted.
        An event that comes while an older one of the same child waits replaces it: the child is
        judged as it is now, so the newest event is the only one that matters."""
        key = (name, *child_key(child))
        waiting = key in self._child_events
        self._child_events[key] = (event_type, child)
        if waiting:
            return
        async with self.lock(name):
            event_type, child = self._child_events.pop(key)
            last = self._reconciled.get(name)
            action = child_event_action(event_type, child, last.wanted(child) if last else None,
                                        reconciled=last is not None)
        if action == "reconcile":
            await self.reconcile_by_name(name)
        elif action == "status":
            await self._refresh_status(name)

    def on_child_event_soon(self, name: str, event_type: str | None, child: Obj) -> None:
        """:meth:`on_child_event` in a task of its own, so kopf's handler returns at once. kopf
        queues every event of an object and hands them to its handler one at a time; during a
        rollout the DaemonSet's status events come faster than status refreshes, and queued there,
        each keeps a whole DaemonSet in memory (thousands on a large fleet). Here only the newest
        waits."""
        task = asyncio.create_task(self._on_child_event_logged(name, event_type, child))
        self._child_tasks.add(task)
        task.add_done_callback(self._child_tasks.discard)

    async def close(self) -> None:
        """Cancel the child events still being judged (:meth:`on_child_event_soon`): the operator
        is stopping, its client is about to close, and kopf would wait for these tasks (up to 5 s)
        before the Lease is released. The next active replica reconciles every config anyway."""
        tasks = list(self._child_tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _on_child_event_logged(self, name: str, event_type: str | None, child: Obj) -> None:
        try:
            await self.on_child_event(name, event_type, child)
        except ApiException as error:
            log.warning("reconcile of GpuDraConfig %s after a child event failed: %s", name, error_message(error))
        except NETWORK_ERRORS as error:  # the drift check retries
            log.warning("reconcile of GpuDraConfig %s after a child event failed: %r", name, error)

    async def refresh_driver(self, driver: str) -> None:
        """Status again for the configs of ``driver`` (its device count has just become known)."""
        for name in [n for n, last in self._reconciled.items() if last.driver == driver]:
            await self._refresh_status(name)

    async def _refresh_status(self, name: str) -> None:
        """Status again from the DaemonSet as it is now (read here, so a queued event never takes
        status back to an older one); coalesced like child reconciles. A config that changed
        since its last reconcile, or whose last reconcile failed, is reconciled instead."""
        if name in self._status_queued:
            return
        self._status_queued.add(name)
        async with _queued_until_locked(self._status_queued, name, self.lock(name)), self._bounded():
            body = await self.kube.get(CONFIG, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                return
            last = self._reconciled.get(name)
            meta = body["metadata"]
            if last is None or (last.uid, last.generation) != (meta.get("uid"), meta.get("generation")):
                await self._reconcile_current(name)
                return
            wanted = last.rendered.daemonset
            daemonset = None if wanted is None else await self.kube.get(
                DAEMONSET, wanted["metadata"]["name"], wanted["metadata"]["namespace"])
            await self._report(body, GpuDraConfig.from_body(body), last.rendered, last.outcome, daemonset)

    async def reconcile(self, body: Mapping[str, Any]) -> Outcome | None:
        name = body["metadata"]["name"]
        async with self.lock(name), self._bounded():
            return await self._reconcile_current(name)

    async def _reconcile_current(self, name: str) -> Outcome | None:
        """Under the lock, re-read the config: a queued trigger acts on the newest spec, and one
        that waited while the finalizer ran must not bring the removed children back. One LIST
        reads it with every other config (for conflicts)."""
        configs = [o async for o in self.kube.list(CONFIG)]
        body = next((o for o in configs if o["metadata"]["name"] == name), None)
        if body is None or body["metadata"].get("deletionTimestamp"):
            self._reconciled.pop(name, None)
            return None
        return await self._reconcile(body, configs)

    @metrics.reconciles
    async def _reconcile(self, body: Mapping[str, Any], configs: Sequence[Mapping[str, Any]]) -> Outcome:
        config = GpuDraConfig.from_body(body)
        self._reconciled.pop(config.name, None)  # until this one has succeeded: refreshes reconcile
        outcome = Outcome()
        outcome.conflicts = find_conflicts(config, body, configs)
        consumable = True  # unless this API server would drop what the agents publish for it
        if config.spec.sharing.consumable_capacity is not None and not outcome.conflicts:
            support = await self.features.consumable_capacity()
            consumable = support.supported
            if not consumable:
                outcome.unsupported.append(Unsupported(CONSUMABLE_CAPACITY_UNSUPPORTED, support.message))
        # In a thread: inline templates render in a bounded worker process (deviceclasses/worker.py),
        # and the loop keeps serving other configs and the liveness probe meanwhile.
        rendered = await asyncio.to_thread(render, body, agent_image=self.agent_image,
                                           consumable_capacity=consumable)
        outcome.render_errors = list(rendered.errors)
        daemonset = None
        if not outcome.conflicts:
            # Independent children, written at once: the classes (validated, then applied), the
            # DaemonSet, and the pruning of classes that left the spec.
            _, daemonset, _, _ = await _all(self._apply_classes(config, rendered, outcome),
                                            self._apply_daemonset(rendered, outcome),
                                            self._prune_classes(config, outcome),
                                            self._apply_mps_daemonset(config, rendered, outcome))
        await self._report(body, config, rendered, outcome, daemonset)
        if not outcome.conflicts:
            self._reconciled[config.name] = _Reconciled(body["metadata"].get("uid"), config.generation, rendered,
                                                        outcome, config.spec.driver_name)
        return outcome

    # --- children ---------------------------------------------------------------------------
    async def _changed(self, desired: Obj, outcome: Outcome) -> tuple[bool, Obj | None]:
        """(whether ``desired`` must be written, the live object); records unchanged and foreign
        objects. A class whose extendedResourceName this API server drops is compared without it
        (applying it again would change nothing) and reported again; once an hour it is applied
        anyway, in case the gate was turned on since."""
        seen = self._dropped.get(desired["metadata"]["name"]) if desired["kind"] == "DeviceClass" else None
        if seen is not None and (desired["spec"].get("extendedResourceName") != seen[1]
                                 or time.monotonic() - seen[0] >= DROPPED_FIELD_RECHECK):
            del self._dropped[desired["metadata"]["name"]]
            seen = None
        compared = desired
        if seen is not None:
            outcome.apply_errors.append(_dropped_error(desired["metadata"]["name"], seen[1]))
            compared = _without_extended_resource(desired)  # what the server keeps of it
        rtype = resource_type(desired["apiVersion"], desired["kind"])
        meta = desired["metadata"]
        live = await self.kube.get(rtype, meta["name"], meta.get("namespace"))
        if live is not None and not _owned_by(live, meta["labels"][LABEL_CONFIG]):
            outcome.apply_errors.append(ApplyError(desired["kind"], meta["name"],
                                                   "exists and is not managed by this GpuDraConfig; left untouched"))
            return False, live
        # (ownership is checked against what we send: the server records the dropped field as ours)
        if live is not None and contains(live, compared) and not dropped_fields(live, desired, self.kube.field_manager):
            # Nothing to set and nothing of ours to remove: the apply would be a no-op, skip it.
            outcome.unchanged.append(f"{desired['kind']} {meta['name']}")
            return False, live
        return True, live

    async def _apply(self, desired: Obj, outcome: Outcome, *, dry_run: bool = False) -> Obj | None:
        """The object as the API server stored it (or would, in a dry run); None when it refused."""
        meta = desired["metadata"]
        try:
            stored = await self.kube.apply(desired, dry_run=dry_run)
        except ApiException as error:
            if not is_status(error, 400, 403, 409, 422):
                raise
            outcome.apply_errors.append(ApplyError(desired["kind"], meta["name"], error_message(error)))
            return None
        if not dry_run:
            outcome.applied.append(f"{desired['kind']} {meta['name']}")
            log.info("applied %s %s", desired["kind"], meta["name"])
        return stored

    async def _apply_classes(self, config: GpuDraConfig, rendered: Rendered, outcome: Outcome) -> None:
        """Changed classes are validated together by a server-side dry run (the API server is the
        only exact judge of DRA CEL: syntax, types, cost), then the valid ones applied together."""
        classes = rendered.device_classes
        changed = [c for c, (needed, _) in zip(classes, await _gather(self._changed(c, outcome) for c in classes))
                   if needed]
        valid = [c for c, stored in zip(changed, await _gather(self._apply(c, outcome, dry_run=True) for c in changed))
                 if stored is not None]
        for desired, stored in zip(valid, await _gather(self._apply(c, outcome) for c in valid)):
            dropped = _dropped_extended_resource(desired, stored)
            if dropped is not None:
                self._dropped[desired["metadata"]["name"]] = (time.monotonic(), dropped)
                outcome.apply_errors.append(_dropped_error(desired["metadata"]["name"], dropped))

    async def _apply_daemonset(self, rendered: Rendered, outcome: Outcome) -> Obj | None:
        """The DaemonSet written if it changed; the live one (None: there is none), for status."""
        if rendered.daemonset is None:
            return None
        needed, live = await self._changed(rendered.daemonset, outcome)
        if needed:
            return await self._apply(rendered.daemonset, outcome) or live
        return live

    async def _apply_mps_daemonset(self, config: GpuDraConfig, rendered: Rendered, outcome: Outcome) -> None:
        """The MPS supervisor's DaemonSet written if it changed, or deleted when spec.sharing.mps
        left the spec (only the one this config made)."""
        wanted = rendered.mps_daemonset
        if wanted is not None:
            needed, _ = await self._changed(wanted, outcome)
            if needed:
                await self._apply(wanted, outcome)
            return
        last = self._reconciled.get(config.name)
        if last is not None and last.rendered.mps_daemonset is None:
            return  # none since this process's last reconcile of it: nothing to read, or delete
        live = await self.kube.get(DAEMONSET, MPS_NAME, config.spec.agent.namespace)
        if live is not None and (live["metadata"].get("labels") or {}).get(LABEL_CONFIG) == config.name:
            if await self.kube.delete(DAEMONSET, MPS_NAME, config.spec.agent.namespace, uid=live["metadata"]["uid"]):
                outcome.pruned.append(f"DaemonSet/{MPS_NAME}")
                log.info("deleted DaemonSet %s (spec.sharing.mps left GpuDraConfig %s)", MPS_NAME, config.name)

    async def _prune_classes(self, config: GpuDraConfig, outcome: Outcome) -> None:
        """Delete classes this config created that left its spec. A class whose template broke
        is still in the spec, so its last good version stays."""
        wanted = {c.name for c in config.spec.device_classes}
        async for live in self.kube.list(DEVICE_CLASS, label_selector=child_selector(config.name)):
            meta = live["metadata"]
            if meta["name"] in wanted:
                continue
            if await self.kube.delete(DEVICE_CLASS, meta["name"], uid=meta["uid"]):
                outcome.pruned.append(meta["name"])
                log.info("pruned DeviceClass %s (no longer in GpuDraConfig %s)", meta["name"], config.name)

    # --- status -----------------------------------------------------------------------------
    async def _device_plugin_nodes(self, driver: str) -> list[str]:
        """Nodes whose agent says (its latest DevicePluginConflict[Resolved] Node event) that it
        publishes nothing because NVIDIA's device plugin advertises nvidia.com/gpu there. One
        filtered LIST of the driver's agent events (few: they are posted on changes only), reused
        for REUSE_TTL seconds; Events expire after an hour, and an agent
        that still conflicts posts again when it restarts."""
        return await _reused(self._device_plugin_cache, driver, lambda: self._list_device_plugin_nodes(driver))

    async def _list_device_plugin_nodes(self, driver: str) -> list[str]:
        latest: dict[str, tuple[str, str]] = {}
        async for event in self.kube.list(EVENT, EVENT_NAMESPACE, field_selector=f"source={event_source(driver)}"):
            if event.get("reason") not in (DEVICE_PLUGIN_CONFLICT, DEVICE_PLUGIN_RESOLVED):
                continue
            node = (event.get("involvedObject") or {}).get("name") or ""
            when = event.get("lastTimestamp") or event.get("eventTime") or event["metadata"].get("creationTimestamp") or ""
            if node and (node not in latest or when >= latest[node][0]):
                latest[node] = (when, event["reason"])
        return sorted(n for n, (_, reason) in latest.items() if reason == DEVICE_PLUGIN_CONFLICT)

    async def _class_counts(self, config: GpuDraConfig, rendered: Rendered,
                            applied: list[str]) -> list[ClassCount] | None:
        """Each applied class's counts, from the slice and claim watches; None until both have
        listed once, and while a change of the classes is being matched. A first use waits for the
        first list a moment (one status write with the counts rather than two); past that, status
        keeps the counts it holds until they are in (a spec change converges without waiting)."""
        if self.device_counts is None or self.claims is None:
            return None
        driver = config.spec.driver_name
        minor = await self.features.server_minor()  # whose DRA CEL matches them: the cluster's release
        classes = tuple(class_selectors(c, minor) for c in rendered.device_classes if c["metadata"]["name"] in applied)
        allocated = self.claims.devices()  # built from every allocated claim: once per read
        first = not self.device_counts.listed_once(driver) or allocated is None
        counts = self.device_counts.class_counts(driver, classes, allocated or set())
        if first:  # not when classes changed: their counts follow with the status refresh that ends it
            await asyncio.gather(self.device_counts.wait_listed(driver, FIRST_LIST_WAIT),
                                 self.claims.wait_listed(FIRST_LIST_WAIT))
            allocated = self.claims.devices()
            counts = self.device_counts.class_counts(driver, classes, allocated or set())
        return None if allocated is None else counts

    def _unhealthy(self, driver: str, old_status: Mapping[str, Any]) -> int:
        """Devices published with a taint that keeps pods off them (device health), as _devices."""
        count = self.device_counts.unhealthy(driver) if self.device_counts is not None else None
        return int(old_status.get("unhealthyDevices") or 0) if count is None else count

    def _devices(self, driver: str, old_status: Mapping[str, Any]) -> int:
        """Devices the driver publishes, from the watch of its slices; until that has listed them
        once (a replica that just became active), the count status already holds."""
        count = self.device_counts.devices(driver) if self.device_counts is not None else None
        return int(old_status.get("devices") or 0) if count is None else count

    async def _report(self, body: Mapping[str, Any], config: GpuDraConfig, rendered: Rendered,
                      outcome: Outcome, daemonset: Obj | None) -> None:
        """Status from this reconcile's outcome and ``daemonset``, as read or written just now."""
        applied_classes = [c["metadata"]["name"] for c in rendered.device_classes
                           if not any(e.kind == "DeviceClass" and e.name == c["metadata"]["name"]
                                      for e in outcome.apply_errors)]
        values = summarize(daemonset=daemonset, device_classes=applied_classes, render_errors=rendered.errors,
                           # in a stable order: the children are written concurrently
                           apply_errors=sorted(outcome.apply_errors, key=lambda e: (e.kind, e.name)),
                           conflicts=outcome.conflicts, unsupported=outcome.unsupported,
                           device_plugin_nodes=[] if outcome.conflicts or config.spec.agent.allow_device_plugin
                           else await self._device_plugin_nodes(config.spec.driver_name))
        old_status = body.get("status") or {}
        agents = agents_status(daemonset)
        counts = None if outcome.conflicts else await self._class_counts(config, rendered, applied_classes)
        devices = 0 if outcome.conflicts else self._devices(config.spec.driver_name, old_status)
        if counts is not None:
            values.append(class_matches_no_device(counts, config.spec.driver_name, devices,
                                                  agents_ready=agents["desired"] > 0 and agents["ready"] == agents["desired"]))
        conditions = apply_conditions(old_status.get("conditions"), values, config.generation,
                                      datetime.now(timezone.utc))
        status = {
            "observedGeneration": config.generation,
            "conditions": conditions,
            "agents": agents,
            "deviceClasses": _class_status(applied_classes, counts, old_status),
            "deviceClassCount": len(applied_classes),
            "devices": devices,
            "unhealthyDevices": 0 if outcome.conflicts else self._unhealthy(config.spec.driver_name, old_status),
        }
        metrics.observe_agents(config.name, agents)
        if contains(old_status, status):
            return
        await self.kube.patch(CONFIG, config.name, {"status": status}, subresource="status")
        await self.events.on_transition(body, old_status.get("conditions") or [], conditions)
