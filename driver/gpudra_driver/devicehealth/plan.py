"""Device health, the pure half: what NVML told us (events, probes) in, device taints out.

Per physical GPU (by UUID) a :class:`GpuHealth` holds:

* faults from events (an XID critical error, a double-bit ECC error), attributed to the GPU, to
  one MIG device by its GPU and compute instance IDs as NVML reports them, or to the memory slices
  of a dynamic MIG instance (which devices each reaches: :mod:`.scope`);
* from the probe: the GPU lost (``NVML_ERROR_GPU_IS_LOST``, or its UUID no longer resolves) and
  its recovery action (``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``, where the driver reports it);
* ``unmonitored``: NVML cannot deliver events for it.

Taints (KEP-5055 device taints), in the driver's domain:

=================================  ===========================  ===========================
condition                          taint                        effect
=================================  ===========================  ===========================
fatal XID ``n``                    ``<driver>/xid=<n>``         NoSchedule (NoExecute if asked)
informational XID ``n``            ``<driver>/xid=<n>``         None
double-bit ECC error               ``<driver>/ecc=double-bit``  NoSchedule (NoExecute if asked)
GPU lost                           ``<driver>/gpu-lost``        NoSchedule (NoExecute if asked)
recovery action other than none    ``<driver>/recovery-action=<action>``  NoSchedule (...)
no NVML events                     ``<driver>/unmonitored``     None
=================================  ===========================  ===========================

Recovery, without restarting anything: lost and recovery-action taints go as soon as a probe finds
the GPU back and its recovery action none; an event's taint goes once no new event of its kind came
for the quiet period *and* the GPU is neither lost nor waiting for a recovery action. So after an
agent restart a GPU that still needs a reset is tainted again by the first probe, while the XID
that caused it (an event, gone with the process) is not repeated.

Memory is bounded: one fault per (kind, informational, GPU instance, compute instance, memory
slices) and GPU, the newest value winning, at most ``MAX_FAULTS_PER_GPU`` per GPU, so a storm of
events changes a value, never the size.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

from gpudra_core.devicehealthstate import HEALTH_NAMES, HealthName, health_state
from gpudra_core.devicemodel import Device, DeviceTaint, TaintEffect
from gpudra_driver.devicehealth import xids as xid_catalogue
from gpudra_driver.devicehealth.scope import NO_INSTANCE, InstanceSlices, Slices, attribute, reaches
from gpudra_core.kubeapi import rfc3339  # whole seconds: a republished taint compares equal

MAX_FAULTS_PER_GPU = 32
DEFAULT_QUIET_PERIOD = 300.0  # seconds without a new fatal event before its taint goes

# NVML_GPU_RECOVERY_ACTION_* (nvml.h; pynvml) -> the taint value
RECOVERY_ACTIONS = {
    0: "none", 1: "gpu-reset", 2: "node-reboot", 3: "drain-p2p", 4: "drain-and-reset",
    5: "recover-imex-domain", 6: "bus-reset", 7: "system-reboot",
}
HEALTH_STATES: tuple[HealthName, ...] = HEALTH_NAMES


@dataclass(frozen=True)
class Policy:
    driver: str
    informational_xids: frozenset[int] = xid_catalogue.DEFAULT_INFORMATIONAL
    quiet_period: float = DEFAULT_QUIET_PERIOD
    effect: Literal["NoSchedule", "NoExecute"] = "NoSchedule"  # of every fault taint


@dataclass(frozen=True)
class Moment:
    """One reading of both clocks. ``monotonic`` measures: a fault's quiet period counts on it, so
    a step of the wall clock (NTP correcting it, a VM restored from a snapshot) neither clears a
    fatal XID's taint early nor holds it late. ``wall`` dates: a taint's timeAdded, which people
    read and the taint eviction controller counts tolerationSeconds from."""

    monotonic: float
    wall: float

    @classmethod
    def now(cls) -> Moment:
        return cls(time.monotonic(), time.time())


# -- observations ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Xid:
    gpu: str  # the physical GPU's UUID
    xid: int
    gi: int = NO_INSTANCE
    ci: int = NO_INSTANCE


@dataclass(frozen=True)
class Ecc:
    """A double-bit (uncorrectable) ECC error."""

    gpu: str
    gi: int = NO_INSTANCE
    ci: int = NO_INSTANCE


@dataclass(frozen=True)
class Probe:
    gpu: str
    lost: bool
    recovery_action: int | None = None  # None: the driver does not report it


@dataclass(frozen=True)
class Unmonitored:
    gpu: str
    reason: str


Observation: TypeAlias = Xid | Ecc | Probe | Unmonitored


# -- state ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Fault:
    kind: Literal["xid", "ecc"]
    value: str  # the newest XID, or "double-bit"
    informational: bool
    gi: int  # NO_INSTANCE (both): the whole GPU
    ci: int
    since: float  # first seen, wall clock: the taint's timeAdded
    last: float  # newest, monotonic clock: the quiet period counts from here
    slices: Slices | None = None  # a dynamic MIG instance's memory slices when the event came

    @property
    def key(self) -> tuple[str, bool, int, int, Slices | None]:
        if self.slices is not None:  # a dynamic instance's: its IDs pass to other instances, its memory stays
            return self.kind, self.informational, 0, 0, self.slices
        return self.kind, self.informational, self.gi, self.ci, None


@dataclass(frozen=True)
class GpuHealth:
    faults: tuple[Fault, ...] = ()
    lost_since: float | None = None  # wall clock, as every *_since: a taint's timeAdded
    recovery_action: int | None = None
    action_since: float | None = None
    unmonitored: str | None = None  # why
    unmonitored_since: float | None = None

    @property
    def needs_action(self) -> bool:
        return self.recovery_action not in (None, 0)

    @property
    def unhealthy(self) -> bool:
        """Whether some device on it gets a NoSchedule/NoExecute taint."""
        return self.lost_since is not None or self.needs_action or any(not f.informational for f in self.faults)


State: TypeAlias = Mapping[str, GpuHealth]  # by GPU UUID; never mutated, each step returns a new one


def observe(state: State, observations: Iterable[Observation], policy: Policy, now: Moment,
            instances: InstanceSlices | None = None) -> dict[str, GpuHealth]:
    """``state`` after ``observations`` (all at ``now``), faults past their quiet period dropped.
    ``instances``: the dynamic MIG instances that exist now (:func:`.scope.instance_slices`), to
    place an event NVML attributes to one of them."""
    gpus = dict(state)
    for seen in observations:
        gpus[seen.gpu] = _observe_one(gpus.get(seen.gpu, GpuHealth()), seen, policy, now, instances or {})
    return expire(gpus, policy, now)


def has_instance(observation: Observation) -> bool:
    """Whether NVML attributed the event to a MIG instance (its fold then needs the dynamic instances)."""
    return isinstance(observation, (Xid, Ecc)) and observation.gi != NO_INSTANCE


def _observe_one(gpu: GpuHealth, seen: Observation, policy: Policy, now: Moment,
                 instances: InstanceSlices) -> GpuHealth:
    if isinstance(seen, Probe):
        if seen.lost:
            return dataclasses.replace(gpu, lost_since=gpu.lost_since if gpu.lost_since is not None else now.wall)
        action_since = gpu.action_since if gpu.recovery_action == seen.recovery_action else now.wall
        return dataclasses.replace(gpu, lost_since=None, recovery_action=seen.recovery_action,
                                   action_since=action_since if seen.recovery_action not in (None, 0) else None)
    if isinstance(seen, Unmonitored):
        return dataclasses.replace(gpu, unmonitored=seen.reason,
                                   unmonitored_since=gpu.unmonitored_since or now.wall)
    if isinstance(seen, Xid):
        gi, ci, slices = attribute(seen.gpu, seen.xid, seen.gi, seen.ci, instances)
        fault = Fault("xid", str(seen.xid), seen.xid in policy.informational_xids, gi, ci, now.wall,
                      now.monotonic, slices)
    else:
        gi, ci, slices = attribute(seen.gpu, None, seen.gi, seen.ci, instances)
        fault = Fault("ecc", "double-bit", False, gi, ci, now.wall, now.monotonic, slices)
    faults = [f for f in gpu.faults if f.key != fault.key]
    earlier = next((f for f in gpu.faults if f.key == fault.key), None)
    if earlier is not None:
        fault = dataclasses.replace(fault, since=earlier.since)
    faults.append(fault)
    return dataclasses.replace(gpu, faults=tuple(faults[-MAX_FAULTS_PER_GPU:]))


def expire(state: State, policy: Policy, now: Moment) -> dict[str, GpuHealth]:
    """Drop the faults whose quiet period has passed (on the monotonic clock): informational ones
    always, fatal ones only while the GPU is neither lost nor waiting for a recovery action. GPUs
    left with nothing to say are dropped."""
    gpus: dict[str, GpuHealth] = {}
    for uuid, gpu in state.items():
        blocked = gpu.lost_since is not None or gpu.needs_action
        faults = tuple(f for f in gpu.faults
                       if now.monotonic - f.last < policy.quiet_period or (blocked and not f.informational))
        kept = dataclasses.replace(gpu, faults=faults) if faults != gpu.faults else gpu
        if kept != GpuHealth(recovery_action=kept.recovery_action) or kept.needs_action:
            gpus[uuid] = kept
    return gpus


def next_expiry(state: State, policy: Policy) -> float | None:
    """When (monotonic clock) :func:`expire` may next drop something (None: nothing waits on time)."""
    return min((f.last + policy.quiet_period for g in state.values() for f in g.faults), default=None)


# -- taints ---------------------------------------------------------------------------------------

def gpu_uuid(device: Device) -> str | None:
    """The physical GPU a device lives on: itself, or a MIG device's parent."""
    attr = device.attributes.get("parentUUID") or device.attributes.get("uuid")
    return str(attr.value) if attr is not None else None


def taints(state: State, device: Device, policy: Policy) -> tuple[DeviceTaint, ...]:
    """The device's taints, sorted by key and effect."""
    uuid = gpu_uuid(device)
    gpu = state.get(uuid) if uuid is not None else None
    if gpu is None:
        return ()
    d, effect = policy.driver, policy.effect
    found: list[DeviceTaint] = []
    if gpu.lost_since is not None:
        found.append(DeviceTaint(f"{d}/gpu-lost", "", effect, rfc3339(gpu.lost_since)))
    if gpu.needs_action:
        assert gpu.recovery_action is not None and gpu.action_since is not None
        action = RECOVERY_ACTIONS.get(gpu.recovery_action, str(gpu.recovery_action))
        found.append(DeviceTaint(f"{d}/recovery-action", action, effect, rfc3339(gpu.action_since)))
    groups: dict[tuple[str, bool], list[Fault]] = {}
    for fault in gpu.faults:
        if reaches(fault.gi, fault.ci, fault.slices, device):
            groups.setdefault((fault.kind, fault.informational), []).append(fault)
    for (kind, informational), faults in groups.items():
        newest = max(faults, key=lambda f: f.last)
        fault_effect: TaintEffect = "None" if informational else effect
        found.append(DeviceTaint(f"{d}/{kind}", newest.value, fault_effect, rfc3339(min(f.since for f in faults))))
    if gpu.unmonitored is not None and gpu.unmonitored_since is not None:
        found.append(DeviceTaint(f"{d}/unmonitored", "", "None", rfc3339(gpu.unmonitored_since)))
    return tuple(sorted(found, key=lambda t: (t.key, t.effect)))


def health_of(device_taints: Sequence[DeviceTaint], driver: str) -> HealthName:
    """The device's health word (:func:`gpudra_core.devicehealthstate.health_state`)."""
    return health_state(((t.key, t.effect) for t in device_taints), driver)


Mode: TypeAlias = Literal["taint", "omit"]


def apply(devices: Iterable[Device], state: State, policy: Policy, mode: Mode) -> list[Device]:
    """The devices to publish. ``taint``: each with its taints. ``omit`` (an API server that drops
    taints, Kubernetes 1.35 with DRADeviceTaints off): unhealthy devices left out, the others
    published without taints (the server would drop them, and the slice would never compare equal)."""
    published = []
    for device in devices:
        found = taints(state, device, policy)
        if mode == "omit":
            if health_of(found, policy.driver) == "unhealthy":
                continue
            found = ()
        published.append(dataclasses.replace(device, taints=found) if found != device.taints else device)
    return published


def carry_lost(discovered: Sequence[Device], previous: Sequence[Device], state: State) -> list[Device]:
    """``discovered`` plus the previously known devices of GPUs that are lost now: NVML no longer
    enumerates a lost GPU, and a device that silently vanished would tell nobody what happened."""
    names = {d.name for d in discovered}
    lost = {uuid for uuid, gpu in state.items() if gpu.lost_since is not None}
    return [*discovered, *(d for d in previous if d.name not in names and gpu_uuid(d) in lost)]


# -- what people are told -------------------------------------------------------------------------

@dataclass(frozen=True)
class Transition:
    device: str
    unhealthy: bool  # False: recovered
    message: str


def describe(taint: DeviceTaint) -> str:
    """``gpu.gpudra.io/xid=48:NoSchedule (XID 48: double-bit ECC error)``."""
    text = f"{taint.key}{'=' + taint.value if taint.value else ''}:{taint.effect}"
    if taint.key.endswith("/xid") and taint.value.isdigit():
        text += f" (XID {taint.value}: {xid_catalogue.meaning(int(taint.value))})"
    return text


def transitions(before: Mapping[str, tuple[DeviceTaint, ...]], after: Mapping[str, tuple[DeviceTaint, ...]],
                uuids: Mapping[str, str], driver: str) -> list[Transition]:
    """Devices (by name) that turned unhealthy or recovered between two publishes; ``uuids`` names
    each device's UUID for the message."""
    changes = []
    for name in sorted(set(before) | set(after)):
        was = health_of(before.get(name, ()), driver) == "unhealthy"
        now = health_of(after.get(name, ()), driver) == "unhealthy"
        label = f"{name} ({uuids[name]})" if name in uuids else name
        if now and not was:
            reasons = "; ".join(describe(t) for t in after[name] if t.effect != "None")
            changes.append(Transition(name, True, f"{label} is unhealthy: {reasons}"))
        elif was and not now and name in after:
            changes.append(Transition(name, False, f"{label} recovered: its NoSchedule/NoExecute taints are removed"))
    return changes
