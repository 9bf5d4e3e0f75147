"""GPU discovery: NVML in, the device model out.

``scan(nvml)`` depends only on the NVML object it is given (pynvml or the simulator), so it is a
pure function of that object's answers. It owns the NVML session (init ... shutdown).

Failure policy: NVML that cannot start or cannot enumerate raises :class:`NvmlUnavailable` with a
message that says what to check. A GPU (or one MIG device) that fails mid-scan is skipped and
reported in ``warnings``; the others are still returned, because one bad GPU must not take the
node's healthy ones off the market.

MIG: see :mod:`gpudra_core.devicemodel`; a GPU whose current MIG mode is enabled is published only
through its MIG devices (``mig="static"``, the default). With ``mig="dynamic"`` a MIG-enabled GPU
that has no MIG devices is published as every placement it could have, plus itself where MIG mode
switches without a reset (Hopper and later), over counters (:mod:`gpudra_core.migpartitions`),
from the profiles and placements NVML reports for it; and the same while a claim of the whole GPU
holds its MIG mode off (``mig_mode_off``).
"""

from __future__ import annotations

import logging
import math
import os
import re
from types import ModuleType
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpudra_core.devicemodel import (
    STANDARD_DOMAIN,
    AttrValue,
    Device,
    cuda_version_from_int,
    gpu_device_name,
    mig_device_name,
    normalize_pci_bus_id,
    normalize_version,
)
from gpudra_core.migpartitions import MigGeometry, MigProfile, partition_gpu, toggles_mig_mode_live
from gpudra_core.migpolicy import MIG_MODES, MigMode
from gpudra_driver.nvml import NvmlUnavailable
from gpudra_driver.deviceapi import fit_devices

__all__ = ["MIG_MODES", "Discovery", "MigMode", "NvmlUnavailable", "discover", "mig_profile_name",
           "numa_node_from_sysfs", "nvidia_gpus_on_pci", "pcie_root_from_sysfs", "read_mig_geometry", "scan"]


log = logging.getLogger(__name__)

_MIB = 1024 * 1024
_GIB = 1024 * _MIB
PCI_BUS_ID = f"{STANDARD_DOMAIN}/pciBusID"
STANDARD_NUMA_NODE = f"{STANDARD_DOMAIN}/numaNode"
PCIE_ROOT = f"{STANDARD_DOMAIN}/pcieRoot"

# NVML enums -> the strings NVIDIA's own tooling publishes (go-nvlib GetBrandAsString /
# GetArchitectureAsString), so CEL written for gpu.nvidia.com reads the same here.
BRANDS = {
    0: "Unknown", 1: "Quadro", 2: "Tesla", 3: "NVS", 4: "Grid", 5: "GeForce", 6: "Titan",
    7: "NvidiaVApps", 8: "NvidiaVPC", 9: "NvidiaVCS", 10: "NvidiaVWS", 11: "NvidiaCloudGaming",
    12: "QuadroRTX", 13: "NvidiaRTX", 14: "Nvidia", 15: "GeForceRTX", 16: "TitanRTX",
}
ARCHITECTURES = {
    2: "Kepler", 3: "Maxwell", 4: "Pascal", 5: "Volta", 6: "Turing", 7: "Ampere",
    8: "Ada Lovelace", 9: "Hopper", 10: "Blackwell",
}

# What to tell an operator for each way nvmlInit fails (pynvml NVMLError_<name>).
_INIT_HINTS = {
    "NVMLError_LibraryNotFound": "libnvidia-ml.so.1 was not found: install the NVIDIA driver on the "
    "node and point --driver-root (spec.agent.driverRoot) at it",
    "NVMLError_DriverNotLoaded": "the NVIDIA kernel driver is not loaded: check `nvidia-smi` and "
    "`lsmod | grep nvidia` on the node",
    "NVMLError_NoPermission": "no permission to open /dev/nvidia*: run the agent with access to the "
    "GPU device nodes",
    "NVMLError_LibRmVersionMismatch": "the NVML library and the kernel driver have different "
    "versions: reload the driver or reboot the node after a driver upgrade, or point driverRoot at "
    "the running driver's files",
}
_SIMULATE_HINT = "to run without GPUs, use --nvml fake:<profile> or GPUDRA_NVML=fake:<profile>"


@dataclass(frozen=True)
class Discovery:
    devices: list[Device]
    warnings: list[str] = field(default_factory=list)
    # The GPUs that do not match their MIG mode, and what to do (also in ``warnings``): the agent
    # reports them in a MigNotReady Node event, which the config's Degraded condition reads.
    mig_not_ready: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _System:
    driver_version: str
    cuda_driver_version: str


class _CallFailed(Exception):
    """An NVML call failed; carries which call, for a warning a human can act on."""

    def __init__(self, call: str, error: Exception) -> None:
        super().__init__(f"{call} failed: {error}")
        self.error = error


def add_mig_argument(parser: Any) -> None:
    """``--mig whole|static|dynamic``, for the agent and ``gpudra discover``."""
    parser.add_argument("--mig", choices=MIG_MODES, default="static",
                        help="MIG-capable GPUs: 'static' publishes the MIG devices that exist; 'dynamic' publishes "
                             "every MIG placement a GPU without MIG devices could have, over counters the "
                             "scheduler allocates (Kubernetes 1.36+); 'whole' publishes GPUs whole only, and "
                             "nothing of a MIG-enabled one (docs/mig.md) (default: %(default)s)")


def discover(nvml: Any, *, numa_node_of: Callable[[str], int | None] | None = None,
             mig: MigMode = "static", pcie_root_of: Callable[[str], str | None] | None = None) -> list[Device]:
    """The devices to publish; warnings are logged. See :func:`scan`."""
    result = scan(nvml, numa_node_of=numa_node_of, mig=mig, pcie_root_of=pcie_root_of)
    for warning in result.warnings:
        log.warning("%s", warning)
    return result.devices


def scan(nvml: Any, *, numa_node_of: Callable[[str], int | None] | None = None,
         mig: MigMode = "static", owned: Collection[tuple[str, int]] = (),
         mig_mode_off: Mapping[str, MigGeometry | None] | None = None,
         pcie_root_of: Callable[[str], str | None] | None = None) -> Discovery:
    """Enumerate GPUs and MIG devices. ``numa_node_of(pci_bus_id)`` is the fallback when NVML has no
    NUMA answer (e.g. :func:`numa_node_from_sysfs`); without it such devices carry no numaNode.
    ``pcie_root_of(pci_bus_id)`` gives the PCIe root complex (:func:`pcie_root_from_sysfs`; NVML
    has no such query); without it, or where it has no answer, devices carry no pcieRoot.
    ``mig``: how a MIG-enabled GPU is published (see the module's docstring); ``owned``: the
    (parent GPU UUID, GPU instance ID) of the dynamic MIG instances the agent created for claims,
    which leave their GPU dynamic (others make it static); ``mig_mode_off``: GPU UUID -> the MIG
    geometry recorded (None: not yet) of each dynamic GPU whose MIG mode a claim of the whole GPU
    turned off, published as before from that geometry (else NVML's), so the slice does not change
    under the claim."""
    if mig not in MIG_MODES:
        raise ValueError(f"mig must be one of {MIG_MODES}, not {mig!r}")
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        hint = _INIT_HINTS.get(type(exc).__name__, f"nvmlInit failed: {exc}")
        if type(exc).__name__ == "NVMLError_LibRmVersionMismatch" and isinstance(nvml, ModuleType):  # real pynvml
            from gpudra_driver.nvml.loader import version_mismatch_detail

            hint += f" ({version_mismatch_detail()})"
        raise NvmlUnavailable(f"NVML unavailable: {hint}; {_SIMULATE_HINT}") from exc
    try:
        try:
            system = _System(
                driver_version=normalize_version(_text(nvml.nvmlSystemGetDriverVersion())),
                cuda_driver_version=cuda_version_from_int(_cuda_driver_version(nvml)),
            )
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML started but cannot enumerate GPUs: {exc}") from exc
        devices: list[Device] = []
        warnings: list[str] = []
        not_ready: list[str] = []
        for index in range(count):
            try:
                devices += _scan_gpu(nvml, index, system, numa_node_of, warnings, mig, owned, not_ready,
                                     mig_mode_off or {}, pcie_root_of)
            except (_CallFailed, ValueError) as exc:
                warnings.append(f"GPU {index} skipped: {exc}")
        # A value past an API limit (a 96-character product name) changes that device only; the
        # node's other devices publish (a LimitError in build_slices would hold up the whole pool).
        devices, fixes = fit_devices(devices)
        return Discovery(devices, warnings + fixes, not_ready)
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError as exc:  # nothing left to protect; do not mask the result
            log.debug("nvmlShutdown failed: %s", exc)


def _scan_gpu(
    nvml: Any,
    index: int,
    system: _System,
    numa_node_of: Callable[[str], int | None] | None,
    warnings: list[str],
    mig: MigMode = "static",
    owned: Collection[tuple[str, int]] = (),
    not_ready: list[str] | None = None,
    mig_mode_off: Mapping[str, MigGeometry | None] | None = None,
    pcie_root_of: Callable[[str], str | None] | None = None,
) -> list[Device]:
    def unready(message: str) -> None:  # a GPU that does not match its MIG mode
        warnings.append(message)
        if not_ready is not None:
            not_ready.append(message)

    call = _caller(nvml)
    handle = call("nvmlDeviceGetHandleByIndex", index)
    major, minor_cc = call("nvmlDeviceGetCudaComputeCapability", handle)
    bus_id = _optional(nvml, lambda: normalize_pci_bus_id(_text(call("nvmlDeviceGetPciInfo", handle).busId)))
    numa = _numa_node(nvml, handle, bus_id, numa_node_of)
    common: dict[str, AttrValue] = {
        "productName": AttrValue.of_string(_text(call("nvmlDeviceGetName", handle))),
        "brand": AttrValue.of_string(BRANDS.get(call("nvmlDeviceGetBrand", handle), "Unknown")),
        "architecture": AttrValue.of_string(
            _optional(nvml, lambda: ARCHITECTURES.get(call("nvmlDeviceGetArchitecture", handle))) or "Unknown"
        ),
        "cudaComputeCapability": AttrValue.of_version(normalize_version(f"{major}.{minor_cc}")),
        "driverVersion": AttrValue.of_version(system.driver_version),
        "cudaDriverVersion": AttrValue.of_version(system.cuda_driver_version),
    }
    if bus_id is not None:
        common[PCI_BUS_ID] = AttrValue.of_string(bus_id)
    if numa is not None:  # the driver's own name, for existing claims, and the standard one (KEP-6072)
        common["numaNode"] = AttrValue.of_int(numa)
        common[STANDARD_NUMA_NODE] = AttrValue.of_int(numa)
    pcie_root = pcie_root_of(bus_id) if pcie_root_of is not None and bus_id is not None else None
    if pcie_root is not None:
        common[PCIE_ROOT] = AttrValue.of_string(pcie_root)
    uuid = _text(call("nvmlDeviceGetUUID", handle))
    minor = call("nvmlDeviceGetMinorNumber", handle)
    memory = call("nvmlDeviceGetMemoryInfo", handle).total

    mig_mode = _optional(nvml, lambda: call("nvmlDeviceGetMigMode", handle))  # None: no MIG support
    if mig_mode is not None and mig_mode[0] != mig_mode[1]:
        unready(
            f"GPU {index} ({uuid}) has a MIG mode change pending; publishing by the current mode "
            "until the GPU is reset"
        )
    whole = Device(
        name=gpu_device_name(index),
        attributes={
            "type": AttrValue.of_string("gpu"),
            "uuid": AttrValue.of_string(uuid),
            **common,
            "index": AttrValue.of_int(index),
            "minor": AttrValue.of_int(minor),
        },
        capacity={"memory": memory},
    )
    arch = next((k for k, v in ARCHITECTURES.items() if v == common["architecture"].value), None)
    if mig_mode is not None and mig_mode[0] != nvml.NVML_DEVICE_MIG_ENABLE and uuid in (mig_mode_off or {}):
        # a claim of the whole GPU turned its MIG mode off: the same devices and counters as before
        try:
            geometry = (mig_mode_off or {})[uuid] or read_mig_geometry(nvml, handle)
        except (_CallFailed, ValueError) as exc:
            unready(f"GPU {index} ({uuid}): its MIG mode is off for a claim of the whole GPU and its MIG profiles "
                    f"cannot be read ({exc}); it publishes nothing until they can")
            return []
        return partition_gpu(whole, geometry, whole=True)
    if mig_mode is None or mig_mode[0] != nvml.NVML_DEVICE_MIG_ENABLE:
        if mig == "dynamic" and mig_mode is not None:
            unready(
                f"GPU {index} ({uuid}) is MIG-capable but its MIG mode is disabled: published as a whole GPU, "
                f"without dynamic MIG placements; enable MIG mode while no workload uses it "
                f"(`nvidia-smi -i {index} -mig 1`, then a GPU reset where the GPU needs one)"
            )
        return [whole]

    migs: list[Device] = []
    for slot in range(call("nvmlDeviceGetMaxMigDeviceCount", handle)):
        try:
            mig_handle = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except (nvml.NVMLError_NotFound, nvml.NVMLError_InvalidArgument):
            continue  # empty slot, as go-nvlib's VisitMigDevices treats it
        except nvml.NVMLError as exc:
            warnings.append(f"MIG slot {slot} on GPU {index} skipped: nvmlDeviceGetMigDeviceHandleByIndex failed: {exc}")
            continue
        try:
            migs.append(_mig_device(call, mig_handle, slot, index, uuid, minor, memory, common))
        except (_CallFailed, ValueError) as exc:
            warnings.append(f"MIG device {slot} on GPU {index} skipped: {exc}")
    ours = [m for m in migs if (uuid, m.attr("gpuInstanceId")) in owned]
    if ours and mig != "dynamic":
        # The mode changed (the config, or the node's group) while claims hold instances the agent
        # made: the GPU keeps the placements those claims were allocated until they are gone.
        warnings.append(
            f"GPU {index} ({uuid}) stays dynamic MIG, not {mig}, until its {len(ours)} prepared claim(s) "
            "are unprepared"
        )
        mig = "dynamic"
    if mig == "dynamic":
        foreign = [m for m in migs if (uuid, m.attr("gpuInstanceId")) not in owned]
        if foreign:  # instances someone else made: never changed, and nothing may overlap them
            unready(
                f"GPU {index} ({uuid}) has {len(foreign)} MIG device(s) gpudra did not create: published as they "
                "are (static MIG), without dynamic placements, until they are destroyed"
            )
            return foreign
        try:
            # the whole GPU too where MIG mode can be turned off for it without a reset
            return partition_gpu(whole, read_mig_geometry(nvml, handle), whole=toggles_mig_mode_live(arch))
        except (_CallFailed, ValueError) as exc:
            unready(f"GPU {index} ({uuid}): its MIG profiles cannot be read ({exc}); "
                    "it publishes nothing until they can")
            return []
    if mig == "whole":
        unready(
            f"GPU {index} ({uuid}) has MIG mode enabled, so it cannot be used whole: it publishes nothing "
            f"under MIG mode 'whole'; disable MIG mode while no workload uses it (`nvidia-smi -i {index} -mig 0`, "
            "then a GPU reset where the GPU needs one), or give its node a MIG mode that uses MIG"
        )
        return []
    if not migs:
        unready(
            f"GPU {index} ({uuid}) has MIG mode enabled but no MIG devices: it publishes nothing "
            "until MIG devices are created or MIG mode is disabled"
        )
    return migs


def read_mig_geometry(nvml: Any, handle: Any) -> MigGeometry:
    """Every GPU instance profile NVML reports for the GPU and each one's possible placements
    (``nvmlDeviceGetGpuInstanceProfileInfoV``, ``nvmlDeviceGetGpuInstancePossiblePlacements_v2``),
    in NVML's profile order. A profile index the GPU lacks answers NOT_SUPPORTED (or, past the
    driver's last profile, INVALID_ARGUMENT) and is skipped."""
    import ctypes

    call = _caller(nvml)
    profiles: list[MigProfile] = []
    for index in range(int(getattr(nvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", 18))):
        try:
            info = call("nvmlDeviceGetGpuInstanceProfileInfo", handle, index)
        except _CallFailed as exc:
            if isinstance(exc.error, (nvml.NVMLError_NotSupported, nvml.NVMLError_InvalidArgument)):
                continue
            raise
        count = ctypes.c_uint(0)
        call("nvmlDeviceGetGpuInstancePossiblePlacements", handle, info.id, None, ctypes.byref(count))
        placements = (nvml.c_nvmlGpuInstancePlacement_t * count.value)()
        call("nvmlDeviceGetGpuInstancePossiblePlacements", handle, info.id, placements, ctypes.byref(count))
        found = placements[: count.value]
        sizes = {p.size for p in found}
        if len(sizes) > 1:
            raise ValueError(f"MIG profile {info.id}: placements of different sizes {sorted(sizes)}")
        name = _text(info.name).removeprefix("MIG ").strip()
        if not name:
            raise ValueError(f"MIG profile {info.id} has no name")
        profiles.append(MigProfile(
            name=name, profile_id=int(info.id), compute_slices=int(info.sliceCount),
            memory_mib=int(info.memorySizeMB), multiprocessors=int(info.multiprocessorCount),
            copy_engines=int(info.copyEngineCount), decoders=int(info.decoderCount),
            encoders=int(info.encoderCount), jpeg_engines=int(info.jpegCount), ofa_engines=int(info.ofaCount),
            placement_size=sizes.pop() if sizes else 1, starts=tuple(int(p.start) for p in found)))
    return MigGeometry(tuple(p for p in profiles if p.starts))


def _mig_device(
    call: Callable[..., Any],
    handle: Any,
    slot: int,
    parent_index: int,
    parent_uuid: str,
    parent_minor: int,
    parent_memory: int,
    common: dict[str, AttrValue],
) -> Device:
    attrs = call("nvmlDeviceGetAttributes", handle)
    gi = call("nvmlDeviceGetGpuInstanceId", handle)
    ci = call("nvmlDeviceGetComputeInstanceId", handle)
    profile = mig_profile_name(
        attrs.gpuInstanceSliceCount, attrs.computeInstanceSliceCount, attrs.memorySizeMB, parent_memory
    )
    return Device(
        name=mig_device_name(parent_index, profile, gi, ci),
        attributes={
            "type": AttrValue.of_string("mig"),
            "uuid": AttrValue.of_string(_text(call("nvmlDeviceGetUUID", handle))),
            **common,
            "index": AttrValue.of_int(slot),
            "profile": AttrValue.of_string(profile),
            "parentUUID": AttrValue.of_string(parent_uuid),
            "parentIndex": AttrValue.of_int(parent_index),
            "parentMinor": AttrValue.of_int(parent_minor),
            "gpuInstanceId": AttrValue.of_int(gi),
            "computeInstanceId": AttrValue.of_int(ci),
        },
        capacity={
            # memorySizeMB is MiB; NVIDIA's driver publishes the same product.
            "memory": attrs.memorySizeMB * _MIB,
            "multiprocessors": attrs.multiprocessorCount,
            "copyEngines": attrs.sharedCopyEngineCount,
            "decoders": attrs.sharedDecoderCount,
            "encoders": attrs.sharedEncoderCount,
            "jpegEngines": attrs.sharedJpegCount,
            "ofaEngines": attrs.sharedOfaCount,
        },
    )


def mig_profile_name(gi_slices: int, ci_slices: int, memory_mib: int, parent_memory_bytes: int) -> str:
    """NVIDIA's profile name from instance sizes: ``3g.40gb``, or ``1c.3g.40gb`` when the compute
    instance is smaller than its GPU instance. The memory part is the instance's share of the GPU
    rounded up to eighths, times the GPU's memory in whole GiB (the rule go-nvlib uses), so an
    A100-80GB instance of 9728 MiB is "10gb" and an H200 one of 16384 MiB is "18gb"."""
    fraction = math.ceil(memory_mib * _MIB / parent_memory_bytes * 8) / 8
    gb = round(fraction * math.ceil(parent_memory_bytes / _GIB))
    prefix = f"{ci_slices}c." if ci_slices < gi_slices else ""
    return f"{prefix}{gi_slices}g.{gb}gb"


NVIDIA_PCI_VENDOR = "0x10de"
_DISPLAY_CLASSES = ("0x0300", "0x0302")  # VGA-compatible and 3D controllers: the GPUs (not audio, bridges)


def nvidia_gpus_on_pci(sysfs: Path = Path("/sys")) -> list[str] | None:
    """PCI addresses of NVIDIA GPUs the kernel sees, whether or not a driver is loaded: what tells a
    CPU-only node (none) from a GPU node whose driver is missing or still loading. None when the
    PCI bus cannot be read: no evidence either way."""
    found = []
    try:
        devices = sorted((sysfs / "bus/pci/devices").iterdir())
    except OSError:
        return None
    for device in devices:
        try:
            vendor = (device / "vendor").read_text().strip()
            pci_class = (device / "class").read_text().strip()
        except OSError:
            continue
        if vendor == NVIDIA_PCI_VENDOR and pci_class.startswith(_DISPLAY_CLASSES):
            found.append(device.name)
    return found


def numa_node_from_sysfs(bus_id: str, sysfs: Path = Path("/sys")) -> int | None:
    """The kernel's NUMA node for a PCI device (``-1``, missing or unreadable: unknown)."""
    try:
        value = int((sysfs / "bus/pci/devices" / bus_id / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return value if value >= 0 else None


# The name of a PCI root complex's directory under /sys/devices: "pci<domain>:<bus>" in hex, the
# value of resource.kubernetes.io/pcieRoot (StandardDeviceAttributePCIeRoot in
# k8s.io/dynamic-resource-allocation/deviceattribute).
_PCIE_ROOT = re.compile(r"pci[0-9a-f]{4,}:[0-9a-f]{2}")


def pcie_root_from_sysfs(bus_id: str, sysfs: Path = Path("/sys")) -> str | None:
    """The PCIe root complex of a PCI device, ``pci0000:00``, or None when sysfs does not say.

    ``/sys/bus/pci/devices/<bus id>`` is a link into ``/sys/devices``, whose tree follows the
    hardware: ``../../../devices/pci0000:00/0000:00:01.0/0000:01:00.0``. The root complex is the
    first directory under ``devices``; the link must end at the device itself. The way
    deviceattribute's GetPCIeRootAttributeByPCIBusID derives it, read here without following links
    past the first (the target is joined and cleaned, not resolved)."""
    link = sysfs / "bus/pci/devices" / bus_id
    try:
        target = os.readlink(link)
    except OSError:  # missing, or a directory rather than a link (no tree to read)
        return None
    path = Path(os.path.normpath(link.parent / target))
    devices = Path(os.path.normpath(sysfs / "devices"))
    try:
        parts = path.relative_to(devices).parts
    except ValueError:
        return None
    if len(parts) < 2 or parts[-1] != bus_id or not _PCIE_ROOT.fullmatch(parts[0]):
        return None
    return parts[0]


# -- helpers ------------------------------------------------------------------------------------


def _caller(nvml: Any) -> Callable[..., Any]:
    def call(name: str, *args: Any) -> Any:
        try:
            return getattr(nvml, name)(*args)
        except nvml.NVMLError as exc:
            raise _CallFailed(name, exc) from exc

    return call


def _optional(nvml: Any, query: Callable[[], Any]) -> Any:
    """A query whose 'not supported' answer means 'unknown', not 'broken GPU'."""
    try:
        return query()
    except _CallFailed as exc:
        if isinstance(exc.error, (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound)):
            return None
        raise


def _numa_node(
    nvml: Any, handle: Any, bus_id: str | None, numa_node_of: Callable[[str], int | None] | None
) -> int | None:
    get = getattr(nvml, "nvmlDeviceGetNumaNodeId", None)  # absent in older nvidia-ml-py
    if get is not None:
        try:
            node = get(handle)
            if node >= 0:
                return int(node)
        except nvml.NVMLError:
            pass  # optional attribute: fall back rather than drop the GPU
    if numa_node_of is not None and bus_id is not None:
        return numa_node_of(bus_id)
    return None


def _cuda_driver_version(nvml: Any) -> int:
    get = getattr(nvml, "nvmlSystemGetCudaDriverVersion_v2", None) or nvml.nvmlSystemGetCudaDriverVersion
    return int(get())


def _text(value: str | bytes) -> str:
    # nvidia-ml-py decodes to str since 11.x; older releases return bytes.
    return value.decode() if isinstance(value, bytes) else value
