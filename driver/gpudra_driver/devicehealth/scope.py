"""Which devices a fault reaches (pure): the GPU, one MIG device, or the dynamic MIG placements
that share the faulty instance's memory.

NVML attributes an event to a MIG instance by its GPU and compute instance IDs, ``0xFFFFFFFF``
when it concerns no instance (``nvmlEventData_t``, NVML API reference). Whether the error stayed
in that instance is the hardware's to say, per XID (:data:`.xids.CONTAINED_IN_INSTANCE`): an XID
it does not contain (the GPU off the bus, an uncontained ECC error, a GSP error) reaches every
device of the GPU whatever IDs came with it.

A contained fault reaches:

* a whole GPU (MIG disabled): always, its MIG devices are its own silicon;
* a static MIG device: when its GPU instance is the fault's and, if NVML named one, its compute
  instance too;
* a dynamic MIG placement (``gpu-<i>-mig-<profile>-at<start>``, no instance of its own until
  prepared): when its memory slices overlap those of the instance the fault came from. A
  placement that overlaps would be created on the same memory and engines, so the scheduler must
  not hand it out either; a placement on other memory slices is another part of the chip.

A dynamic instance's IDs are NVML's for the life of one claim: the next claim on the same
placement may get others, and another placement the same ones. So the IDs are resolved to memory
slices when the event is folded in, from the checkpoint entries that name instances then
(:func:`instance_slices`), and the fault keeps the slices, not the IDs: its taint outlives the
claim's unprepare for the quiet period, on the same memory. An event whose IDs no entry names
(the claim gone between the event and its fold, an instance gpudra did not make) cannot be placed
and reaches every placement of the GPU: the safe side.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeAlias

from gpudra_core.devicemodel import Device
from gpudra_core.migpartitions import MEMORY_SLICE_PREFIX
from gpudra_driver.devicehealth import xids as xid_catalogue
from gpudra_driver.plugin.model import MigPlacement

NO_INSTANCE = 0xFFFFFFFF  # NVML's GPU/compute instance ID of an event not tied to a MIG device

Slices: TypeAlias = tuple[int, ...]  # memory slices, ascending
# (parent GPU UUID, GPU instance ID) -> (compute instance ID, the placement's memory slices)
InstanceSlices: TypeAlias = Mapping[tuple[str, int], tuple[int, Slices]]


def instance_slices(placements: Iterable[MigPlacement]) -> dict[tuple[str, int], tuple[int, Slices]]:
    """The dynamic MIG instances that exist for claims now (created: both IDs known), by parent GPU
    and GPU instance ID."""
    return {(p.parent_uuid, p.gi): (p.ci, tuple(range(p.start, p.start + p.size)))
            for p in placements if p.gi is not None and p.ci is not None}


def attribute(gpu: str, xid: int | None, gi: int, ci: int,
              instances: InstanceSlices) -> tuple[int, int, Slices | None]:
    """An event's scope as a fault keeps it: (GPU instance, compute instance, memory slices).

    ``xid`` None is a double-bit ECC event: NVML attributes one to an instance only when the error
    is in that instance's memory. An XID the hardware does not contain, or an event with no
    instance, is GPU-wide (both IDs ``NO_INSTANCE``). Slices are those of the dynamic instance
    the IDs name now (None: not one of the agent's)."""
    if gi == NO_INSTANCE or (xid is not None and not xid_catalogue.contained(xid)):
        return NO_INSTANCE, NO_INSTANCE, None
    found = instances.get((gpu, gi))
    slices = found[1] if found is not None and ci in (NO_INSTANCE, found[0]) else None
    return gi, ci, slices


def memory_slices(device: Device) -> frozenset[int] | None:
    """The memory slices a device of a dynamic MIG GPU takes from its counters (a placement's; the
    whole GPU's, where it is published, are all of them); None: it takes none."""
    found = frozenset(int(name[len(MEMORY_SLICE_PREFIX):]) for use in device.consumes_counters
                      for name in use.counters if name.startswith(MEMORY_SLICE_PREFIX))
    return found or None


def _instance(device: Device) -> tuple[int, int] | None:
    gi, ci = device.attributes.get("gpuInstanceId"), device.attributes.get("computeInstanceId")
    return (int(gi.value), int(ci.value)) if gi is not None and ci is not None else None


def reaches(gi: int, ci: int, slices: Slices | None, device: Device) -> bool:
    """Whether a fault of scope (``gi``, ``ci``, ``slices``) on the device's GPU concerns ``device``.
    A dynamic instance's fault goes by memory slices (its IDs may be another instance's by now);
    any other MIG-attributed one by IDs."""
    if gi == NO_INSTANCE:
        return True
    placement = memory_slices(device)
    if slices is not None:
        # a device that is not a placement (the GPU turned static since, or whole): the safe side
        return placement is None or not placement.isdisjoint(slices)
    instance = _instance(device)
    if instance is not None:
        return gi == instance[0] and ci in (NO_INSTANCE, instance[1])
    return True  # the whole GPU, or a placement when the instance could not be placed
