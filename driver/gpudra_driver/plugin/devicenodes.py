"""Which device nodes make a device usable inside a container (pure).

* every GPU container: the control nodes (``nvidiactl``, ``nvidia-uvm``...), which
  :mod:`gpudra_driver.plugin.driverfiles` adds where the node has them;
* a full GPU: ``/dev/nvidia<minor>``;
* a MIG device: its parent's ``/dev/nvidia<parentMinor>`` plus the two MIG capability nodes that
  grant access to its GPU instance and compute instance,
  ``/dev/nvidia-caps/nvidia-cap<minor>``.

The capability minors are assigned by the kernel driver and published in
``/proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<gi>/access`` and ``.../gi<gi>/ci<ci>/access``
(a line ``DeviceFileMinor: <n>``). :func:`read_mig_cap_minor` reads them; where they cannot be read
(simulated NVML, no GPUs) :func:`mig_cap_minor_fallback` computes the driver's fixed layout, the one
``/proc/driver/nvidia-caps/mig-minors`` lists: ``config`` 1, ``monitor`` 2, then per GPU minor 15
GPU instances of 9 minors each (the GI's ``access``, then its compute instances 0-7).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpudra_core.devicemodel import AttrValue, Device
from gpudra_core.migpartitions import MEMORY_SLICE_PREFIX, is_dynamic_whole_gpu, placement_of
from gpudra_driver.plugin.model import MigPlacement

CAPS_DIR = "/dev/nvidia-caps"
PLACEMENT = "mig-placement"  # NodeDevice.kind of a dynamic MIG placement
DYNAMIC_WHOLE_GPU = "gpu-dynamic-mig"  # NodeDevice.kind of a dynamic MIG GPU as a whole (MIG mode off at prepare)

# (parent GPU minor, GPU instance ID, compute instance ID or None for the GI itself) -> cap minor
CapMinor = Callable[[int, int, "int | None"], int]

_GIS_PER_GPU = 15
_MINORS_PER_GI = 9  # the GI's access node + 8 compute instances


@dataclass(frozen=True)
class NodeDevice:
    """What prepare needs to know about one discovered device."""

    name: str
    uuid: str
    device_nodes: tuple[str, ...]  # container paths, device-specific (not the control nodes)
    kind: str = "gpu"  # the device model's type: gpu or mig
    memory: int = 0  # bytes of framebuffer; 0 when unknown
    compute_capability: str = ""  # "9.0.0" (the cudaComputeCapability attribute); "" when unknown
    placement: MigPlacement | None = None  # kind PLACEMENT: where prepare creates its instance
    # its published attributes and capacities (as ints): its device metadata (:mod:`.devicemetadata`)
    attributes: tuple[tuple[str, AttrValue], ...] = ()


def mig_cap_minor_fallback(gpu_minor: int, gi: int, ci: int | None) -> int:
    if not (0 <= gi < _GIS_PER_GPU) or (ci is not None and not 0 <= ci < _MINORS_PER_GI - 1):
        raise ValueError(f"MIG instance gi{gi}/ci{ci} is outside the driver's capability layout")
    base = 3 + gpu_minor * _GIS_PER_GPU * _MINORS_PER_GI + gi * _MINORS_PER_GI
    return base if ci is None else base + 1 + ci


_MINOR_LINE = re.compile(r"^DeviceFileMinor:\s*(\d+)\s*$", re.MULTILINE)


def read_mig_cap_minor(proc_root: Path) -> CapMinor:
    """A resolver reading the kernel driver's capability files under ``proc_root`` (normally
    ``/proc``), falling back to the fixed layout where they are absent."""

    def resolve(gpu_minor: int, gi: int, ci: int | None) -> int:
        path = proc_root / "driver/nvidia/capabilities" / f"gpu{gpu_minor}" / "mig" / f"gi{gi}"
        if ci is not None:
            path = path / f"ci{ci}"
        try:
            match = _MINOR_LINE.search((path / "access").read_text())
        except OSError:
            match = None
        return int(match.group(1)) if match else mig_cap_minor_fallback(gpu_minor, gi, ci)

    return resolve


def device_nodes(device: Device, cap_minor: CapMinor = mig_cap_minor_fallback) -> tuple[str, ...]:
    """The device-specific nodes of ``device`` (container paths)."""
    if device.type == "gpu":
        return (f"/dev/nvidia{_int(device, 'minor')}",)
    parent = _int(device, "parentMinor")
    gi, ci = _int(device, "gpuInstanceId"), _int(device, "computeInstanceId")
    return (f"/dev/nvidia{parent}",
            f"{CAPS_DIR}/nvidia-cap{cap_minor(parent, gi, None)}",
            f"{CAPS_DIR}/nvidia-cap{cap_minor(parent, gi, ci)}")


def node_devices(devices: list[Device], cap_minor: CapMinor = mig_cap_minor_fallback) -> dict[str, NodeDevice]:
    """Discovered devices by name, in the form prepare plans with. A dynamic MIG placement
    (:func:`gpudra_core.migpartitions.placement_of`) has no instance, so no UUID or nodes, until
    prepare creates it: it is kind ``PLACEMENT``."""
    return {d.name: NodeDevice(d.name, "", (), PLACEMENT, d.capacity.get("memory", 0),
                               str(d.attr("cudaComputeCapability") or ""), _placement(d), _attributes(d))
            if placement_of(d) is not None else
            NodeDevice(d.name, str(d.attr("uuid")), device_nodes(d, cap_minor),
                       DYNAMIC_WHOLE_GPU if is_dynamic_whole_gpu(d) else d.type,
                       d.capacity.get("memory", 0), str(d.attr("cudaComputeCapability") or ""),
                       attributes=_attributes(d))
            for d in devices}


def _attributes(device: Device) -> tuple[tuple[str, AttrValue], ...]:
    """Sorted by name, as the checkpoint stores them (canonical JSON): a record read back is equal."""
    return tuple(sorted((*device.attributes.items(), *((n, AttrValue.of_int(v)) for n, v in device.capacity.items())),
                        key=lambda item: item[0]))


def _placement(device: Device) -> MigPlacement:
    """Where a dynamic MIG device's instance goes: its parent, profile and the memory slices it
    consumes (``memory-slice-<k>`` counters, contiguous by construction)."""
    slices = sorted(int(name.rpartition("-")[2]) for c in device.consumes_counters for name in c.counters
                    if name.startswith(MEMORY_SLICE_PREFIX))
    if not slices or slices != list(range(slices[0], slices[0] + len(slices))):
        raise ValueError(f"device {device.name}: its memory slices {slices} are not one placement")
    return MigPlacement(str(device.attr("parentUUID")), str(device.attr("profile")), slices[0], len(slices),
                        _int(device, "parentMinor"))


def _int(device: Device, name: str) -> int:
    value = device.attr(name)
    if type(value) is not int:
        raise ValueError(f"device {device.name}: attribute {name!r} is missing")
    return value
