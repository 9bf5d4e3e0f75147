"""One idempotent reconcile of a GpuDraConfig: load, decide, apply, report.

Decisions are pure (``render``, ``summarize``, ``find_conflicts``); this module only reads the
live objects, writes the difference with server-side apply, prunes by label and writes status.
Nothing is written when nothing changed, so a drift tick on a converged config costs reads only."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from gpudra_core.diff import contains, dropped_fields
from gpudra_core.kubeapi import Kube, Obj, error_message, is_status, resource_type

from gpudra_operator.conditions import (ApplyError, Unsupported, agents_status, apply_conditions, class_matches_no_device,
                         summarize)
from gpudra_operator.classcounts import ClaimWatch, class_status
from gpudra_operator.configlocks import ConfigLocks
from gpudra_operator.devicecount import DeviceCounts, StatusCounts
from gpudra_operator.droppedfields import DroppedFields
from . import metrics
from gpudra_operator.events import EventRecorder
from gpudra_operator.features import CONSUMABLE_CAPACITY_UNSUPPORTED, FeatureProbe
from gpudra_operator.agentreports import AgentEvents
from gpudra_operator.render import (DEFAULT_AGENT_IMAGE, LABEL_CONFIG, LABEL_MANAGED_BY, MANAGED_BY, MPS_NAME, Rendered,
                     child_selector, render)
from gpudra_operator.spec import GpuDraConfig, SpecError

CONFIG = resource_type("gpudra.io/v1alpha1", "GpuDraConfig")
DEVICE_CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")
DAEMONSET = resource_type("apps/v1", "DaemonSet")
log = logging.getLogger("gpudra.operator")
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


@dataclass
class Reconciled:
    """What the last full reconcile of a config decided, for status refreshes and child events
    between reconciles."""

    uid: str | None
    generation: int | None
    rendered: Rendered
    outcome: Outcome
    driver: str


def _age_key(body: Mapping[str, Any]) -> tuple[str, int, str]:
    """Older first. creationTimestamp has one-second resolution, so on a tie the incumbent (a
    config already reconciled without a conflict) wins, then the name decides."""
    meta, status = body["metadata"], body.get("status") or {}
    degraded: Mapping[str, Any] = next((c for c in status.get("conditions") or [] if c.get("type") == "Degraded"), {})
    incumbent = "observedGeneration" in status and degraded.get("reason") != "Conflict"
    return (meta.get("creationTimestamp") or "", 0 if incumbent else 1, meta["name"])


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



async def _all(*awaitables: Any) -> list[Any]:
    """Their results, once every one has finished; then the first error, if any (no write is
    left running behind a failed reconcile, which kopf retries)."""
    results = await asyncio.gather(*awaitables, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def _owned_by(live: Obj, config_name: str) -> bool:
    labels = live["metadata"].get("labels") or {}
    return labels.get(LABEL_MANAGED_BY) == MANAGED_BY and labels.get(LABEL_CONFIG) == config_name


class Reconciler:
    """The reconcile of each GpuDraConfig, one at a time per config (:attr:`locks`), remembering
    what the last one decided (:meth:`last`)."""

    def __init__(self, kube: Kube, events: EventRecorder, *, agent_image: str = DEFAULT_AGENT_IMAGE,
                 device_counts: DeviceCounts | None = None, claims: ClaimWatch | None = None,
                 agent_events: AgentEvents | None = None, dropped: DroppedFields | None = None) -> None:
        self.agent_image = agent_image
        self.kube = kube
        self.events = events
        self.features = FeatureProbe(kube)
        # status.devices and status.deviceClasses[] come from the operator's watches of the slices
        # and claims; without them (a reconcile run in-process), the counts already in status stand.
        self.counts = StatusCounts(device_counts, claims, self.features)
        self.agent_events = AgentEvents(kube) if agent_events is None else agent_events
        self.dropped = DroppedFields() if dropped is None else dropped
        self.locks = ConfigLocks(LOCK_HELD_AT_MOST * kube.deadlines.request)
        self._reconciled: dict[str, Reconciled] = {}

    def last(self, name: str) -> Reconciled | None:
        """What the last reconcile of config ``name`` in this process decided; None before the
        first, while one runs, and after one that failed or found a conflict."""
        return self._reconciled.get(name)

    def configs_of(self, driver: str) -> list[str]:
        """The configs of ``driver`` that have a last reconcile."""
        return [n for n, last in self._reconciled.items() if last.driver == driver]

    async def reconcile(self, body: Mapping[str, Any]) -> Outcome | None:
        name = body["metadata"]["name"]
        async with self.locks.held(name):
            return await self.reconcile_current(name)

    async def reconcile_current(self, name: str) -> Outcome | None:
        """Under the config's lock (the caller holds it), re-read the config: a queued trigger acts
        on the newest spec, and one that waited while a teardown ran must not bring the removed
        children back. One LIST reads it with every other config (for conflicts)."""
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
        await self.report(body, config, rendered, outcome, daemonset)
        if not outcome.conflicts:
            self._reconciled[config.name] = Reconciled(body["metadata"].get("uid"), config.generation, rendered,
                                                       outcome, config.spec.driver_name)
        return outcome

    # --- children ---------------------------------------------------------------------------
    async def _changed(self, desired: Obj, outcome: Outcome) -> tuple[bool, Obj | None]:
        """(whether ``desired`` must be written, the live object); records unchanged and foreign
        objects. A class whose extendedResourceName this API server drops is compared without it
        (applying it again would change nothing) and reported again (:mod:`.droppedfields`)."""
        compared, dropped = self.dropped.as_kept(desired)
        if dropped is not None:
            outcome.apply_errors.append(dropped)
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
            dropped = self.dropped.applied(desired, stored)
            if dropped is not None:
                outcome.apply_errors.append(dropped)

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
    async def report(self, body: Mapping[str, Any], config: GpuDraConfig, rendered: Rendered,
                     outcome: Outcome, daemonset: Obj | None) -> None:
        """Status from a reconcile's outcome and ``daemonset``, as read or written just now."""
        applied_classes = [c["metadata"]["name"] for c in rendered.device_classes
                           if not any(e.kind == "DeviceClass" and e.name == c["metadata"]["name"]
                                      for e in outcome.apply_errors)]
        reports = None if outcome.conflicts else await self.agent_events.reports(config.spec.driver_name)
        values = summarize(daemonset=daemonset, device_classes=applied_classes, render_errors=rendered.errors,
                           # in a stable order: the children are written concurrently
                           apply_errors=sorted(outcome.apply_errors, key=lambda e: (e.kind, e.name)),
                           conflicts=outcome.conflicts, unsupported=outcome.unsupported,
                           device_plugin_nodes=[] if reports is None or config.spec.agent.allow_device_plugin
                           else list(reports.device_plugin),
                           node_problems=[] if reports is None else reports.mig_problems())
        old_status = body.get("status") or {}
        agents = agents_status(daemonset)
        driver = config.spec.driver_name
        counts = None if outcome.conflicts else await self.counts.classes(
            driver, [c for c in rendered.device_classes if c["metadata"]["name"] in applied_classes])
        devices = 0 if outcome.conflicts else self.counts.devices(driver, old_status)
        if counts is not None:
            values.append(class_matches_no_device(counts, driver, devices,
                                                  agents_ready=agents["desired"] > 0 and agents["ready"] == agents["desired"]))
        conditions = apply_conditions(old_status.get("conditions"), values, config.generation,
                                      datetime.now(timezone.utc))
        status = {
            "observedGeneration": config.generation,
            "conditions": conditions,
            "agents": agents,
            "deviceClasses": class_status(applied_classes, counts, old_status),
            "deviceClassCount": len(applied_classes),
            "devices": devices,
            "unhealthyDevices": 0 if outcome.conflicts else self.counts.unhealthy(driver, old_status),
            "unmonitoredDevices": 0 if outcome.conflicts else self.counts.unmonitored(driver, old_status),
            "shareableDevices": 0 if outcome.conflicts else self.counts.shareable(driver, old_status),
        }
        metrics.observe_agents(config.name, agents)
        if contains(old_status, status):
            return
        await self.kube.patch(CONFIG, config.name, {"status": status}, subresource="status")
        await self.events.on_transition(body, old_status.get("conditions") or [], conditions)
