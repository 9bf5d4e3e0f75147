"""Dynamic MIG: every MIG placement a GPU could have, as devices the scheduler can allocate without
ever choosing two that overlap (pure).

Kubernetes' partitionable devices (KEP-4815) let a pool declare counter sets and each device say
what it takes from them while allocated; the scheduler allocates a device only if what it takes is
still free. For a MIG-capable GPU the counters are the hardware's own units:

* ``memory-slice-<k>`` (value 1 each): the memory slices a GPU instance occupies. A placement
  ``(start, size)`` (NVML's ``nvmlGpuInstancePlacement_t``) takes slices ``start .. start+size-1``,
  so two placements the scheduler gives out never overlap in memory, NVML's placement rule;
* ``compute-slices``: the GPU's compute slices (7 on A100 and H100), a profile takes its count;
* ``copy-engines``, ``decoders``, ``encoders``, ``jpeg-engines``, ``ofa-engines``: the engines, a
  profile takes what NVML says it gets. This is what keeps the media-extension profiles
  (``1g.10gb+me``: the GPU's one OFA) to one at a time, as the hardware does.

A counter whose GPU total is zero is left out (nothing could take it). The whole GPU, where it is
offered (:func:`toggles_mig_mode_live`), takes all of them, so the scheduler gives it only while no
placement is taken, and no placement while it is: prepare then turns the GPU's MIG mode off for
it, and unprepare on again (docs/mig.md). The geometry comes from NVML
(:func:`gpudra_driver.discovery.read_mig_geometry`), never from a table of ours, so a new GPU or
driver brings its own profiles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any
from dataclasses import dataclass

from gpudra_core.devicemodel import (
    AttrValue,
    CounterConsumption,
    CounterSet,
    Device,
    mig_placement_name,
)

MIB = 1024 * 1024
COMPUTE_SLICES = "compute-slices"
# counter name -> MigProfile field, for the engines
ENGINE_COUNTERS: Mapping[str, str] = {
    "copy-engines": "copy_engines",
    "decoders": "decoders",
    "encoders": "encoders",
    "jpeg-engines": "jpeg_engines",
    "ofa-engines": "ofa_engines",
}
# What a placement inherits from its GPU: what selectors written for the GPU's product also match.
INHERITED_ATTRIBUTES = ("productName", "brand", "architecture", "cudaComputeCapability", "driverVersion",
                        "cudaDriverVersion", "resource.kubernetes.io/pciBusID", "numaNode",
                        "resource.kubernetes.io/numaNode", "resource.kubernetes.io/pcieRoot")


MEMORY_SLICE_PREFIX = "memory-slice-"


def memory_slice_counter(index: int) -> str:
    return f"{MEMORY_SLICE_PREFIX}{index}"


@dataclass(frozen=True)
class MigProfile:
    """One GPU instance profile as NVML reports it (``nvmlGpuInstanceProfileInfo_v2_t`` and its
    possible placements)."""

    name: str  # "1g.10gb", "1g.10gb+me"
    profile_id: int  # what nvmlDeviceCreateGpuInstanceWithPlacement takes
    compute_slices: int
    memory_mib: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int
    placement_size: int  # memory slices per placement
    starts: tuple[int, ...]  # first memory slice of each possible placement

    def __post_init__(self) -> None:
        if self.compute_slices < 1 or self.placement_size < 1:
            raise ValueError(f"MIG profile {self.name}: compute slices and placement size must be positive")
        if any(s < 0 for s in self.starts) or len(set(self.starts)) != len(self.starts):
            raise ValueError(f"MIG profile {self.name}: placement starts must be distinct and non-negative")


@dataclass(frozen=True)
class MigGeometry:
    """A GPU's MIG profiles and what they can occupy. The totals are those of the GPU: its memory
    slices are every slice a placement can reach, its compute slices and engines what its largest
    profile (the whole GPU as one instance) gets."""

    profiles: tuple[MigProfile, ...]

    def __post_init__(self) -> None:
        if not self.profiles:
            raise ValueError("a MIG geometry needs at least one profile")
        names = [p.name for p in self.profiles]
        if len(set(names)) != len(names):
            raise ValueError(f"MIG profiles named twice: {sorted({n for n in names if names.count(n) > 1})}")

    @property
    def memory_slices(self) -> int:
        return max(start + p.placement_size for p in self.profiles for start in p.starts)

    @property
    def compute_slices(self) -> int:
        return max(p.compute_slices for p in self.profiles)

    def engine_total(self, field_name: str) -> int:
        return max(int(getattr(p, field_name)) for p in self.profiles)


def counter_set_name(gpu: Device) -> str:
    return f"{gpu.name}-counters"


def gpu_counters(geometry: MigGeometry) -> dict[str, int]:
    """Every counter of one GPU, at its total."""
    counters = {COMPUTE_SLICES: geometry.compute_slices}
    counters |= {memory_slice_counter(k): 1 for k in range(geometry.memory_slices)}
    for counter, field_name in ENGINE_COUNTERS.items():
        if total := geometry.engine_total(field_name):
            counters[counter] = total
    return counters


def placement_counters(geometry: MigGeometry, profile: MigProfile, start: int) -> dict[str, int]:
    """What one placement takes: its compute slices, its memory slices, its engines (zeros left out)."""
    counters = {COMPUTE_SLICES: profile.compute_slices}
    counters |= {memory_slice_counter(k): 1 for k in range(start, start + profile.placement_size)}
    for counter, field_name in ENGINE_COUNTERS.items():
        if geometry.engine_total(field_name) and (amount := int(getattr(profile, field_name))):
            counters[counter] = amount
    return counters


# NVML's nvmlDeviceArchitecture_t: Hopper (9) and later switch MIG mode without a GPU reset once
# the GPU is idle; on Ampere the change stays pending until a reset. NVIDIA's DRA driver offers the
# whole GPU of a MIG-enabled GPU on the same condition (supportsMIGModeToggle in its nvlib.go).
NVML_ARCH_HOPPER = 9


def toggles_mig_mode_live(architecture: int | None) -> bool:
    """Whether a GPU of this NVML architecture switches MIG mode without a reset, so that its
    whole GPU can be prepared by turning MIG mode off (None: unknown, so no)."""
    return architecture is not None and architecture >= NVML_ARCH_HOPPER


def partition_gpu(gpu: Device, geometry: MigGeometry, *, whole: bool = False) -> list[Device]:
    """The GPU ``gpu`` (a ``type: gpu`` device from discovery) as dynamic MIG: with ``whole``, the
    GPU itself first, taking every counter; then one ``type: mig`` device per profile and
    placement, in NVML's profile order. The first device carries the GPU's counter set
    (``provides_counters``: published once, in the pool's counter slice). A placement has the
    GPU's product attributes, its profile, its parent, and its own memory, engines and compute
    slices as capacities; no UUID or instance IDs, which exist only once prepare creates the
    instance."""
    counter_set = CounterSet(counter_set_name(gpu), gpu_counters(geometry))
    parent_index = int(gpu.attributes["index"].value)
    inherited = {k: v for k, v in gpu.attributes.items() if k in INHERITED_ATTRIBUTES}
    parent = {"parentUUID": gpu.attributes["uuid"], "parentIndex": gpu.attributes["index"],
              "parentMinor": gpu.attributes["minor"]}
    devices: list[Device] = []
    if whole:
        devices.append(dataclasses.replace(gpu, consumes_counters=(
            CounterConsumption(counter_set.name, dict(counter_set.counters)),)))
    for profile in geometry.profiles:
        for start in profile.starts:
            devices.append(Device(
                name=mig_placement_name(parent_index, profile.name, start),
                attributes={"type": AttrValue.of_string("mig"), **inherited,
                            "profile": AttrValue.of_string(profile.name), **parent},
                capacity={"memory": profile.memory_mib * MIB, "multiprocessors": profile.multiprocessors,
                          "copyEngines": profile.copy_engines, "decoders": profile.decoders,
                          "encoders": profile.encoders, "jpegEngines": profile.jpeg_engines,
                          "ofaEngines": profile.ofa_engines, "computeSlices": profile.compute_slices},
                consumes_counters=(CounterConsumption(counter_set.name,
                                                      placement_counters(geometry, profile, start)),),
            ))
    if devices:
        devices[0] = dataclasses.replace(devices[0], provides_counters=counter_set)
    return devices


def is_dynamic_whole_gpu(device: Device) -> bool:
    """The whole GPU of a dynamic MIG GPU (it takes its GPU's counters)."""
    return device.type == "gpu" and bool(device.consumes_counters)


def geometry_to_json(geometry: MigGeometry) -> list[dict[str, Any]]:
    """The geometry as JSON: what a whole-GPU claim's checkpoint record keeps, so that the GPU is
    published the same while its MIG mode is off (when NVML may not report its profiles)."""
    return [{**dataclasses.asdict(p), "starts": list(p.starts)} for p in geometry.profiles]


def geometry_from_json(data: Any) -> MigGeometry:
    """:func:`geometry_to_json`'s inverse; ValueError for anything else."""
    if not isinstance(data, list):
        raise ValueError(f"MIG geometry: {data!r} is not a list of profiles")
    fields = [f.name for f in dataclasses.fields(MigProfile)]
    profiles = []
    for raw in data:
        if not isinstance(raw, dict) or sorted(raw) != sorted(fields) or not isinstance(raw["name"], str) \
                or not isinstance(raw["starts"], list) \
                or not all(type(raw[f]) is int for f in fields if f not in ("name", "starts")) \
                or not all(type(s) is int for s in raw["starts"]):
            raise ValueError(f"MIG geometry: {raw!r} is not a MIG profile")
        profiles.append(MigProfile(**{**raw, "starts": tuple(raw["starts"])}))
    return MigGeometry(tuple(profiles))


def placement_of(device: Device) -> tuple[str, int] | None:
    """(profile, start) of a dynamic MIG placement device; None for any other device."""
    if device.type != "mig" or not device.consumes_counters:
        return None
    start = device.name.rpartition("-at")[2]
    return (str(device.attr("profile")), int(start)) if start.isdigit() else None


# -- does the API server keep counters? ---------------------------------------------------------

FEATURE_GATE = "DRAPartitionableDevices"


def probe_slice(driver: str, node: str) -> dict[str, Any]:
    """A ResourceSlice of ``node`` with one counter set, for a server-side dry run."""
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"generateName": "gpudra-partitionable-probe-"},
        "spec": {"driver": driver, "nodeName": node,
                 "pool": {"name": node, "generation": 0, "resourceSliceCount": 1},
                 "sharedCounters": [{"name": "probe", "counters": {COMPUTE_SLICES: {"value": "1"}}}]},
    }


def keeps_counters(stored: dict[str, Any]) -> bool:
    """Whether the API server stored the probe slice with its counter set (pure)."""
    return bool((stored.get("spec") or {}).get("sharedCounters"))


async def api_server_keeps_counters(kube: Any, driver: str, node: str) -> tuple[bool, str]:
    """Whether the API server keeps counter sets in this node's slices, by a server-side dry-run
    create of one (nothing is stored), and why not.

    A server whose DRAPartitionableDevices gate is off (Kubernetes 1.35's default) drops
    ``sharedCounters`` and ``consumesCounters`` without an error. Placements published there would
    be plain devices the scheduler could hand out overlapping, so the agent publishes static MIG
    instead. Errors other than a refusal (the API server unreachable) are raised: the caller retries."""
    from gpudra_core.kubeapi import dry_run_create

    stored, refused = await dry_run_create(kube, probe_slice(driver, node))
    if stored is None:
        return False, f"a dry-run ResourceSlice with sharedCounters was refused: {refused}"
    if keeps_counters(stored):
        return True, ""
    return False, (f"the API server drops sharedCounters and consumesCounters from ResourceSlices: its "
                   f"{FEATURE_GATE} feature gate is off (alpha and off by default in Kubernetes 1.35, beta and "
                   "on from 1.36)")
