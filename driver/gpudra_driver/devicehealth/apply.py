"""Device health, the I/O shell: NVML events in a thread, a periodic probe, taints published.

* A thread registers XID-critical and double-bit-ECC events on every physical GPU
  (``nvmlEventSetCreate``, ``nvmlDeviceGetSupportedEventTypes``, ``nvmlDeviceRegisterEvents``) and
  waits for them (``nvmlEventSetWait_v2``, ``wait_timeout`` at a time, so it notices the agent
  stopping), as NVIDIA's k8s-dra-driver-gpu does in cmd/gpu-kubelet-plugin/device_health.go. The
  event loop is never blocked: the thread hands observations over through a small buffer and
  wakes the loop. A GPU without events is ``unmonitored``.
* The probe (every ``probe_interval``, at start, and at once when a wait reports a lost GPU) looks
  each GPU up by UUID (``GPU_IS_LOST`` or a UUID that no longer resolves: lost) and reads
  ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``. Being the first thing done after a start, it re-derives
  the taints of a GPU that is still broken when the agent restarts.
* An event NVML attributes to a MIG instance is placed when it is folded in: the loop reads which
  dynamic MIG instances the checkpoint names then (``mig_instances``), so the fault keeps the
  memory slices of the instance those IDs were at that moment (:mod:`.scope`).
* Storms: identical observations coalesce in the buffer (bounded: past ``MAX_PENDING`` distinct
  ones, the rest are counted and dropped, and a probe is asked for), the loop folds whatever is
  buffered into one state change, and the publisher writes once per change (a write in flight
  absorbs every change made meanwhile). Errors from the wait are retried with a growing pause,
  logged on the first and every 100th.
* Publishing goes through the slice publisher, which retries with backoff like any slice change.
  Where the API server drops taints (Kubernetes 1.35) the monitor switches to leaving unhealthy
  devices out (:mod:`gpudra_driver.publishing.apisupport`), says so once in the log and a Node event.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from gpudra_driver import metrics
from gpudra_core.devicemodel import Device, DeviceTaint
from gpudra_driver.driverroot import DriverRoot
from gpudra_driver.publishing import apisupport
from gpudra_driver.devicehealth.feed import HealthFeed
from gpudra_driver.devicehealth.plan import (
    HEALTH_STATES, NO_INSTANCE, Ecc, GpuHealth, Mode, Moment, Observation, Policy, Probe, Transition, Unmonitored,
    Xid, apply,
    carry_lost, gpu_uuid, has_instance, health_of, next_expiry, observe, taints, transitions,
)
from gpudra_driver.devicehealth.scope import InstanceSlices, instance_slices
from gpudra_driver.nvml import load_nvml
from gpudra_driver.plugin.model import MigPlacement

log = logging.getLogger("gpudra.agent.health")

Report = Callable[[str, str, str], Awaitable[None]]
Publish = Callable[[Sequence[Device]], bool]
MAX_PENDING = 1024  # distinct observations buffered between two folds
XID_CRITICAL = 0x8  # nvmlEventTypeXidCriticalError
DOUBLE_BIT_ECC = 0x2  # nvmlEventTypeDoubleBitEccError
RECOVERY_ACTION_FIELD = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
WAIT_ERROR_PAUSE_MAX = 30.0


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def probe(nvml: Any, uuids: Sequence[str]) -> list[Observation]:
    """One :class:`Probe` per GPU that answered (an NVML error other than lost says nothing)."""
    found: list[Observation] = []
    for uuid in uuids:
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
        except (nvml.NVMLError_GpuIsLost, nvml.NVMLError_NotFound):
            found.append(Probe(uuid, lost=True))
            continue
        except nvml.NVMLError as error:
            log.debug("probe of %s: %s", uuid, error)
            continue
        action: int | None = None
        try:
            (value,) = nvml.nvmlDeviceGetFieldValues(handle, [RECOVERY_ACTION_FIELD])
            if value.nvmlReturn == 0:
                action = int(value.value.uiVal)
        except nvml.NVMLError_GpuIsLost:
            found.append(Probe(uuid, lost=True))
            continue
        except nvml.NVMLError:
            pass  # a driver without the field: the other rules still apply
        found.append(Probe(uuid, lost=False, recovery_action=action))
    return found


def event_support(nvml: Any, uuids: Sequence[str]) -> list[Observation]:
    """:class:`Unmonitored` for each GPU that cannot deliver XID events (what the monitor would
    find when it registers them)."""
    found: list[Observation] = []
    for uuid in uuids:
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
            if not nvml.nvmlDeviceGetSupportedEventTypes(handle) & XID_CRITICAL:
                found.append(Unmonitored(uuid, "no XID events"))
        except (nvml.NVMLError_GpuIsLost, nvml.NVMLError_NotFound):
            continue  # the probe says lost
        except nvml.NVMLError as error:
            found.append(Unmonitored(uuid, str(error)))
    return found


def snapshot(nvml: Any, devices: Sequence[Device], policy: Policy, now: Moment) -> list[Device]:
    """``devices`` with the taints one probe gives them (``gpudra discover``: no events to wait
    for, so what it shows is a GPU lost, a recovery action pending, or no events to monitor)."""
    uuids = sorted({u for u in (gpu_uuid(d) for d in devices) if u})
    nvml.nvmlInit()
    try:
        state = observe({}, [*probe(nvml, uuids), *event_support(nvml, uuids)], policy, now)
    finally:
        nvml.nvmlShutdown()
    return apply(devices, state, policy, "taint")


class HealthMonitor:
    def __init__(self, *, nvml_spec: str | None, driver_root: DriverRoot | None, policy: Policy,
                 publish: Publish, report: Report | None = None, probe_interval: float = 5.0,
                 wait_timeout: float = 1.0, clock: Callable[[], Moment] = Moment.now,
                 feed: HealthFeed | None = None,
                 on_transition: Callable[[Transition], Awaitable[None]] | None = None,
                 mig_instances: Callable[[], Iterable[MigPlacement]] = tuple) -> None:
        """``feed``: where each probe round's health of every device goes, for the kubelet (KEP-4680);
        ``on_transition``: told each device that turned unhealthy or recovered, after the Node event
        (the pods holding it are told: :mod:`.podevents`); ``mig_instances``: the dynamic MIG
        placements the checkpoint names now (blocking: called off the loop, only for an event NVML
        attributed to a MIG instance)."""
        self.nvml_spec, self.driver_root, self.policy = nvml_spec, driver_root, policy
        self.feed = feed
        self.publish, self.report = publish, report
        self.on_transition = on_transition
        self.mig_instances = mig_instances
        self._transitions: list[Transition] = []
        self.probe_interval, self.wait_timeout, self.clock = probe_interval, wait_timeout, clock
        self.state: dict[str, GpuHealth] = {}
        self.mode: Mode = "taint"
        self.discovered: list[Device] = []
        self.rescanned = False  # nothing is published before discovery handed over its first devices
        self.computed: dict[str, tuple[DeviceTaint, ...]] = {}  # each device's taints, whatever the mode
        self._gpus: set[str] = set()  # physical GPUs seen by the event thread
        self._pending: set[Observation] = set()
        self._pending_lock = threading.Lock()
        self._dropped = 0
        self._probe_now = True  # at start: re-derive what a previous agent knew
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()
        self._reports: list[tuple[str, str, str]] = []
        # No device is published before its GPU was probed once: a restarted agent must not show a
        # GPU that still needs a reset as healthy, not even for a moment.
        self.probed: set[str] = set()

    # -- the loop's side --------------------------------------------------------------------------

    def set_devices(self, devices: Sequence[Device]) -> bool:
        """Discovered devices in (the rescanner's publish); True when they, or what is published, changed."""
        discovered = carry_lost(list(devices), self.discovered, self.state)
        changed = discovered != self.discovered or not self.rescanned
        self.discovered, self.rescanned = discovered, True
        return self._publish() or changed

    def taints_dropped(self, *, expected: bool = False) -> None:
        """The API server does not keep device taints: leave unhealthy devices out from now on.
        ``expected``: found by the start-up dry run, a mode to report (INFO, a Normal event); else
        the publisher saw a written slice come back without them, a change to warn about."""
        if self.mode == "omit":
            return
        self.mode = "omit"
        message = (f"device taints are not in effect: {apisupport.WHY_DROPPED}. Unhealthy GPUs are left out of "
                   "this node's ResourceSlices until they recover; upgrade to Kubernetes 1.36 or enable the gate")
        (log.info if expected else log.warning)("device health: %s", message)
        self._reports.append(("Normal" if expected else "Warning", "DeviceTaintsUnsupported", message))
        self._publish()
        self._wake.set()

    async def check_api(self, kube: Any, node: str) -> None:
        """Find out once, by a dry run, whether taints are kept; retried until the server answers."""
        from gpudra_driver.retrying import retrying

        def retry(state: Any) -> None:
            log.warning("checking device taint support failed (%r); retrying", state.outcome.exception())

        kept: bool = await retrying(retry)(apisupport.api_server_keeps_taints, kube, self.policy.driver, node)
        if kept:
            log.info("device health: unhealthy devices are published with taints (%s/...)", self.policy.driver)
        else:
            self.taints_dropped(expected=True)

    def _publish(self) -> bool:
        computed = {d.name: taints(self.state, d, self.policy) for d in self.discovered}
        # what a message names each device by: its UUID, or a dynamic MIG placement's GPU
        uuids = {d.name: str(d.attributes["uuid"].value) if "uuid" in d.attributes
                 else f"on {d.attributes['parentUUID'].value}"
                 for d in self.discovered if "uuid" in d.attributes or "parentUUID" in d.attributes}
        for change in transitions(self.computed, computed, uuids, self.policy.driver):
            (log.warning if change.unhealthy else log.info)("%s", change.message)
            self._reports.append(("Warning", "DeviceUnhealthy", change.message) if change.unhealthy
                                 else ("Normal", "DeviceRecovered", change.message))
            self._transitions.append(change)
        self.computed = computed
        counts: dict[str, int] = {state: 0 for state in HEALTH_STATES}
        for found in computed.values():
            counts[health_of(found, self.policy.driver)] += 1
        metrics.device_health(counts)
        if self._reports:
            self._wake.set()
        if not self.rescanned:
            return False
        if {u for u in (gpu_uuid(d) for d in self.discovered) if u} - self.probed:
            self._probe_now = True
            self._wake.set()
            return False
        return self.publish(apply(self.discovered, self.state, self.policy, self.mode))

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        nvml = await self._open()
        thread = threading.Thread(target=self._watch, args=(nvml,), name="nvml-events", daemon=True)
        thread.start()
        next_probe = 0.0
        try:
            while True:
                now = time.monotonic()
                deadlines = [next_probe - now]
                expiry = next_expiry(self.state, self.policy)
                if expiry is not None:
                    deadlines.append(expiry - self.clock().monotonic)
                if not self._wake.is_set() and not self._probe_now:
                    try:
                        await asyncio.wait_for(self._wake.wait(), timeout=max(0.0, min(deadlines)))
                    except TimeoutError:
                        pass
                self._wake.clear()
                observations = self._take_pending()
                first = probed = False
                if self._probe_now or time.monotonic() >= next_probe:
                    probed = True
                    self._probe_now = False
                    gpus = self._known_gpus()
                    observations += await asyncio.to_thread(probe, nvml, sorted(gpus))
                    first, self.probed = bool(gpus - self.probed), self.probed | gpus
                    next_probe = time.monotonic() + self.probe_interval
                state = observe(self.state, observations, self.policy, self.clock(),
                                await self._instances(observations))
                changed = state != self.state or first
                if changed:
                    self.state = state
                    self._publish()
                if changed or probed:
                    await self._feed()
                if first:
                    unhealthy = [u for u in gpus if u in self.state and self.state[u].unhealthy]
                    log.info("device health: first probe of %d GPU(s): %d unhealthy%s", len(gpus), len(unhealthy),
                             f" ({', '.join(sorted(unhealthy))})" if unhealthy else "")
                await self._post_reports()
        finally:
            self._stop.set()
            await asyncio.to_thread(thread.join)  # the wait returns within wait_timeout
            try:
                nvml.nvmlShutdown()
            except nvml.NVMLError:
                pass

    async def _instances(self, observations: Sequence[Observation]) -> InstanceSlices:
        """The dynamic MIG instances now, when an observation needs them to be placed."""
        if not any(has_instance(o) for o in observations):
            return {}
        try:
            return instance_slices(await asyncio.to_thread(lambda: list(self.mig_instances())))
        except Exception as error:  # noqa: BLE001 - an unreadable checkpoint: the event is GPU-wide
            log.warning("device health: cannot read the dynamic MIG instances (%r); a MIG event taints its whole GPU",
                        error)
            return {}

    async def _feed(self) -> None:
        """The health of every discovered device, once each of their GPUs was probed (as for publishing)."""
        if self.feed is None or not self.rescanned:
            return
        if {u for u in (gpu_uuid(d) for d in self.discovered) if u} - self.probed:
            return
        await self.feed.set(self.discovered, self.computed, self.policy.driver, self.clock().wall)

    async def _open(self) -> Any:
        """NVML, initialised for this monitor's lifetime; retried while it fails (the rescanner
        says why in the log and a Node event)."""
        while True:
            try:
                nvml = await asyncio.to_thread(load_nvml, self.nvml_spec, self.driver_root)
                await asyncio.to_thread(nvml.nvmlInit)
                return nvml
            except Exception as error:  # noqa: BLE001 - NVML not ready yet: the health monitor waits for it
                log.debug("device health waits for NVML: %s", error)
                await asyncio.sleep(self.probe_interval)  # a retry period, not a synchronisation

    def _known_gpus(self) -> set[str]:
        return self._gpus | {u for u in (gpu_uuid(d) for d in self.discovered) if u} | set(self.state)

    async def _post_reports(self) -> None:
        reports, self._reports = self._reports, []
        changes, self._transitions = self._transitions, []
        for kind, reason, message in reports:
            if self.report is not None:
                await self.report(kind, reason, message)
        for change in changes:
            if self.on_transition is not None:
                await self.on_transition(change)

    def _take_pending(self) -> list[Observation]:
        with self._pending_lock:
            pending, self._pending = list(self._pending), set()
            dropped, self._dropped = self._dropped, 0
        if dropped:
            log.warning("device health: %d NVML event(s) dropped in a storm (more than %d distinct at once); "
                        "probing every GPU instead", dropped, MAX_PENDING)
            self._probe_now = True
        return pending

    # -- the NVML event thread --------------------------------------------------------------------

    def _push(self, observation: Observation | None = None, *, probe_now: bool = False) -> None:
        with self._pending_lock:
            if observation is not None:
                if len(self._pending) < MAX_PENDING or observation in self._pending:
                    self._pending.add(observation)
                else:
                    self._dropped += 1
            if probe_now:
                self._probe_now = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def _watch(self, nvml: Any) -> None:
        try:
            event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as error:
            log.error("device health: NVML cannot create an event set (%s); GPUs are probed only", error)
            return
        try:
            self._register(nvml, event_set)
            failures = 0
            while not self._stop.is_set():
                try:
                    data = nvml.nvmlEventSetWait_v2(event_set, int(self.wait_timeout * 1000))
                except nvml.NVMLError_Timeout:
                    continue
                except nvml.NVMLError_GpuIsLost:
                    self._push(probe_now=True)
                    continue
                except nvml.NVMLError as error:
                    failures += 1
                    if failures % 100 == 1:
                        log.warning("device health: waiting for NVML events failed %d time(s) in a row: %s",
                                    failures, error)
                    self._push(probe_now=True)
                    self._stop.wait(min(WAIT_ERROR_PAUSE_MAX, 0.1 * 2 ** min(failures, 9)))
                    continue
                failures = 0
                self._push(self._observation(nvml, data), probe_now=False)
        finally:
            try:
                nvml.nvmlEventSetFree(event_set)
            except nvml.NVMLError:
                pass

    def _register(self, nvml: Any, event_set: Any) -> None:
        for index in range(nvml.nvmlDeviceGetCount()):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            except nvml.NVMLError as error:  # discovery warns about it; the probe covers what is known of it
                log.debug("device health: GPU %d cannot be monitored: %s", index, error)
                continue
            self._gpus.add(uuid)
            try:
                mask = nvml.nvmlDeviceGetSupportedEventTypes(handle) & (XID_CRITICAL | DOUBLE_BIT_ECC)
                if not mask & XID_CRITICAL:
                    raise nvml.NVMLError_NotSupported()
                nvml.nvmlDeviceRegisterEvents(handle, mask, event_set)
            except nvml.NVMLError as error:
                log.warning("device health: GPU %d (%s) has no NVML events (%s): unmonitored", index, uuid, error)
                self._push(Unmonitored(uuid, str(error)))
        self._push(probe_now=True)

    def _observation(self, nvml: Any, data: Any) -> Observation | None:
        try:
            uuid = _text(nvml.nvmlDeviceGetUUID(data.device))
        except nvml.NVMLError:
            self._push(probe_now=True)
            return None
        gi = int(data.gpuInstanceId) if data.gpuInstanceId is not None else NO_INSTANCE
        ci = int(data.computeInstanceId) if data.computeInstanceId is not None else NO_INSTANCE
        if data.eventType & XID_CRITICAL:
            return Xid(uuid, int(data.eventData), gi, ci)
        if data.eventType & DOUBLE_BIT_ECC:
            return Ecc(uuid, gi, ci)
        return None
