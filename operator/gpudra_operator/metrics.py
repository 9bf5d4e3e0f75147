"""The operator's Prometheus metrics (docs/metrics.md lists them with their meaning).

Names follow controller-runtime's, which dashboards and alerts already pattern-match on
(``*_reconcile_total{result}``, ``*_reconcile_errors_total``, ``*_reconcile_time_seconds``), under
the single ``gpudra_`` prefix. Everything lives in prometheus-client's default registry, so the
process and platform collectors come along. ``serve(port)`` starts the HTTP endpoint; without it
the metrics are still counted (unit tests, ``gpudra render``) and simply not exposed.

Callers:

* :mod:`gpudra_operator.reconcile` decorates its one reconcile method with :func:`reconciles` (or
  wraps a block in :func:`track_reconcile`) and reports the agents it saw through
  :func:`observe_agents`;
* the ResourceSlice GC calls :func:`record_gc_pass` once per pass (``found`` stale slices, of which
  ``deleted`` were deleted by this pass);
* the delete handler calls :func:`forget_config` so a deleted GpuDraConfig leaves no stale gauges;
* the leader election calls :func:`set_leader` as this replica becomes active or stops being so.
"""

from __future__ import annotations

import logging
import time
import functools
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, Info

from gpudra_core import metrics_http

log = logging.getLogger("gpudra.operator")

# Outcomes of one reconcile: everything applied; done but something reported in Degraded
# (a template that failed to render, an apply the API server refused, a conflict with an older
# GpuDraConfig); or it raised (API trouble; kopf retries).
SUCCESS, DEGRADED, ERROR = "success", "degraded", "error"
RESULTS = (SUCCESS, DEGRADED, ERROR)

RECONCILE_TOTAL = Counter("gpudra_reconcile_total", "Reconciles of GpuDraConfigs, by result.", ["result"])
RECONCILE_ERRORS = Counter("gpudra_reconcile_errors_total",
                           "Reconciles that raised an error (kopf retries them).")
RECONCILE_TIME = Histogram(
    "gpudra_reconcile_time_seconds", "Duration of one reconcile of a GpuDraConfig.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
LAST_SUCCESS = Gauge("gpudra_last_successful_reconcile_timestamp_seconds",
                     "Unix time of the last reconcile that ended in success, per GpuDraConfig.", ["config"])
AGENTS_DESIRED = Gauge("gpudra_agents_desired",
                       "Node agent pods the DaemonSet should run (desiredNumberScheduled).", ["config"])
AGENTS_READY = Gauge("gpudra_agents_ready", "Node agent pods that are ready (numberReady).", ["config"])
STALE_FOUND = Counter("gpudra_resourceslices_stale_found_total",
                      "Stale ResourceSlices the GC found (counted once per GC pass that saw them).")
STALE_DELETED = Counter("gpudra_resourceslices_stale_deleted_total", "Stale ResourceSlices the GC deleted.")
BUILD_INFO = Info("gpudra_build", "The gpudra version of this operator.")
# client-go's leader election gauge, under our prefix: 1 on the replica that holds the Lease.
LEADER = Gauge("gpudra_leader_election_master_status",
               "1 while this replica holds the operator Lease (is the active operator), else 0.", ["name"])

for _result in RESULTS:  # every series exists from the start: rate() and absent() alerts work at once
    RECONCILE_TOTAL.labels(result=_result)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gpudra")
    except PackageNotFoundError:
        return "unknown"


BUILD_INFO.info({"version": _version(), "component": "operator"})


@dataclass
class Tracked:
    """Set ``outcome`` (a :class:`gpudra_operator.reconcile.Outcome`) before the block ends."""

    outcome: Any = None


def result_of(outcome: Any) -> str:
    if outcome is None:
        return ERROR
    if outcome.conflicts or outcome.apply_errors or getattr(outcome, "render_errors", None):
        return DEGRADED
    return SUCCESS


@contextmanager
def track_reconcile(config_name: str) -> Iterator[Tracked]:
    """Count and time one reconcile. An exception counts as ``error``; a cancellation (operator
    shutdown) is not a reconcile result and is not counted."""
    tracked = Tracked()
    started = time.perf_counter()
    try:
        yield tracked
    except BaseException as error:
        if not _is_cancellation(error):
            RECONCILE_TIME.observe(time.perf_counter() - started)
            RECONCILE_TOTAL.labels(result=ERROR).inc()
            RECONCILE_ERRORS.inc()
        raise
    RECONCILE_TIME.observe(time.perf_counter() - started)
    result = result_of(tracked.outcome)
    RECONCILE_TOTAL.labels(result=result).inc()
    if result == SUCCESS:
        LAST_SUCCESS.labels(config=config_name).set(time.time())


def reconciles(method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Decorate ``async def _reconcile(self, body, ...) -> Outcome``: each call is tracked as one
    reconcile of ``body``'s GpuDraConfig."""

    @functools.wraps(method)
    async def wrapper(self: Any, body: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        with track_reconcile(body["metadata"]["name"]) as tracked:
            tracked.outcome = await method(self, body, *args, **kwargs)
            return tracked.outcome

    return wrapper


def _is_cancellation(error: BaseException) -> bool:
    import asyncio

    return isinstance(error, (asyncio.CancelledError, GeneratorExit, KeyboardInterrupt))


def observe_agents(config_name: str, agents: dict[str, Any]) -> None:
    """``agents`` is ``status.agents`` (:func:`gpudra_operator.conditions.agents_status`)."""
    AGENTS_DESIRED.labels(config=config_name).set(agents.get("desired", 0))
    AGENTS_READY.labels(config=config_name).set(agents.get("ready", 0))


def record_gc_pass(found: int, deleted: int) -> None:
    """One ResourceSlice GC pass saw ``found`` stale slices and deleted ``deleted`` of them."""
    if found:
        STALE_FOUND.inc(found)
    if deleted:
        STALE_DELETED.inc(deleted)


def set_leader(lease: str, leading: bool) -> None:
    LEADER.labels(name=lease).set(1 if leading else 0)


def forget_config(config_name: str) -> None:
    """Drop the per-config series of a deleted GpuDraConfig."""
    for gauge in (LAST_SUCCESS, AGENTS_DESIRED, AGENTS_READY):
        try:
            gauge.remove(config_name)
        except KeyError:
            pass


def serve(port: int, addr: str | None = None) -> None:
    """Serve ``/metrics`` on ``port`` in a background thread (0: do nothing); see
    :func:`gpudra_core.metrics_http.serve`."""
    metrics_http.serve(port, addr, log)
