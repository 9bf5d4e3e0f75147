"""Deciding what preparing one claim means (pure).

``plan_prepare`` takes the claim as :func:`.allocation.read_claim` read it (before the node lock:
bounded, its configs decoded), this node's devices, and the checkpoint; it returns the
:class:`PreparedClaim` to write, or raises :class:`ClaimError` with a message that names the claim
and the reason. Nothing here does I/O, and nothing costs more than a look at the claim's devices."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpudra_driver.plugin.allocation import ClaimAllocation, read_claim
from gpudra_driver.plugin.cdi import cdi_device_id
from gpudra_core.quantity import format_quantity
from gpudra_driver.plugin.checkpoint import COMPLETED, Checkpoint
from gpudra_driver.plugin.devicemetadata import claim_metadata
from gpudra_driver.plugin.devicenodes import DYNAMIC_WHOLE_GPU, PLACEMENT, NodeDevice
from gpudra_driver.gpuconfig import GpuConfig, GpuConfigError, Mps, Strategy
from gpudra_driver.plugin.sharing import plan as gpusettings
from gpudra_driver.plugin.model import (MPS, NOT_SHARED, TIME_SLICING, ClaimError, ClaimRef, DeviceSharing,
                                        MigModeOff, PreparedClaim, PreparedDevice)
from gpudra_driver.plugin.sharing.mps.plan import share_limits

MPS_MIN_COMPUTE_CAPABILITY = (7, 0)  # Volta: MPS limits (thread percentage, pinned memory) need it


@dataclass(frozen=True)
class Plan:
    claim: PreparedClaim
    done: bool  # already prepared (checkpoint says PrepareCompleted): answer again, write nothing


def plan_prepare(ref: ClaimRef, claim: ClaimAllocation | Mapping[str, Any] | ClaimError | None,
                 devices: Mapping[str, NodeDevice] | None, checkpoint: Checkpoint, *, node: str, driver: str,
                 device_metadata: bool = False) -> Plan:
    """What to prepare for ``ref``. ``claim`` is the claim as read (:func:`read_claim`; the GET
    result is read here: None is not found); ``devices`` are this node's discovered devices by
    name (None: discovery has not finished yet). A claim that could not be read or was refused
    arrives as its :class:`ClaimError`; it matters only if the claim is not prepared yet.
    ``device_metadata``: record the claim's device metadata (:mod:`.devicemetadata`) to write."""
    ref.check()
    read = claim if isinstance(claim, ClaimAllocation) else read_claim(ref, claim, driver=driver)
    entry = checkpoint.claims.get(ref.uid)
    if entry is not None and entry.state == COMPLETED and not _reallocated(entry.claim, read):
        # Idempotent: the kubelet retries after timeouts and restarts; answer what we answered.
        return Plan(entry.claim, done=True)
    if isinstance(read, ClaimError):
        raise read
    _check_node_selector(ref, read.node_names, node)
    results = read.devices
    if not results:  # the kubelet only asks the drivers named in the allocation
        raise ClaimError(f"{ref}: no device of driver {driver} is allocated to it")
    if devices is None:
        raise ClaimError(f"{ref}: this node's devices are not discovered yet; retry")
    by_device: dict[str, list[str]] = {}
    full_requests: dict[str, list[str]] = {}  # device -> the results' request names as allocated
    exclusive: set[str] = set()  # devices with at least one result without adminAccess
    shares: dict[str, tuple[str, tuple[tuple[str, int], ...]]] = {}  # device -> (shareID, consumed)
    for result in results:
        name = result.device
        if result.pool != node:
            raise ClaimError(f"{ref}: device {name!r} is allocated from pool {result.pool!r}, not this node's "
                             f"pool {node!r}")
        if name not in devices:
            raise ClaimError(f"{ref}: device {name!r} is not a device of node {node}")
        if devices[name].kind == PLACEMENT and result.admin_access:
            raise ClaimError(f"{ref}: device {name!r} is a dynamic MIG placement, which has no instance to "
                             "monitor unless a claim holds it: adminAccess is refused on it")
        if devices[name].kind == DYNAMIC_WHOLE_GPU and result.admin_access:
            raise ClaimError(f"{ref}: device {name!r} is a dynamic MIG GPU as a whole, whose MIG mode is off only "
                             "while a claim holds it: adminAccess is refused on it")
        request = result.request.split("/", 1)[0]  # "req/sub" -> "req"
        full_requests.setdefault(name, []).append(result.request)
        requests = by_device.setdefault(name, [])
        if request not in requests:
            requests.append(request)
        if not result.admin_access:
            exclusive.add(name)
        if result.share_id is not None:
            if name in shares:  # one Device per (device, share) would be needed to answer it
                raise ClaimError(f"{ref}: it holds two shares of device {name}; one share per device and "
                                 "claim is supported")
            shares[name] = (result.share_id, result.consumed)
    for name in exclusive:
        _check_holders(ref, devices[name], node, checkpoint, shares.get(name))
    by_request: dict[str, list[NodeDevice]] = {}  # full request name -> its devices
    for name, names in full_requests.items():
        for full_request in names:
            by_request.setdefault(full_request, []).append(devices[name])
    prepared = tuple(
        PreparedDevice(tuple(requests), node, name, devices[name].uuid, devices[name].device_nodes,
                       cdi_device_id(driver, ref.uid, name), admin_access=name not in exclusive,
                       share_id=shares[name][0] if name in shares else None,
                       consumed=shares[name][1] if name in shares else (),
                       sharing=_sharing(ref, read.configs, full_requests[name], devices[name],
                                        by_request, dict(shares[name][1]) if name in shares else None),
                       mig=devices[name].placement,
                       mig_mode_off=MigModeOff() if devices[name].kind == DYNAMIC_WHOLE_GPU else None,
                       attributes=devices[name].attributes if device_metadata else ())
        for name, requests in by_device.items())
    for device in prepared:
        if device.mig is not None and device.sharing != NOT_SHARED:
            raise ClaimError(f"{ref}: device {device.device} is a dynamic MIG placement: sharing it "
                             f"({device.sharing.strategy}) is not supported yet; share the claim instead")
        if device.mig_mode_off is not None and device.sharing != NOT_SHARED:
            # an MPS daemon or another claim's process would keep the GPU busy, and MIG mode can be
            # turned on again only while the GPU is idle
            raise ClaimError(f"{ref}: device {device.device} is a dynamic MIG GPU as a whole: sharing it "
                             f"({device.sharing.strategy}) is not supported; share the claim instead")
    _check_one_mps_daemon(ref, prepared)
    for device in prepared:
        others = {uid: held for uid, held in checkpoint.device_holders(node, device.device)
                  if uid != ref.uid and held is not None}
        if (problem := gpusettings.conflict(device, others)) is not None:
            raise ClaimError(f"{ref}: {problem}")
    metadata = claim_metadata((d.request for d in results), read.pod_claim_name) if device_metadata else None
    return Plan(PreparedClaim(ref, prepared, metadata), done=False)


def needs_prepare_started(before: Checkpoint, planned: Sequence[PreparedClaim]) -> bool:
    """Whether preparing ``planned`` on ``before`` needs the PrepareStarted write: when it does
    something outside the CDI directory that a restart must be able to undo (sharing: GPU
    settings, an MPS daemon; a dynamic MIG instance, or a dynamic MIG GPU's MIG mode), or replaces an entry (a claim allocated anew, an adopted one).
    Otherwise the specs are written and the claims committed with one checkpoint write: a crash in
    between leaves only specs that no entry names, which start-up and the next unprepare under
    the node lock remove (:meth:`.state.DeviceState`)."""
    return any(claim.uid in before.claims or claim.uid in before.adopted
               or any(device.sharing != NOT_SHARED or device.mig is not None or device.mig_mode_off is not None
                      for device in claim.devices)
               for claim in planned)


def _sharing(ref: ClaimRef, configs: Mapping[str, GpuConfig | ClaimError], requests: list[str], device: NodeDevice,
             by_request: Mapping[str, list[NodeDevice]], consumed: Mapping[str, int] | None) -> DeviceSharing:
    """How the claim's containers share ``device``: its GpuConfig (class config, then claim
    config, decoded by :func:`read_claim`) for the request(s) the device serves. ``consumed``:
    what the claim's share of the device consumes (consumable capacity), None when it holds the
    whole device."""
    chosen: list[GpuConfig] = []
    for request in requests:
        config = configs[request]
        if isinstance(config, ClaimError):
            raise config
        chosen.append(config)
    if any(config != chosen[0] for config in chosen):
        raise ClaimError(f"{ref}: device {device.name} serves requests {', '.join(requests)}, whose GpuConfigs "
                         "ask for different sharing")
    sharing = chosen[0].sharing
    if sharing.strategy is Strategy.EXCLUSIVE:
        return NOT_SHARED
    if sharing.strategy is Strategy.TIME_SLICING:
        if device.kind not in ("gpu", DYNAMIC_WHOLE_GPU):
            raise ClaimError(f"{ref}: device {device.name} is a MIG device: time-slicing applies to full GPUs "
                             "(a MIG device's compute is already partitioned by the hardware)")
        assert sharing.time_slicing is not None
        return DeviceSharing(TIME_SLICING, timeslice=sharing.time_slicing.interval.nvidia_smi_value)
    assert sharing.mps is not None
    return _mps_sharing(ref, sharing.mps, requests[0], device, by_request, consumed)


def _mps_sharing(ref: ClaimRef, config: Mps, request: str, device: NodeDevice,
                 by_request: Mapping[str, list[NodeDevice]], consumed: Mapping[str, int] | None) -> DeviceSharing:
    if device.compute_capability and _version(device.compute_capability) < MPS_MIN_COMPUTE_CAPABILITY:
        raise ClaimError(f"{ref}: sharing.strategy: MPS with limits needs compute capability 7.0 (Volta) or "
                         f"newer; device {device.name} has {device.compute_capability}")
    try:
        settings = config.for_devices((d.name, d.uuid) for d in by_request[request])[device.name]
    except GpuConfigError as error:
        raise ClaimError(f"{ref}: request {request}: {error}") from None
    key = next((k for k in (device.name, device.uuid) if k in config.per_device), None)
    where = f"sharing.mps.perDevice.{key}." if key and config.per_device[key].pinned_memory_limit is not None \
        else "sharing.mps."
    limit, percentage = settings.pinned_memory_limit, settings.active_thread_percentage
    if limit is not None and device.memory and limit > device.memory:
        raise ClaimError(f"{ref}: {where}pinnedMemoryLimit: {format_quantity(limit, binary=True)} is more than "
                         f"device {device.name}'s memory, {format_quantity(device.memory, binary=True)}")
    if consumed is not None and consumed.get("memory"):  # a share: what it was granted is its limit
        granted, part = share_limits(consumed["memory"], device.memory)
        limit = granted if limit is None else min(limit, granted)
        percentage = part if percentage is None else min(percentage, part)
    return DeviceSharing(MPS, active_thread_percentage=percentage, pinned_memory_limit=limit,
                         shm_size=config.shm_size)


def _check_one_mps_daemon(ref: ClaimRef, prepared: tuple[PreparedDevice, ...]) -> None:
    """A claim's MPS devices share one control daemon, whose active thread percentage is one value."""
    percentages = {d.device: d.sharing.active_thread_percentage for d in prepared if d.sharing.strategy == MPS}
    if len(set(percentages.values())) > 1:
        raise ClaimError(f"{ref}: sharing.mps.perDevice: activeThreadPercentage differs between devices "
                         f"({', '.join(f'{n}: {p}' for n, p in sorted(percentages.items()))}); the claim's devices "
                         "share one MPS control daemon, which has one active thread percentage")


def _version(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(".")[:2])
    except ValueError:
        return (99,)


def _check_holders(ref: ClaimRef, device: NodeDevice, node: str, checkpoint: Checkpoint,
                   share: tuple[str, tuple[tuple[str, int], ...]] | None) -> None:
    """Refuse a device other claims hold, unless every allocation of it is a share (consumable
    capacity, KEP-5075) and the shares together fit the device: the scheduler never allocates more,
    so more means state it never saw (a claim whose unprepare was lost, a re-allocation behind
    the agent's back), and handing it out would over-commit the GPU."""
    others = [(uid, held) for uid, held in checkpoint.device_holders(node, device.name) if uid != ref.uid]
    if not others:
        return
    if share is None:
        raise ClaimError(f"{ref}: device {device.name} is already prepared for claim {others[0][0]}; "
                         "a device is shared between claims only as consumable capacity (a shareID)")
    exclusive = [uid for uid, held in others if held is None or held.share_id is None]
    if exclusive:
        raise ClaimError(f"{ref}: device {device.name} is already prepared for claim {exclusive[0]} "
                         "without a share; it cannot be shared")
    if device.memory:
        held = sum(h.consumed_memory for _, h in others if h is not None)
        wanted = dict(share[1]).get("memory", 0)
        if held + wanted > device.memory:
            raise ClaimError(
                f"{ref}: device {device.name} would be over-committed: {format_quantity(wanted, binary=True)} of memory "
                f"asked, {format_quantity(held, binary=True)} of {format_quantity(device.memory, binary=True)} already held by "
                f"claim(s) {', '.join(sorted(uid for uid, _ in others))}")


def _reallocated(prepared: PreparedClaim, claim: ClaimAllocation | ClaimError) -> bool:
    """True when the API server shows the claim (same UID) allocated to other devices of ours than
    those it was prepared with: deallocated and allocated again while an unprepare never reached
    us. Answering the old devices would hand the container the wrong GPU. A failed GET, a missing,
    replaced, unallocated or unreadable claim is no evidence: the prepared answer stands."""
    if isinstance(claim, ClaimError):
        return False
    now = {(d.pool, d.device, d.share_id) for d in claim.devices}
    return bool(now) and now != {(d.pool, d.device, d.share_id) for d in prepared.devices}


def _check_node_selector(ref: ClaimRef, names: tuple[frozenset[str], ...], node: str) -> None:
    """The scheduler pins node-local allocations with ``matchFields metadata.name In [node]``."""
    if names and not any(node in values for values in names):
        shown = sorted(set().union(*names))
        raise ClaimError(f"{ref}: allocated to node {shown[:3]}{' and more' if len(shown) > 3 else ''}, not {node}")
