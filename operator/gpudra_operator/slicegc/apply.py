"""The ResourceSlice GC of one GpuDraConfig: load, decide (:func:`stale_slices`), delete, report.

One pass lists the driver's slices (field selector ``spec.driver``, paginated), then the Nodes
(metadata only, paginated), then the agent's pods (label selector, in the agent namespace) — in that
order, so a slice published after the Node list began cannot be judged against an older Node list.
Deletes carry preconditions {uid, resourceVersion}: a slice changed since the list is a 409 and
stays. Deletes are rate limited (:mod:`aiolimiter`) and bounded in concurrency. The outcome lands in
``status.gc`` (merge patch on the status subresource, only the ``gc`` key), an Event when
something was deleted or failed, and one log line per condemned slice. docs/gc.md has the rules."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from aiolimiter import AsyncLimiter
from kubernetes_asyncio.client.exceptions import ApiException

from gpudra_core.kubeapi import API_ERRORS, NETWORK_ERRORS, Kube, error_message, is_status, resource_type, rfc3339

from gpudra_operator.events import EventRecorder
from gpudra_operator.render import agent_selector
from gpudra_operator.spec import GpuDraConfig, parse_duration
from gpudra_operator.slicegc.plan import AgentPlacement, NodeInfo, SliceInfo, Verdict, stale_slices

CONFIG = resource_type("gpudra.io/v1alpha1", "GpuDraConfig")
SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
NODE = resource_type("v1", "Node")
POD = resource_type("v1", "Pod")
DEFAULT_DELETE_RATE = 50.0  # deletes per second; <= 0 disables the limit
DEFAULT_DELETE_BURST = 10
DEFAULT_DELETE_CONCURRENCY = 8
log = logging.getLogger("gpudra.operator.gc")


def delete_limiter(rate: float, burst: int = DEFAULT_DELETE_BURST) -> AbstractAsyncContextManager[Any]:
    """``async with`` it before each delete: ``rate`` per second once a burst of ``burst`` is spent
    (a leaky bucket of ``burst`` that drains at ``rate``); ``rate <= 0`` never waits."""
    if rate <= 0:
        return nullcontext()
    burst = max(1, burst)
    return AsyncLimiter(burst, burst / rate)


@dataclass
class GcResult:
    """What one pass did; status.gc, Events, logs, tests and metrics read it."""

    config: str
    driver: str
    dry_run: bool
    started: datetime
    seconds: float = 0.0
    slices: int = 0
    nodes: int = 0
    agent_pods: int = 0
    condemned: list[Verdict] = field(default_factory=list)
    pending: list[Verdict] = field(default_factory=list)
    deleted: list[Verdict] = field(default_factory=list)
    skipped: list[Verdict] = field(default_factory=list)  # changed or gone before the delete (409/404)
    errors: list[str] = field(default_factory=list)

    @property
    def found(self) -> int:
        return len(self.condemned)

    def status(self) -> dict[str, Any]:
        return {"lastRun": rfc3339(self.started), "found": self.found,
                "deleted": len(self.deleted), "errors": len(self.errors), "pending": len(self.pending),
                "skipped": len(self.skipped), "dryRun": self.dry_run}

    def by_rule(self, verdicts: list[Verdict]) -> str:
        counts: dict[str, int] = {}
        for v in verdicts:
            counts[v.rule] = counts.get(v.rule, 0) + 1
        return ", ".join(f"{rule} {n}" for rule, n in sorted(counts.items()))


def seconds_since(last_run: str | None, now: float, interval: float) -> float:
    """How long ago the pass that ``status.gc.lastRun`` records ran, by the wall clock ``now``,
    within [0, interval]: none recorded (or unreadable) is a pass long ago (run now); one in the
    future (a clock that was ahead, or a hand edit) counts as just now, so it delays the next
    pass by one interval at most instead of until that time comes."""
    if not last_run:
        return interval
    try:
        when = datetime.fromisoformat(last_run.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return interval
    return min(max(now - when, 0.0), interval)


def gc_ready(body: Mapping[str, Any]) -> str | None:
    """Why a pass must not run for this config now (None: it may). The GC acts only for a config
    the reconciler has seen at its current generation without a conflict: a newer config that
    names a driver another one manages touches nothing, its GC included."""
    meta, status = body.get("metadata") or {}, body.get("status") or {}
    if meta.get("deletionTimestamp"):
        return "being deleted (its teardown removes the driver's slices)"
    if status.get("observedGeneration") != meta.get("generation"):
        return "not reconciled at its current generation yet"
    degraded: Mapping[str, Any] = next((c for c in status.get("conditions") or [] if c.get("type") == "Degraded"), {})
    if degraded.get("reason") == "Conflict":
        return "in conflict with another GpuDraConfig"
    return None


class SliceCollector:
    """Runs GC passes; keeps the grace-period memory (slice UID → rule, first seen) per config in
    operator memory. An operator restart restarts every grace clock: the safe direction."""

    def __init__(self, kube: Kube, events: EventRecorder, *, delete_rate: float = DEFAULT_DELETE_RATE,
                 delete_burst: int = DEFAULT_DELETE_BURST, concurrency: int = DEFAULT_DELETE_CONCURRENCY,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 page_size: int = 500) -> None:
        self.kube, self.events = kube, events
        self.limiter = delete_limiter(delete_rate, delete_burst)  # one for all configs
        self.concurrency = max(1, concurrency)
        self.clock = clock  # monotonic: grace periods and the schedule (tests pass fake ones)
        self.wall_clock = wall_clock  # only to read the age of status.gc.lastRun once
        self.page_size = page_size
        self._first_seen: dict[str, dict[str, tuple[str, float]]] = {}
        self._last_pass: dict[str, float] = {}  # config name -> the last pass, on ``clock``
        self._skipped: dict[str, str | None] = {}  # config name -> why the last look ran no pass

    def forget(self, name: str) -> None:
        for memory in (self._first_seen, self._last_pass, self._skipped):
            memory.pop(name, None)

    def seconds_until_due(self, body: Mapping[str, Any]) -> float:
        """Seconds until the next pass of this config is due (<= 0: now), counted on the monotonic
        clock from this process's last pass. Before its first, from ``status.gc.lastRun`` (so a
        restart does not rerun at once), read once and turned into a pass that many seconds ago."""
        config = GpuDraConfig.from_body(body)
        interval = config.spec.resource_slice_gc.interval
        if config.name not in self._last_pass:
            last_run = ((body.get("status") or {}).get("gc") or {}).get("lastRun")
            age = seconds_since(last_run, self.wall_clock(), interval)
            self._last_pass[config.name] = self.clock() - age
        return self._last_pass[config.name] + interval - self.clock()

    async def run_pass(self, body: Mapping[str, Any]) -> GcResult | None:
        """One pass for the config ``body``; None when the GC is disabled or must not run now."""
        config = GpuDraConfig.from_body(body)
        gc = config.spec.resource_slice_gc
        if not gc.enabled:
            self.forget(config.name)
            return None
        why_not = gc_ready(body)
        if why_not != self._skipped.get(config.name):  # log a reason once, not every tick
            self._skipped[config.name] = why_not
            if why_not:
                log.info("GpuDraConfig %s: ResourceSlice GC waits: %s", config.name, why_not)
        if why_not:
            return None
        self._last_pass[config.name] = self.clock()
        driver = config.spec.driver_name
        result = GcResult(config.name, driver, gc.dry_run, datetime.now(timezone.utc))
        started = time.perf_counter()
        try:
            await self._decide(config, result)
            if not gc.dry_run:
                await self._delete_all(result)
        except API_ERRORS as error:
            # A list failed: decide nothing, report, try again next interval.
            message = error_message(error) if isinstance(error, ApiException) else repr(error)
            result.condemned, result.pending = [], []
            result.errors.append(f"listing failed: {message}")
        result.seconds = time.perf_counter() - started
        self._log(result)
        await self._report(body, result)
        return result

    async def _decide(self, config: GpuDraConfig, result: GcResult) -> None:
        slices = [SliceInfo.from_object(s) async for s in
                  self.kube.list(SLICE, field_selector=f"spec.driver={result.driver}", page_size=self.page_size)]
        nodes: dict[str, NodeInfo] = {}
        async for obj in self.kube.list(NODE, metadata_only=True, page_size=self.page_size):
            node = NodeInfo.from_object(obj)
            nodes[node.name] = node
        selector = agent_selector(config.name)
        agent_nodes: set[str] = set()
        async for pod in self.kube.list(POD, config.spec.agent.namespace, label_selector=selector,
                                        page_size=self.page_size):
            result.agent_pods += 1
            node_name = (pod.get("spec") or {}).get("nodeName")
            if node_name and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                agent_nodes.add(node_name)
        result.slices, result.nodes = len(slices), len(nodes)
        placement = AgentPlacement(config.spec.agent.node_selector, config.spec.agent.affinity)
        decision = stale_slices(result.driver, slices, nodes, agent_nodes, placement, now=self.clock(),
                                grace_period=config.spec.resource_slice_gc.grace_period,
                                first_seen=self._first_seen.get(config.name))
        self._first_seen[config.name] = decision.first_seen
        result.condemned, result.pending = decision.condemned, decision.pending

    async def _delete_all(self, result: GcResult) -> None:
        semaphore = asyncio.Semaphore(self.concurrency)

        async def delete(verdict: Verdict) -> None:
            async with semaphore, self.limiter:
                s = verdict.slice
                try:
                    gone = await self.kube.delete(SLICE, s.name, uid=s.uid, resource_version=s.resource_version)
                except ApiException as error:
                    if is_status(error, 409):  # changed since the list: decided again next pass
                        result.skipped.append(verdict)
                    else:
                        result.errors.append(f"ResourceSlice {s.name}: {error_message(error)}")
                    return
                except NETWORK_ERRORS as error:
                    result.errors.append(f"ResourceSlice {s.name}: {error!r}")
                    return
                (result.deleted if gone else result.skipped).append(verdict)

        await asyncio.gather(*(delete(v) for v in result.condemned))

    def _log(self, result: GcResult) -> None:
        deleted = {v.slice.uid for v in result.deleted}
        skipped = {v.slice.uid for v in result.skipped}
        for v in result.condemned:
            s = v.slice
            outcome = ("would delete (dry run)" if result.dry_run else "deleted" if s.uid in deleted
                       else "kept: changed or gone since listed" if s.uid in skipped else "delete failed")
            log.info("GpuDraConfig %s: ResourceSlice %s (node %s, pool %s, generation %d) is stale by rule %s: "
                     "%s; %s", result.config, s.name, s.node_name, s.pool, s.generation, v.rule, v.reason, outcome)
        for error in result.errors:
            log.warning("GpuDraConfig %s: ResourceSlice GC: %s", result.config, error)
        log.info("GpuDraConfig %s: ResourceSlice GC pass over %d slice(s), %d node(s), %d agent pod(s) in %.3fs: "
                 "found %d, deleted %d, skipped %d, errors %d, pending %d%s", result.config, result.slices,
                 result.nodes, result.agent_pods, result.seconds, result.found, len(result.deleted),
                 len(result.skipped), len(result.errors), len(result.pending), " (dry run)" if result.dry_run else "")

    async def _report(self, body: Mapping[str, Any], result: GcResult) -> None:
        name = result.config
        try:
            await self.kube.patch(CONFIG, name, {"status": {"gc": result.status()}}, subresource="status")
        except ApiException as error:
            if not is_status(error, 404):
                log.warning("GpuDraConfig %s: could not write status.gc: %s", name, error_message(error))
        if result.deleted:
            names = ", ".join(v.slice.name for v in result.deleted[:10])
            more = f" and {len(result.deleted) - 10} more" if len(result.deleted) > 10 else ""
            await self.events.post(body, "Normal", "StaleSlicesDeleted",
                                   f"deleted {len(result.deleted)} stale ResourceSlice(s) of driver {result.driver} "
                                   f"({result.by_rule(result.deleted)}): {names}{more}")
        if result.errors:
            await self.events.post(body, "Warning", "SliceGCFailed",
                                   f"{len(result.errors)} error(s) in the ResourceSlice GC: {result.errors[0]}")


def gc_tick(default: float = 2.0) -> float:
    """How often the per-config GC loop checks whether a pass is due ($GPUDRA_GC_TICK, a duration or
    seconds); no API request is made on a tick that is not due."""
    value = os.environ.get("GPUDRA_GC_TICK")
    if not value:
        return default
    try:
        return float(value)
    except ValueError:
        return parse_duration(value)
