"""The node agent's Prometheus metrics (docs/metrics.md lists them with their meaning).

What the kubelet plugin calls (driver/gpudra_driver/plugin/):

* ``with PREPARE.track(): ...`` around the preparation of one claim (and ``UNPREPARE`` likewise):
  counts ``gpudra_agent_node_prepare_total``, times ``..._duration_seconds`` and, when the block
  raises, ``..._errors_total``. A failure reported without raising (an error string in the gRPC
  reply) is recorded with ``with PREPARE.track() as call: ... call.failed()``, or with
  ``PREPARE.record(seconds, ok=False)`` outside a block;
* ``set_prepared_claims(n)`` whenever the checkpoint's set of prepared claims changes.

What device health calls (driver/gpudra_driver/devicehealth/): ``device_health(counts)`` with the number
of devices per health state (healthy, unhealthy, unmonitored) whenever it recomputes them.

What the MPS side calls (driver/gpudra_driver/plugin/sharing/mps/apply.py, every few seconds from
the MPS supervisor's status files): ``mps_daemons(counts)`` with the claims' control daemons per
state (Ready, Starting, Failed) and ``mps_daemons_restarted(n)`` with the restarts it saw since.

What the publisher calls: ``published(devices, slices)`` after every successful sync (a no-op sync
counts: the published state was confirmed current) and ``publish_failed()`` when a sync raised.

Everything is counted whether or not ``serve(port)`` exposes it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, Info
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gpudra_core import metrics_http

log = logging.getLogger("gpudra.agent")

_DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Call:
    """One tracked operation; :meth:`failed` marks it failed without raising. One object per
    call, so concurrent claims (interleaved coroutines) never share a flag."""

    def __init__(self) -> None:
        self.ok = True

    def failed(self) -> None:
        self.ok = False


class ClaimOperation:
    """Totals, errors and a duration histogram for one kubelet plugin operation, per claim."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.total = Counter(f"gpudra_agent_node_{name}_total", f"Claims the kubelet asked the agent to {name}.")
        self.errors = Counter(f"gpudra_agent_node_{name}_errors_total", f"Claims whose {name} failed.")
        self.duration = Histogram(f"gpudra_agent_node_{name}_duration_seconds",
                                  f"Time to {name} one claim.", buckets=_DURATION_BUCKETS)

    def record(self, seconds: float, *, ok: bool) -> None:
        self.total.inc()
        self.duration.observe(seconds)
        if not ok:
            self.errors.inc()

    @contextmanager
    def track(self) -> Iterator[Call]:
        """Time the block; it failed if it raised or called ``.failed()`` on what it was given."""
        started = time.perf_counter()
        call = Call()
        try:
            yield call
        except BaseException:
            self.record(time.perf_counter() - started, ok=False)
            raise
        self.record(time.perf_counter() - started, ok=call.ok)


PREPARE = ClaimOperation("prepare")
UNPREPARE = ClaimOperation("unprepare")
PREPARED_CLAIMS = Gauge("gpudra_agent_prepared_claims", "Claims prepared on this node (in the checkpoint).")
PUBLISHED_DEVICES = Gauge("gpudra_agent_published_devices", "Devices this agent publishes in its ResourceSlices.")
SHAREABLE_DEVICES = Gauge("gpudra_agent_shareable_devices", "Of the published devices, those several claims may "
                          "hold at once (allowMultipleAllocations: consumable capacity).")
PUBLISHED_SLICES = Gauge("gpudra_agent_published_resourceslices", "ResourceSlices this agent publishes.")
LAST_PUBLISH = Gauge("gpudra_agent_last_successful_publish_timestamp_seconds",
                     "Unix time the agent last confirmed its ResourceSlices current (0: never).")
LEAKED_CLAIMS_RELEASED = Counter("gpudra_agent_leaked_claims_released_total",
                                 "Prepared claims released by the checkpoint sweep: deleted, re-created or "
                                 "deallocated while their unprepare never came.")
CLAIM_STATUS_REFUSED = Counter("gpudra_agent_claim_status_refused_total",
                               "Claim status.devices writes the API server refused for good (not retried), by "
                               "reason: allocation-immutable (a claim whose opaque parameters it re-encodes "
                               "differently; once per claim), forbidden, not-found, conflict, invalid.", ["reason"])
PUBLISH_ERRORS = Counter("gpudra_agent_publish_errors_total", "ResourceSlice syncs that failed (and are retried).")
DEVICES_BY_HEALTH = Gauge("gpudra_agent_devices", "Devices this agent discovered, by health state "
                          "(healthy, unhealthy: a NoSchedule/NoExecute taint, unmonitored: no NVML events).",
                          ["health"])
# The daemons run in the MPS supervisor (a DaemonSet of their own, serving no metrics); the agent
# counts them from the status files the supervisor writes beside each claim's daemon spec.
MPS_DAEMONS = Gauge("gpudra_agent_mps_daemons", "MPS control daemons of this node's prepared claims, by state "
                    "(Ready, Starting, Failed) as the MPS supervisor last reported them.", ["state"])
MPS_DAEMON_RESTARTS = Counter("gpudra_agent_mps_daemon_restarts_total",
                              "MPS control daemons the MPS supervisor started again after they exited.")
BUILD_INFO = Info("gpudra_agent_build", "The gpudra version of this agent.")


class ClaimDevices(Collector):
    """``gpudra_agent_claim_device_info``: the series the claim reporter keeps
    (:mod:`gpudra_driver.plugin.claimreporter`), read at each scrape from its snapshot."""

    NAME = "gpudra_agent_claim_device_info"

    def __init__(self) -> None:
        self.labels: Sequence[str] = ()
        self.series: Callable[[], Iterable[Sequence[str]]] = lambda: ()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.NAME, "A device prepared on this node for a claim, per pod holding the claim "
                                   "(UUID and GPU_I_ID as dcgm-exporter labels GPUs and MIG instances).",
                                   labels=self.labels)
        for values in self.series():
            family.add_metric(values, 1)
        yield family


CLAIM_DEVICES = ClaimDevices()
REGISTRY.register(CLAIM_DEVICES)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gpudra")
    except PackageNotFoundError:
        return "unknown"


BUILD_INFO.info({"version": _version(), "component": "agent"})


def set_prepared_claims(count: int) -> None:
    PREPARED_CLAIMS.set(count)


def device_health(counts: dict[str, int]) -> None:
    for state, count in counts.items():
        DEVICES_BY_HEALTH.labels(health=state).set(count)


def mps_daemons(counts: Mapping[str, int]) -> None:
    for state, count in counts.items():
        MPS_DAEMONS.labels(state=state).set(count)


def mps_daemons_restarted(count: int) -> None:
    if count:
        MPS_DAEMON_RESTARTS.inc(count)


def published(devices: int, slices: int, shareable: int = 0) -> None:
    PUBLISHED_DEVICES.set(devices)
    PUBLISHED_SLICES.set(slices)
    SHAREABLE_DEVICES.set(shareable)
    LAST_PUBLISH.set(time.time())


def publish_failed() -> None:
    PUBLISH_ERRORS.inc()


def serve(port: int, addr: str | None = None) -> None:
    """Serve ``/metrics`` on ``port`` in a background thread (0: do nothing); see
    :func:`gpudra_core.metrics_http.serve`."""
    metrics_http.serve(port, addr, log)
