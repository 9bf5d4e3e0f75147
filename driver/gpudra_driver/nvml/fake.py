"""A simulated NVML that behaves like pynvml for every call discovery makes.

Same function names and argument lists, the same return shapes (pynvml's own ctypes structures
where pynvml returns one, ``str`` where pynvml decodes to ``str``) and pynvml's own exception
classes, so one ``except pynvml.NVMLError_NotSupported`` works against both. Error behaviour follows
the NVML API reference:

* every call before ``nvmlInit`` (or after the matching ``nvmlShutdown``) raises
  ``NVMLError_Uninitialized``; init/shutdown are reference counted like the real library;
* MIG queries on a GPU without MIG support raise ``NVMLError_NotSupported``;
  ``nvmlDeviceGetMaxMigDeviceCount`` returns 0 when MIG is unsupported or disabled;
* ``nvmlDeviceGetMigDeviceHandleByIndex``: ``NotFound`` for an empty slot and whenever MIG is
  disabled, ``InvalidArgument`` past the max count of a MIG-enabled GPU;
* MIG-instance queries (GPU/compute instance ID, parent handle) on a full-GPU handle raise
  ``NVMLError_InvalidArgument``; ``nvmlDeviceGetAttributes`` on a full GPU raises ``NotSupported``;
  per-GPU queries (minor, PCI, NUMA, MIG mode) on a MIG handle raise ``NotSupported``;
* GPU instance profiles (``nvmlDeviceGetGpuInstanceProfileInfo`` v1/v2, ``...ProfileInfoById``,
  ``nvmlDeviceGetGpuInstancePossiblePlacements``) answer from the GPU's MIG catalog (``migCatalog:
  <model>``, ``gpudra_driver/profiles/mig/<model>.yaml``: every profile NVML reports on that model),
  whatever the MIG mode and whatever MIG devices exist, as NVML does: ``NotSupported`` on a GPU without
  MIG support, on a MIG handle and for a profile index the model lacks, ``InvalidArgument`` for an
  index >= ``NVML_GPU_INSTANCE_PROFILE_COUNT`` and for a profile ID the model lacks; placements follow
  NVML's two-call protocol (``InsufficientSize`` with the needed count when the buffer is short). A
  MIG-capable GPU without a catalog derives a profile's info from its MIG devices (ID = the index) and
  has no placements (``NotSupported``), like the mock library;
* dynamic MIG: GPU and compute instances created and destroyed through NVML
  (``nvmlDeviceCreateGpuInstance[WithPlacement]``, ``nvmlGpuInstanceCreateComputeInstance``,
  ``nvmlComputeInstanceDestroy``, ``nvmlGpuInstanceDestroy``, ``nvmlDeviceGetGpuInstances`` / ``...ById``,
  ``nvmlGpuInstanceGetInfo``, ``nvmlGpuInstanceGetComputeInstanceProfileInfo``, ``...GetComputeInstances``
  / ``...ById``, ``nvmlComputeInstanceGetInfo``) with the mock library's rules, GPU instance IDs, MIG
  UUIDs (:func:`mig_uuid`) and errors (the "MIG GPU and compute instances" section of
  ``tests/mocknvml/mock_nvml.c`` has them, with what nvml.h says); each created compute instance is a
  MIG device like the profile's ``migDevices``. With a state directory they live in its
  ``state/<GPU uuid>/mig_instances``, the mock library's file (same format, same lock, replaced
  atomically), so the simulator, the mock library and other processes see the same instances;
  without one, in memory. Instance handles are pynvml's ``c_nvmlGpuInstance_t`` /
  ``c_nvmlComputeInstance_t`` (so arrays of them work) with made-up addresses; the info calls answer
  :class:`GpuInstanceInfo` / :class:`ComputeInstanceInfo` (``device`` is this simulator's handle);
* ``nvmlDevice{Get,Set}ComputeMode``: per GPU, in memory (per simulator), ``DEFAULT`` at first; Set
  takes ``DEFAULT``, ``PROHIBITED`` and ``EXCLUSIVE_PROCESS``, anything else (``EXCLUSIVE_THREAD``,
  whose support NVML removed, included) raises ``InvalidArgument``; both raise ``NotSupported`` on a
  MIG handle (the mode is the parent GPU's). The mock library (tests/mocknvml) answers the same,
  keeping the mode in its driver root so other processes see it.

The MIG-disabled and full-GPU answers were checked against NVML 580.159.04 on an H200.

Health, injected at run time like the mock library's (the same ``<state>/events`` lines, written
by ``gpudra_dev.localcluster.mockstate``; the format is in ``tests/mocknvml/mock_nvml.c``):
XID critical and double-bit ECC events through ``nvmlEventSetCreate`` / ``nvmlDeviceRegisterEvents``
/ ``nvmlEventSetWait_v2`` / ``nvmlEventSetFree``, a lost GPU (``GpuIsLost`` from lookups and from
every call on it), and ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`` through ``nvmlDeviceGetFieldValues``.
The state directory is the one given (:func:`gpudra_driver.nvml.load_nvml` passes
``$GPUDRA_MOCK_STATE_DIR``, else ``<driver root>/run/gpudra-mock``); without one nothing is injected.
The wait blocks on inotify on the state directory, like the mock library's (where inotify is
unavailable it looks at the file every 10 ms).

Profiles (YAML) describe the machine; see ``gpudra_driver/profiles/*.yaml`` and
:func:`load_profile`. A MIG-capable GPU names its model's MIG catalog with ``migCatalog: <model>``
(``gpudra_driver/profiles/mig/<model>.yaml``, :func:`parse_mig_catalog` has its schema). Fault
injection per GPU or MIG device: ``fail: true`` makes ``nvmlDeviceGetUUID`` raise
``NVMLError_Unknown``; ``fail: {nvmlDeviceGetMemoryInfo: GpuIsLost}`` makes the named call raise
``NVMLError_<name>``. A profile-level ``initError: DriverNotLoaded``
makes ``nvmlInit`` fail.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import math
import os
import re
import select
import threading
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterator, NoReturn

import pynvml
import yaml

_MIB = 1024 * 1024
_SETTABLE_COMPUTE_MODES = frozenset({
    pynvml.NVML_COMPUTEMODE_DEFAULT, pynvml.NVML_COMPUTEMODE_PROHIBITED, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
})


# -- profile ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MigSpec:
    uuid: str
    profile: str  # as NVML names it in the device name, e.g. "3g.40gb"
    gpu_instance_id: int
    compute_instance_id: int
    attributes: dict[str, int]  # the fields of pynvml.c_nvmlDeviceAttributes
    fail: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class MigProfileSpec:
    """One GPU instance profile as NVML reports it (``nvidia-smi mig -lgip`` / ``-lgipp``)."""

    name: str  # "1g.10gb", "1g.10gb+me"; NVML's profile name is "MIG " + this
    index: int  # the NVML_GPU_INSTANCE_PROFILE_* constant nvmlDeviceGetGpuInstanceProfileInfo takes
    id: int  # nvmlGpuInstanceProfileInfo_t.id, what -lgip prints and the placement calls take
    slices: int  # sliceCount: compute slices
    instances: int  # instanceCount
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg: int
    ofa: int
    memory_mib: int  # memorySizeMB
    placement_starts: tuple[int, ...]  # first memory slice of each possible placement
    placement_size: int  # memory slices a placement occupies


@dataclass(frozen=True)
class MigCatalog:
    """Every GPU instance profile NVML reports on one GPU model (``profiles/mig/<model>.yaml``)."""

    model: str
    memory_slices: int
    compute_slices: int
    profiles: tuple[MigProfileSpec, ...]

    def by_index(self, index: int) -> MigProfileSpec | None:
        return next((p for p in self.profiles if p.index == index), None)

    def by_id(self, profile_id: int) -> MigProfileSpec | None:
        return next((p for p in self.profiles if p.id == profile_id), None)

    def by_name(self, name: str) -> MigProfileSpec | None:
        return next((p for p in self.profiles if p.name == name), None)


@dataclass(frozen=True)
class GpuSpec:
    name: str
    uuid: str
    brand: int
    architecture: int
    compute_capability: tuple[int, int]
    memory_mib: int
    memory_used_mib: int
    minor: int
    bus_id: str  # NVML form, "00000000:3B:00.0"
    pci_device_id: int
    pci_subsystem_id: int
    numa_node: int | None
    mig_capable: bool
    mig_mode: tuple[int, int]  # (current, pending)
    max_mig_devices: int
    migs: dict[int, MigSpec]  # slot -> device
    fail: dict[str, str] = field(default_factory=dict)
    mig_catalog: MigCatalog | None = None  # the model's GPU instance profiles (migCatalog)


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    driver_version: str
    cuda_driver_version: int
    gpus: tuple[GpuSpec, ...]
    init_error: str | None = None


_GPU_KEYS = {
    "name", "uuid", "brand", "architecture", "cudaComputeCapability", "memoryMiB", "memoryUsedMiB",
    "minor", "busId", "pciDeviceId", "pciSubSystemId", "numaNode", "migCapable", "migMode",
    "migModePending", "maxMigDevices", "migDevices", "fail", "migCatalog",
}
_MIG_KEYS = {"uuid", "profile", "gpuInstanceId", "computeInstanceId", "slot", "attributes", "fail"}
_MIG_ATTRIBUTE_KEYS = {name for name, _ in pynvml.c_nvmlDeviceAttributes._fields_}
_PROFILE_KEYS = {"description", "driverVersion", "cudaDriverVersion", "initError", "defaults", "gpus"}
_CATALOG_KEYS = {"memorySlices", "computeSlices", "profiles"}
_CATALOG_PROFILE_KEYS = {
    "name", "index", "id", "slices", "instances", "multiprocessors", "copyEngines", "decoders", "encoders",
    "jpeg", "ofa", "memoryMiB", "placements",
}
_PLACEMENT_KEYS = {"starts", "size"}
_MIG_PROFILE_NAME = re.compile(r"[0-9]+g\.[0-9]+gb(\+[a-z.]+|-me)?")


def load_profile(ref: str) -> Profile:
    """A shipped profile by name (``dgx-h100``) or a YAML file by path (``/tmp/x.yaml``)."""
    if "/" in ref or ref.endswith((".yaml", ".yml")):
        path = Path(ref)
        if not path.is_file():
            raise ValueError(f"NVML profile file {ref!r} does not exist")
        text, name = path.read_text(), path.stem
    else:
        resource = resources.files("gpudra_driver") / "profiles" / f"{ref}.yaml"
        if not resource.is_file():
            from gpudra_driver.nvml import profile_names

            raise ValueError(f"unknown NVML profile {ref!r}; shipped profiles: {', '.join(profile_names())}")
        text, name = resource.read_text(), ref
    return parse_profile(name, yaml.safe_load(text))


def parse_profile(name: str, doc: Any) -> Profile:
    if not isinstance(doc, dict):
        raise ValueError(f"NVML profile {name}: expected a mapping at the top level")
    _no_unknown_keys(f"profile {name}", doc, _PROFILE_KEYS)
    defaults = doc.get("defaults") or {}
    _no_unknown_keys(f"profile {name} defaults", defaults, _GPU_KEYS)
    gpus = tuple(
        _parse_gpu(f"profile {name} gpus[{i}]", i, {**defaults, **raw})
        for i, raw in enumerate(doc.get("gpus") or [])
    )
    init_error = doc.get("initError")
    if init_error is not None:
        _error_class(init_error)  # fail on a typo at load time, not at nvmlInit
    return Profile(
        name=name,
        description=str(doc.get("description", "")),
        driver_version=str(doc["driverVersion"]),
        cuda_driver_version=int(doc["cudaDriverVersion"]),
        gpus=gpus,
        init_error=init_error,
    )


def _parse_gpu(where: str, index: int, raw: dict[str, Any]) -> GpuSpec:
    _no_unknown_keys(where, raw, _GPU_KEYS)
    try:
        cc = raw["cudaComputeCapability"]
        major, minor = (int(x) for x in (cc.split(".") if isinstance(cc, str) else cc))
        mig_capable = bool(raw.get("migCapable", False))
        current = _mig_mode(raw.get("migMode", "disabled"))
        pending = _mig_mode(raw.get("migModePending", raw.get("migMode", "disabled")))
        migs: dict[int, MigSpec] = {}
        for j, m in enumerate(raw.get("migDevices") or []):
            _no_unknown_keys(f"{where} migDevices[{j}]", m, _MIG_KEYS)
            _no_unknown_keys(f"{where} migDevices[{j}] attributes", m["attributes"], _MIG_ATTRIBUTE_KEYS)
            migs[int(m.get("slot", j))] = MigSpec(
                uuid=m["uuid"],
                profile=m["profile"],
                gpu_instance_id=int(m["gpuInstanceId"]),
                compute_instance_id=int(m["computeInstanceId"]),
                attributes={k: int(v) for k, v in m["attributes"].items()},
                fail=_faults(m.get("fail")),
            )
        if migs and not (mig_capable and current):
            raise ValueError("migDevices need migCapable: true and migMode: enabled")
        catalog = None
        if raw.get("migCatalog") is not None:
            if not mig_capable:
                raise ValueError("migCatalog needs migCapable: true")
            catalog = load_mig_catalog(str(raw["migCatalog"]))
            for slot, m in migs.items():
                if catalog.by_name(gpu_instance_profile(m.profile)) is None:
                    raise ValueError(f"MIG device in slot {slot}: profile {m.profile!r} is not in MIG catalog "
                                     f"{catalog.model} ({', '.join(p.name for p in catalog.profiles)})")
        return GpuSpec(
            name=raw["name"],
            uuid=raw["uuid"],
            brand=_constant("NVML_BRAND_", raw["brand"]),
            architecture=_constant("NVML_DEVICE_ARCH_", raw["architecture"]),
            compute_capability=(major, minor),
            memory_mib=int(raw["memoryMiB"]),
            memory_used_mib=int(raw.get("memoryUsedMiB", 0)),
            minor=int(raw.get("minor", index)),
            bus_id=raw["busId"],
            pci_device_id=int(raw["pciDeviceId"]),
            pci_subsystem_id=int(raw.get("pciSubSystemId", 0)),
            numa_node=None if raw.get("numaNode") is None else int(raw["numaNode"]),
            mig_capable=mig_capable,
            mig_mode=(current, pending),
            max_mig_devices=int(raw.get("maxMigDevices", 7 if mig_capable else 0)),
            migs=migs,
            fail=_faults(raw.get("fail")),
            mig_catalog=catalog,
        )
    except KeyError as exc:
        raise ValueError(f"{where}: missing field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def mig_catalog_names() -> list[str]:
    """The shipped MIG catalogs (``gpudra_driver/profiles/mig/<model>.yaml``)."""
    folder = resources.files("gpudra_driver") / "profiles" / "mig"
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


@functools.cache
def load_mig_catalog(model: str) -> MigCatalog:
    """The shipped MIG catalog of a GPU model, e.g. ``h100-sxm5-80gb``."""
    resource = resources.files("gpudra_driver") / "profiles" / "mig" / f"{model}.yaml"
    if "/" in model or not resource.is_file():
        raise ValueError(f"unknown MIG catalog {model!r}; shipped catalogs: {', '.join(mig_catalog_names())}")
    return parse_mig_catalog(model, yaml.safe_load(resource.read_text()))


def parse_mig_catalog(model: str, doc: Any) -> MigCatalog:
    """A MIG catalog document::

        memorySlices: 8          # placement units
        computeSlices: 7
        profiles:                # one per GPU instance profile NVML reports on the model
          - {name: 1g.10gb, index: 0, id: 19, slices: 1, instances: 7, multiprocessors: 14,
             copyEngines: 1, decoders: 0, encoders: 0, jpeg: 0, ofa: 0, memoryMiB: 9728,
             placements: {starts: [0, 1, 2, 3, 4, 5, 6], size: 1}}

    ``index`` is the NVML_GPU_INSTANCE_PROFILE_* constant, ``id`` the profile ID NVML gives it.
    Strict: every field present, no unknown ones, integers, placements distinct and inside the
    memory slices, instances no more than placements, indexes (below
    NVML_GPU_INSTANCE_PROFILE_COUNT), IDs and names unique."""
    where = f"MIG catalog {model}"
    _no_unknown_keys(where, doc, _CATALOG_KEYS)
    try:
        memory_slices, compute_slices = _count(doc["memorySlices"]), _count(doc["computeSlices"])
        if not isinstance(doc["profiles"], list) or not doc["profiles"]:
            raise ValueError("profiles: expected a non-empty list")
        profiles = tuple(_parse_mig_profile(f"{where} profiles[{i}]", raw, memory_slices, compute_slices)
                         for i, raw in enumerate(doc["profiles"]))
    except KeyError as exc:
        raise ValueError(f"{where}: missing field {exc.args[0]!r}") from None
    for attr in ("index", "id", "name"):
        values = [getattr(p, attr) for p in profiles]
        dupes = sorted({str(v) for v in values if values.count(v) > 1})
        if dupes:
            raise ValueError(f"{where}: profile {attr} {', '.join(dupes)} appears more than once")
    return MigCatalog(model=model, memory_slices=memory_slices, compute_slices=compute_slices, profiles=profiles)


def _parse_mig_profile(where: str, raw: Any, memory_slices: int, compute_slices: int) -> MigProfileSpec:
    _no_unknown_keys(where, raw, _CATALOG_PROFILE_KEYS)
    missing = sorted(_CATALOG_PROFILE_KEYS - set(raw))
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
    _no_unknown_keys(f"{where} placements", raw["placements"], _PLACEMENT_KEYS)
    missing = sorted(_PLACEMENT_KEYS - set(raw["placements"]))
    if missing:
        raise ValueError(f"{where} placements: missing field(s) {', '.join(missing)}")
    name = raw["name"]
    if not isinstance(name, str) or len(name) > 64 or not _MIG_PROFILE_NAME.fullmatch(name):
        raise ValueError(f"{where}: name {name!r} is not a MIG profile name like 1g.10gb or 1g.10gb+me")
    try:
        spec = MigProfileSpec(
            name=name, index=_count(raw["index"], 0), id=_count(raw["id"], 0), slices=_count(raw["slices"]),
            instances=_count(raw["instances"]), multiprocessors=_count(raw["multiprocessors"]),
            copy_engines=_count(raw["copyEngines"], 0), decoders=_count(raw["decoders"], 0),
            encoders=_count(raw["encoders"], 0), jpeg=_count(raw["jpeg"], 0), ofa=_count(raw["ofa"], 0),
            memory_mib=_count(raw["memoryMiB"]),
            placement_starts=tuple(_count(s, 0) for s in _list(raw["placements"]["starts"])),
            placement_size=_count(raw["placements"]["size"]),
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    if spec.index >= pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
        raise ValueError(f"{where}: index {spec.index} is not an NVML_GPU_INSTANCE_PROFILE_* constant "
                         f"(below {pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT})")
    if spec.slices > compute_slices:
        raise ValueError(f"{where}: {spec.slices} slices, but the GPU has {compute_slices} compute slices")
    if not spec.placement_starts or len(set(spec.placement_starts)) != len(spec.placement_starts):
        raise ValueError(f"{where}: placements.starts must be a non-empty list of distinct slices")
    outside = [s for s in spec.placement_starts if s + spec.placement_size > memory_slices]
    if outside:
        raise ValueError(f"{where}: placements starting at {outside} (size {spec.placement_size}) end past "
                         f"the GPU's {memory_slices} memory slices")
    if spec.instances > len(spec.placement_starts):
        raise ValueError(f"{where}: {spec.instances} instances but only {len(spec.placement_starts)} placements")
    return spec


def _count(value: Any, minimum: int = 1) -> int:
    """A YAML integer (not a bool, a float or a string) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"expected an integer >= {minimum}, not {value!r}")
    return value


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"expected a list, not {value!r}")
    return value


def gpu_instance_profile(profile: str) -> str:
    """The GPU instance profile of a MIG device's profile name: ``1c.3g.20gb`` -> ``3g.20gb``."""
    return re.sub(r"^[0-9]+c\.", "", profile)


def _no_unknown_keys(where: str, raw: Any, allowed: set[str]) -> None:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a mapping")
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}")


def _mig_mode(value: Any) -> int:
    modes = {"enabled": pynvml.NVML_DEVICE_MIG_ENABLE, "disabled": pynvml.NVML_DEVICE_MIG_DISABLE}
    if value not in modes:
        raise ValueError(f"migMode must be 'enabled' or 'disabled', not {value!r}")
    return modes[value]


def _constant(prefix: str, value: Any) -> int:
    """``NVIDIA`` -> ``pynvml.NVML_BRAND_NVIDIA``; ints pass through."""
    if isinstance(value, int):
        return value
    const = getattr(pynvml, prefix + str(value).upper().replace(" ", "_"), None)
    if not isinstance(const, int):
        raise ValueError(f"unknown {prefix}* constant {value!r}")
    return const


def _faults(value: Any) -> dict[str, str]:
    if not value:
        return {}
    faults = {"nvmlDeviceGetUUID": "Unknown"} if value is True else dict(value)
    for err in faults.values():
        _error_class(err)
    return faults


def _error_class(name: str) -> type[pynvml.NVMLError]:
    cls = getattr(pynvml, f"NVMLError_{name}", None)
    if not (isinstance(cls, type) and issubclass(cls, pynvml.NVMLError)):
        raise ValueError(f"unknown NVML error {name!r} (expected e.g. Unknown, GpuIsLost, NotSupported)")
    return cls


# -- the simulated library --------------------------------------------------------------------


class _Handle:
    """Opaque like pynvml's c_nvmlDevice_t; callers only pass it back. ``created``: the MIG device of
    a compute instance created through NVML, looked up again (by slot) on every use."""

    __slots__ = ("gpu", "index", "mig", "slot", "created")

    def __init__(self, gpu: GpuSpec, index: int, mig: MigSpec | None = None, slot: int = -1,
                 created: bool = False) -> None:
        self.gpu, self.index, self.mig, self.slot, self.created = gpu, index, mig, slot, created

    def __repr__(self) -> str:
        return f"<fake nvmlDevice {self.mig.uuid if self.mig else self.gpu.uuid}>"


EVENTS_FILE = "events"  # in the state directory, as the mock library reads it
SUPPORTED_EVENTS = (pynvml.nvmlEventTypeSingleBitEccError | pynvml.nvmlEventTypeDoubleBitEccError
                    | pynvml.nvmlEventTypeXidCriticalError)
NO_INSTANCE = 0xFFFFFFFF  # an event's GPU/compute instance ID when it is not on a MIG device
_WAIT_STEP = 0.01


@dataclass(frozen=True)
class EventData:
    """pynvml.c_nvmlEventData_t's fields; ``device`` is this simulator's handle, which a ctypes
    structure cannot hold."""

    device: _Handle
    eventType: int
    eventData: int
    gpuInstanceId: int
    computeInstanceId: int


class _EventSet:
    """Opaque like pynvml's c_nvmlEventSet_t: registered types per GPU index, how far into the
    events file it has delivered, and an inotify descriptor on the state directory (-1: none)."""

    def __init__(self, offset: int, inotify: int = -1) -> None:
        self.masks: dict[int, int] = {}
        self.offset = offset
        self.inotify = inotify
        self.freed = False

    def close(self) -> None:
        self.freed = True
        if self.inotify >= 0:
            os.close(self.inotify)
            self.inotify = -1

    def __del__(self) -> None:  # a set never freed (a test's): its descriptor goes with it
        if self.inotify >= 0:
            try:
                os.close(self.inotify)
            except OSError:
                pass


_IN_NONBLOCK, _IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC  # inotify_init1's flags are these
_IN_MODIFY, _IN_MOVED_TO, _IN_CREATE = 0x2, 0x80, 0x100
_libc: Any = None


def _watch_dir(path: Path) -> int:
    """An inotify descriptor (non-blocking) told of every write to, creation in or move into
    ``path``; -1 where inotify is unavailable. The mock library watches its state directory alike."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        fd = int(_libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC))
    except (OSError, AttributeError):  # not Linux, or no such call
        return -1
    if fd < 0:
        return -1
    if _libc.inotify_add_watch(fd, os.fsencode(path), _IN_MODIFY | _IN_CREATE | _IN_MOVED_TO) < 0:
        os.close(fd)
        return -1
    return fd


def _wait_readable(fd: int, timeout: float) -> None:
    """Until ``fd`` (an inotify descriptor) has news or ``timeout`` seconds passed; drains it."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if poller.poll(max(0, math.ceil(timeout * 1000))):
        try:
            while os.read(fd, 4096):
                pass
        except BlockingIOError:
            pass


def _read_lines(path: Path, offset: int) -> tuple[list[str], int]:
    """The complete lines of ``path`` from ``offset``, and the offset after them."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1  # a line still being written waits for its newline
    return data[:end].decode(errors="replace").splitlines(), offset + end


class FakeNvml:
    """Module-like: ``nvml.nvmlInit()``, ``nvml.NVMLError_NotSupported``, ``nvml.NVML_BRAND_NVIDIA``."""

    def __init__(self, profile: Profile, state_dir: Path | None = None) -> None:
        self.profile = profile
        self._refcount = 0
        self._compute_modes: dict[int, int] = {}  # GPU index -> mode; absent: DEFAULT
        self._mig_modes: dict[int, tuple[int, int]] = {}  # GPU index -> MIG mode set, without a state directory
        self._events = state_dir / EVENTS_FILE if state_dir is not None else None
        self._health_lock = threading.Lock()  # the health monitor's thread and discovery's share it
        self._health_offset = 0
        self._lost: set[int] = set()  # GPU indexes
        self._recovery_actions: dict[int, int] = {}
        self._state_dir = state_dir
        self._mig_lock = threading.RLock()  # the created MIG instances: read and changed under it
        self._created: dict[int, _Created] = {}  # GPU index -> its instances (the file's, when read)
        self._created_seen: dict[int, tuple[int, int, int] | None] = {}  # GPU index -> the file's stat key

    def __getattr__(self, name: str) -> Any:
        # Constants and exception classes are pynvml's own; unimplemented functions are absent
        # (AttributeError), so a caller's getattr(nvml, "nvmlX", None) sees what it would on old NVML.
        if name.startswith(("NVML", "c_nvml", "nvmlPciInfo")):
            return getattr(pynvml, name)
        raise AttributeError(f"simulated NVML has no {name!r}")

    def __repr__(self) -> str:
        return f"<simulated NVML profile={self.profile.name}>"

    # -- library ------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self.nvmlInitWithFlags(0)

    def nvmlInitWithFlags(self, flags: int) -> None:
        if self.profile.init_error:
            raise _error_class(self.profile.init_error)()
        if self._refcount == 0:  # a GPU lost before this init is still lost: fold the file again
            with self._health_lock:
                self._health_offset, self._lost, self._recovery_actions = 0, set(), {}
        self._refcount += 1

    def nvmlShutdown(self) -> None:
        self._ready()
        self._refcount -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._ready()
        return self.profile.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._ready()
        return self.profile.cuda_driver_version

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return self.nvmlSystemGetCudaDriverVersion()

    # -- enumeration --------------------------------------------------------------------------

    def nvmlDeviceGetCount(self) -> int:
        self._ready()
        return len(self.profile.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._ready()
        if not 0 <= index < len(self.profile.gpus):
            raise pynvml.NVMLError_InvalidArgument()
        self._check_lost(index)
        return _Handle(self.profile.gpus[index], index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> _Handle:
        """A GPU's or a MIG device's handle; ``NotFound`` for any other UUID."""
        self._ready()
        handle = self._find(uuid.decode() if isinstance(uuid, bytes) else uuid)
        if handle is None:
            raise pynvml.NVMLError_NotFound()
        self._check_lost(handle.index)
        return handle

    def _find(self, uuid: str) -> _Handle | None:
        for index, gpu in enumerate(self.profile.gpus):
            if gpu.uuid == uuid:
                return _Handle(gpu, index)
            for slot, mig in gpu.migs.items():
                if mig.uuid == uuid:
                    return _Handle(gpu, index, mig, slot)
        if uuid.startswith("MIG-"):
            for index, gpu in enumerate(self.profile.gpus):
                for slot, mig in self._created_migs(index).items():
                    if mig.uuid == uuid:
                        return _Handle(gpu, index, mig, slot, created=True)
        return None

    def nvmlDeviceGetIndex(self, handle: _Handle) -> int:
        return self._gpu(handle, "nvmlDeviceGetIndex").index

    # -- identity -----------------------------------------------------------------------------

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        h = self._any(handle, "nvmlDeviceGetName")
        return f"{h.gpu.name} MIG {h.mig.profile}" if h.mig else h.gpu.name

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        h = self._any(handle, "nvmlDeviceGetUUID")
        return h.mig.uuid if h.mig else h.gpu.uuid

    def nvmlDeviceGetBrand(self, handle: _Handle) -> int:
        return self._any(handle, "nvmlDeviceGetBrand").gpu.brand

    def nvmlDeviceGetArchitecture(self, handle: _Handle) -> int:
        return self._any(handle, "nvmlDeviceGetArchitecture").gpu.architecture

    def nvmlDeviceGetCudaComputeCapability(self, handle: _Handle) -> tuple[int, int]:
        return self._any(handle, "nvmlDeviceGetCudaComputeCapability").gpu.compute_capability

    def nvmlDeviceGetMinorNumber(self, handle: _Handle) -> int:
        return self._gpu(handle, "nvmlDeviceGetMinorNumber").gpu.minor

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle, version: int | None = None) -> Any:
        h = self._any(handle, "nvmlDeviceGetMemoryInfo")
        if h.mig:
            total, used = h.mig.attributes["memorySizeMB"] * _MIB, 0
        else:
            total, used = h.gpu.memory_mib * _MIB, h.gpu.memory_used_mib * _MIB
        if version:
            return pynvml.c_nvmlMemory_v2_t(version=version, total=total, reserved=0, free=total - used, used=used)
        return pynvml.c_nvmlMemory_t(total=total, free=total - used, used=used)

    def nvmlDeviceGetPciInfo(self, handle: _Handle) -> Any:
        gpu = self._gpu(handle, "nvmlDeviceGetPciInfo").gpu
        domain, bus, rest = gpu.bus_id.split(":")
        dev = rest.split(".")[0]
        return pynvml.nvmlPciInfo_t(
            # NVML keeps the legacy 4-digit-domain form alongside the 8-digit one.
            busIdLegacy=f"{int(domain, 16):04X}:{bus}:{rest}".encode(),
            domain=int(domain, 16),
            bus=int(bus, 16),
            device=int(dev, 16),
            pciDeviceId=gpu.pci_device_id,
            pciSubSystemId=gpu.pci_subsystem_id,
            busId=gpu.bus_id.encode(),
        )

    def nvmlDeviceGetPciInfo_v3(self, handle: _Handle) -> Any:
        return self.nvmlDeviceGetPciInfo(handle)

    def nvmlDeviceGetNumaNodeId(self, handle: _Handle) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetNumaNodeId").gpu
        if gpu.numa_node is None:
            raise pynvml.NVMLError_NotSupported()
        return gpu.numa_node

    # -- MIG ----------------------------------------------------------------------------------

    def nvmlDeviceGetMigMode(self, handle: _Handle) -> list[int]:
        self._mig_capable(handle, "nvmlDeviceGetMigMode")
        return list(self._mig_mode_of(handle.index))

    def nvmlDeviceSetMigMode(self, handle: _Handle, mode: int) -> int:
        """NVML's semantics: the pending mode is set, and activated at once on Hopper and later
        (an idle GPU: nothing here runs on it); on older GPUs it stays pending until a reset, with
        activation status RESET_REQUIRED. Disabling while the GPU has a GPU instance: IN_USE.
        Returns the activation status, as pynvml does; shared with other processes like the
        created instances (``<state>/state/<uuid>/mig_mode``)."""
        gpu = self._mig_capable(handle, "nvmlDeviceSetMigMode")
        if mode not in (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE):
            raise pynvml.NVMLError_InvalidArgument()
        with self._mig_lock:
            current = self._mig_mode_of(handle.index)[0]
            if mode == pynvml.NVML_DEVICE_MIG_DISABLE and current == pynvml.NVML_DEVICE_MIG_ENABLE and (
                    gpu.migs or self._created_of(handle.index).gis):
                raise pynvml.NVMLError_InUse()
            live = gpu.architecture >= pynvml.NVML_DEVICE_ARCH_HOPPER
            status = pynvml.NVML_SUCCESS if live or mode == current else pynvml.NVML_ERROR_RESET_REQUIRED
            self._set_mig_mode(handle.index, (mode if live else current, mode))
        self._log(f"nvml SetMigMode {gpu.uuid} {mode}")
        return status

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: _Handle) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetMaxMigDeviceCount").gpu
        enabled = gpu.mig_capable and self._mig_mode_of(handle.index)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
        return gpu.max_mig_devices if enabled else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: _Handle, index: int) -> _Handle:
        gpu = self._mig_capable(handle, "nvmlDeviceGetMigDeviceHandleByIndex")
        if self._mig_mode_of(handle.index)[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
            raise pynvml.NVMLError_NotFound()
        if not 0 <= index < gpu.max_mig_devices:
            raise pynvml.NVMLError_InvalidArgument()
        mig = gpu.migs.get(index)
        if mig is not None:
            return _Handle(gpu, handle.index, mig, index)
        mig = self._created_migs(handle.index).get(index)
        if mig is None:
            raise pynvml.NVMLError_NotFound()
        return _Handle(gpu, handle.index, mig, index, created=True)

    def nvmlDeviceIsMigDeviceHandle(self, handle: _Handle) -> Any:
        h = self._any(handle, "nvmlDeviceIsMigDeviceHandle")
        return ctypes.c_uint(1 if h.mig else 0)  # pynvml returns the c_uint itself

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: _Handle) -> _Handle:
        h = self._mig(handle, "nvmlDeviceGetDeviceHandleFromMigDeviceHandle", pynvml.NVMLError_InvalidArgument)
        return _Handle(h.gpu, h.index)

    def nvmlDeviceGetGpuInstanceId(self, handle: _Handle) -> int:
        h = self._mig(handle, "nvmlDeviceGetGpuInstanceId", pynvml.NVMLError_InvalidArgument)
        return h.mig.gpu_instance_id  # type: ignore[union-attr]

    def nvmlDeviceGetComputeInstanceId(self, handle: _Handle) -> int:
        h = self._mig(handle, "nvmlDeviceGetComputeInstanceId", pynvml.NVMLError_InvalidArgument)
        return h.mig.compute_instance_id  # type: ignore[union-attr]

    def nvmlDeviceGetAttributes(self, handle: _Handle) -> Any:
        mig = self._mig(handle, "nvmlDeviceGetAttributes", pynvml.NVMLError_NotSupported).mig
        return pynvml.c_nvmlDeviceAttributes(**mig.attributes)  # type: ignore[union-attr]

    def nvmlDeviceGetAttributes_v2(self, handle: _Handle) -> Any:
        return self.nvmlDeviceGetAttributes(handle)

    # -- MIG GPU instance profiles ------------------------------------------------------------

    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: _Handle, profile: int, version: int = 2) -> Any:
        """pynvml's: version 2 (the default) answers a ``c_nvmlGpuInstanceProfileInfo_v2_t`` (with the
        profile's name), version 1 a ``c_nvmlGpuInstanceProfileInfo_t``; other versions raise
        ``FunctionNotFound`` before any call, as pynvml does."""
        if version not in (1, 2):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        gpu = self._mig_capable(handle, "nvmlDeviceGetGpuInstanceProfileInfo")
        if not 0 <= profile < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise pynvml.NVMLError_InvalidArgument()
        fields, name = _profile_info(gpu, profile)
        if version == 1:
            return pynvml.c_nvmlGpuInstanceProfileInfo_t(**fields)
        return _profile_info_v2(fields, name)

    nvmlDeviceGetGpuInstanceProfileInfoV = nvmlDeviceGetGpuInstanceProfileInfo

    def nvmlDeviceGetGpuInstanceProfileInfoById(self, handle: _Handle, profileId: int) -> Any:
        """By profile ID (what -lgip prints); an ID the GPU lacks raises ``InvalidArgument``."""
        gpu = self._mig_capable(handle, "nvmlDeviceGetGpuInstanceProfileInfoById")
        if gpu.mig_catalog is not None:
            spec = gpu.mig_catalog.by_id(profileId)
            if spec is None:
                raise pynvml.NVMLError_InvalidArgument()
            index = spec.index
        elif 0 <= profileId < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            index = profileId  # without a catalog the ID is the index
        else:
            raise pynvml.NVMLError_InvalidArgument()
        return _profile_info_v2(*_profile_info(gpu, index))

    nvmlDeviceGetGpuInstanceProfileInfoByIdV = nvmlDeviceGetGpuInstanceProfileInfoById

    def nvmlDeviceGetGpuInstancePossiblePlacements(self, handle: _Handle, profileId: int, placementsRef: Any,
                                                   countRef: Any) -> int:
        """pynvml's two-call protocol: ``placementsRef`` None -> ``countRef`` gets the number of
        placements; else up to ``countRef`` placements (``c_nvmlGpuInstancePlacement_t``, an array, a
        pointer or ``byref`` of either) are written, ``InsufficientSize`` (the count set to the needed
        number) when it is too small. Every placement of the profile, whatever exists already."""
        gpu = self._mig_capable(handle, "nvmlDeviceGetGpuInstancePossiblePlacements")
        count = _out_uint(countRef)
        if gpu.mig_catalog is None:
            _not_supported()
        spec = gpu.mig_catalog.by_id(profileId)
        if spec is None:
            raise pynvml.NVMLError_InvalidArgument()
        needed = len(spec.placement_starts)
        target = _out_array(placementsRef)
        if target is not None and count[0] < needed:
            count[0] = needed
            raise pynvml.NVMLError_InsufficientSize()
        if target is not None:
            for i, start in enumerate(spec.placement_starts):
                target[i] = pynvml.c_nvmlGpuInstancePlacement_t(start=start, size=spec.placement_size)
        count[0] = needed
        return pynvml.NVML_SUCCESS

    nvmlDeviceGetGpuInstancePossiblePlacements_v2 = nvmlDeviceGetGpuInstancePossiblePlacements

    # -- MIG GPU and compute instances (see the module docstring and tests/mocknvml/mock_nvml.c) ----

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, handle: _Handle, profileId: int, placement: Any) -> Any:
        """``placement``: a ``c_nvmlGpuInstancePlacement_t`` (or ``byref``/pointer to one, as NVML takes it)."""
        h, catalog = self._creatable(handle, "nvmlDeviceCreateGpuInstanceWithPlacement")
        where = _in_struct(placement)
        spec = catalog.by_id(profileId)
        if spec is None:
            raise pynvml.NVMLError_InvalidArgument()
        if where.start not in spec.placement_starts or where.size != spec.placement_size:
            raise pynvml.NVMLError_InvalidArgument()
        return self._create_gpu_instance(h, spec, where.start)

    def nvmlDeviceCreateGpuInstance(self, handle: _Handle, profileId: int) -> Any:
        h, catalog = self._creatable(handle, "nvmlDeviceCreateGpuInstance")
        spec = catalog.by_id(profileId)
        if spec is None:
            raise pynvml.NVMLError_InvalidArgument()
        return self._create_gpu_instance(h, spec, None)

    def nvmlGpuInstanceDestroy(self, gpuInstance: Any) -> int:
        ref = self._instance(gpuInstance, False, "nvmlGpuInstanceDestroy")
        if not ref.created:
            raise pynvml.NVMLError_InUse()
        with self._change(ref.index) as created:
            if ref.gi not in created.gis:
                raise pynvml.NVMLError_InvalidArgument()  # destroyed meanwhile
            if any(gi == ref.gi for gi, _ in created.cis):
                raise pynvml.NVMLError_InUse()
            del created.gis[ref.gi]
        self._log(f"nvml DestroyGpuInstance {self.profile.gpus[ref.index].uuid} {ref.gi}")
        return pynvml.NVML_SUCCESS

    def nvmlDeviceGetGpuInstanceById(self, handle: _Handle, gpuInstanceId: int) -> Any:
        h = self._gpu(handle, "nvmlDeviceGetGpuInstanceById")
        if not self._mig_on(h):
            _not_supported()
        for slot, mig in sorted(h.gpu.migs.items()):
            if mig.gpu_instance_id == gpuInstanceId:
                return _instance_handle(pynvml.c_nvmlGpuInstance_t, _STATIC_GI, h.index, slot)
        if gpuInstanceId not in self._created_of(h.index).gis:
            raise pynvml.NVMLError_NotFound()
        return _instance_handle(pynvml.c_nvmlGpuInstance_t, _CREATED_GI, h.index, gpuInstanceId)

    def nvmlDeviceGetGpuInstances(self, handle: _Handle, profileId: int, gpuInstancesRef: Any, countRef: Any) -> int:
        """pynvml's: ``gpuInstancesRef`` an array of ``c_nvmlGpuInstance_t`` (the profile's instanceCount
        long), ``countRef`` gets how many were written: the profile's instances, by ascending ID."""
        h = self._gpu(handle, "nvmlDeviceGetGpuInstances")
        if not self._mig_on(h):
            _not_supported()
        target, count = _out_array(gpuInstancesRef), _out_uint(countRef)
        if target is None:
            raise pynvml.NVMLError_InvalidArgument()
        catalog = h.gpu.mig_catalog
        spec = catalog.by_id(profileId) if catalog is not None else None
        known = spec is not None if catalog is not None else 0 <= profileId < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT
        if not known:  # without a catalog the ID is the index
            raise pynvml.NVMLError_InvalidArgument()
        created = self._created_of(h.index)
        found: list[Any] = []
        for gi in range(64):
            slot = _first_slot_of_gi(h.gpu, gi)
            if slot is not None:
                mig = h.gpu.migs[slot]
                ok = (catalog.by_name(gpu_instance_profile(mig.profile)) == spec if catalog is not None
                      else _PROFILE_INDEX.get(mig.attributes.get("gpuInstanceSliceCount", 0)) == profileId)
                if ok:
                    found.append(_instance_handle(pynvml.c_nvmlGpuInstance_t, _STATIC_GI, h.index, slot))
            elif gi in created.gis and created.gis[gi].profile == spec:
                found.append(_instance_handle(pynvml.c_nvmlGpuInstance_t, _CREATED_GI, h.index, gi))
        for i, gi_handle in enumerate(found):
            target[i] = gi_handle
        count[0] = len(found)
        return pynvml.NVML_SUCCESS

    def nvmlGpuInstanceGetInfo(self, gpuInstance: Any) -> GpuInstanceInfo:
        ref = self._instance(gpuInstance, False, "nvmlGpuInstanceGetInfo")
        gpu = self.profile.gpus[ref.index]
        device = _Handle(gpu, ref.index)
        if ref.created:
            gi = self._created_of(ref.index).gis[ref.gi]
            return GpuInstanceInfo(device, ref.gi, gi.profile.id,
                                   pynvml.c_nvmlGpuInstancePlacement_t(start=gi.start, size=gi.size))
        mig = gpu.migs[ref.slot]
        spec = gpu.mig_catalog.by_name(gpu_instance_profile(mig.profile)) if gpu.mig_catalog else None
        slices = mig.attributes.get("gpuInstanceSliceCount", 0)
        if spec is None and slices not in _PROFILE_INDEX:
            _not_supported()
        placed = _static_placement(gpu, mig)
        return GpuInstanceInfo(device, mig.gpu_instance_id, spec.id if spec else _PROFILE_INDEX[slices],
                               pynvml.c_nvmlGpuInstancePlacement_t(start=placed[0] if placed else 0,
                                                                   size=spec.placement_size if spec else slices))

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, gpuInstance: Any, profile: int, engProfile: int,
                                                     version: int = 2) -> Any:
        """pynvml's: version 2 (the default) answers a ``c_nvmlComputeInstanceProfileInfo_v2_t`` (with
        the name), 1 a ``c_nvmlComputeInstanceProfileInfo_t``, others ``FunctionNotFound``."""
        if version not in (1, 2):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        ref = self._instance(gpuInstance, False, "nvmlGpuInstanceGetComputeInstanceProfileInfo")
        fields, name = self._ci_profile(ref, profile, engProfile)
        if version == 1:
            return pynvml.c_nvmlComputeInstanceProfileInfo_t(**fields)
        info = pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
        for key, value in fields.items():
            setattr(info, key, value)
        info.name = name.encode()
        return info

    nvmlGpuInstanceGetComputeInstanceProfileInfoV = nvmlGpuInstanceGetComputeInstanceProfileInfo

    def nvmlGpuInstanceCreateComputeInstance(self, gpuInstance: Any, profileId: int) -> Any:
        ref = self._instance(gpuInstance, False, "nvmlGpuInstanceCreateComputeInstance")
        if not 0 <= profileId < pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
            raise pynvml.NVMLError_InvalidArgument()
        if not ref.created:
            raise pynvml.NVMLError_InsufficientResources()  # the inventory's compute instances fill it
        gpu = self.profile.gpus[ref.index]
        with self._change(ref.index) as created:
            gi = created.gis.get(ref.gi)
            if gi is None:
                raise pynvml.NVMLError_InvalidArgument()  # destroyed meanwhile
            if profileId != _PROFILE_INDEX.get(gi.profile.slices):
                _not_supported()
            if any(g == ref.gi for g, _ in created.cis):
                raise pynvml.NVMLError_InsufficientResources()  # the full-size one is there
            taken = set(gpu.migs) | {c.slot for c in created.cis.values()}
            slot = next((s for s in range(min(gpu.max_mig_devices, _MAX_MIG_SLOTS)) if s not in taken), None)
            if slot is None:
                raise pynvml.NVMLError_InsufficientResources()
            ci = 0
            created.cis[(ref.gi, ci)] = _CreatedCi(profileId, slot)
        self._log(f"nvml CreateComputeInstance {gpu.uuid} {ref.gi} {profileId} {ci}")
        return _instance_handle(pynvml.c_nvmlComputeInstance_t, _CREATED_CI, ref.index, ref.gi, ci)

    def nvmlComputeInstanceDestroy(self, computeInstance: Any) -> int:
        ref = self._instance(computeInstance, True, "nvmlComputeInstanceDestroy")
        if not ref.created:
            raise pynvml.NVMLError_InUse()
        with self._change(ref.index) as created:
            if ref.gi not in created.gis or (ref.gi, ref.ci) not in created.cis:
                raise pynvml.NVMLError_InvalidArgument()  # destroyed meanwhile
            del created.cis[(ref.gi, ref.ci)]
        self._log(f"nvml DestroyComputeInstance {self.profile.gpus[ref.index].uuid} {ref.gi} {ref.ci}")
        return pynvml.NVML_SUCCESS

    def nvmlGpuInstanceGetComputeInstanceById(self, gpuInstance: Any, computeInstanceId: int) -> Any:
        ref = self._instance(gpuInstance, False, "nvmlGpuInstanceGetComputeInstanceById")
        if ref.created:
            if (ref.gi, computeInstanceId) not in self._created_of(ref.index).cis:
                raise pynvml.NVMLError_NotFound()
            return _instance_handle(pynvml.c_nvmlComputeInstance_t, _CREATED_CI, ref.index, ref.gi, computeInstanceId)
        gpu = self.profile.gpus[ref.index]
        gi = gpu.migs[ref.slot].gpu_instance_id
        for slot, mig in sorted(gpu.migs.items()):
            if mig.gpu_instance_id == gi and mig.compute_instance_id == computeInstanceId:
                return _instance_handle(pynvml.c_nvmlComputeInstance_t, _STATIC_CI, ref.index, slot)
        raise pynvml.NVMLError_NotFound()

    def nvmlGpuInstanceGetComputeInstances(self, gpuInstance: Any, profileId: int, computeInstancesRef: Any,
                                           countRef: Any) -> int:
        ref = self._instance(gpuInstance, False, "nvmlGpuInstanceGetComputeInstances")
        target, count = _out_array(computeInstancesRef), _out_uint(countRef)
        if target is None:
            raise pynvml.NVMLError_InvalidArgument()
        if not 0 <= profileId < pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
            raise pynvml.NVMLError_InvalidArgument()
        found: list[Any] = []
        if ref.created:
            created = self._created_of(ref.index)
            if profileId != _PROFILE_INDEX.get(created.gis[ref.gi].profile.slices):
                _not_supported()
            found = [_instance_handle(pynvml.c_nvmlComputeInstance_t, _CREATED_CI, ref.index, gi, ci)
                     for gi, ci in sorted(created.cis) if gi == ref.gi]
        else:
            gpu = self.profile.gpus[ref.index]
            gi = gpu.migs[ref.slot].gpu_instance_id
            found = [_instance_handle(pynvml.c_nvmlComputeInstance_t, _STATIC_CI, ref.index, slot)
                     for slot, mig in sorted(gpu.migs.items(), key=lambda x: (x[1].compute_instance_id, x[0]))
                     if mig.gpu_instance_id == gi and profileId < len(_PROFILE_SLICES)
                     and mig.attributes.get("computeInstanceSliceCount", 0) == _PROFILE_SLICES[profileId]]
            if not found:
                _not_supported()  # as the profile info: a profile none of its CIs has
        for i, ci_handle in enumerate(found):
            target[i] = ci_handle
        count[0] = len(found)
        return pynvml.NVML_SUCCESS

    def nvmlComputeInstanceGetInfo_v2(self, computeInstance: Any) -> ComputeInstanceInfo:
        ref = self._instance(computeInstance, True, "nvmlComputeInstanceGetInfo")
        gpu = self.profile.gpus[ref.index]
        device = _Handle(gpu, ref.index)
        if ref.created:
            created = self._created_of(ref.index)
            return ComputeInstanceInfo(
                device, _instance_handle(pynvml.c_nvmlGpuInstance_t, _CREATED_GI, ref.index, ref.gi), ref.ci,
                created.cis[(ref.gi, ref.ci)].profile_id,
                pynvml.c_nvmlComputeInstancePlacement_t(start=0, size=created.gis[ref.gi].profile.slices))
        mig = gpu.migs[ref.slot]
        slices = mig.attributes.get("computeInstanceSliceCount", 0)
        if slices not in _PROFILE_INDEX:
            _not_supported()
        return ComputeInstanceInfo(
            device, _instance_handle(pynvml.c_nvmlGpuInstance_t, _STATIC_GI, ref.index, ref.slot),
            mig.compute_instance_id, _PROFILE_INDEX[slices],
            pynvml.c_nvmlComputeInstancePlacement_t(start=0, size=slices))

    def nvmlComputeInstanceGetInfo(self, computeInstance: Any) -> ComputeInstanceInfo:
        return self.nvmlComputeInstanceGetInfo_v2(computeInstance)

    # the helpers of the instance calls

    def _creatable(self, handle: Any, call: str) -> tuple[_Handle, MigCatalog]:
        h = self._gpu(handle, call)
        if not self._mig_on(h) or h.gpu.mig_catalog is None:
            _not_supported()
        return h, h.gpu.mig_catalog

    def _create_gpu_instance(self, h: _Handle, spec: MigProfileSpec, start: int | None) -> Any:
        catalog = h.gpu.mig_catalog
        assert catalog is not None
        with self._change(h.index) as created:
            chosen = None
            for s in sorted(spec.placement_starts):
                if start is not None and s != start:
                    continue
                gi = _fits(h.gpu, catalog, created, spec, s)
                if gi is not None:
                    chosen = (s, gi)
                    break
            if chosen is None:
                raise pynvml.NVMLError_InsufficientResources()
            created.gis[chosen[1]] = _CreatedGi(spec, chosen[0], spec.placement_size)
        self._log(f"nvml CreateGpuInstance {h.gpu.uuid} {spec.id} {chosen[0]} {spec.placement_size} {chosen[1]}")
        return _instance_handle(pynvml.c_nvmlGpuInstance_t, _CREATED_GI, h.index, chosen[1])

    def _ci_profile(self, ref: _InstanceRef, profile: int, engProfile: int) -> tuple[dict[str, int], str]:
        gpu = self.profile.gpus[ref.index]
        if ref.created:
            if not (0 <= profile < pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT
                    and 0 <= engProfile < pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT):
                raise pynvml.NVMLError_InvalidArgument()
            spec = self._created_of(ref.index).gis[ref.gi].profile
            if profile != _PROFILE_INDEX.get(spec.slices):
                _not_supported()  # only the full-size compute instance
            return {"id": profile, "sliceCount": spec.slices, "instanceCount": 1,
                    "multiprocessorCount": spec.multiprocessors, "sharedCopyEngineCount": spec.copy_engines,
                    "sharedDecoderCount": spec.decoders, "sharedEncoderCount": spec.encoders,
                    "sharedJpegCount": spec.jpeg, "sharedOfaCount": spec.ofa}, f"MIG {spec.name}"
        owner = gpu.migs[ref.slot]
        if not 0 <= profile < len(_PROFILE_SLICES):
            raise pynvml.NVMLError_InvalidArgument()
        if engProfile != 0:
            _not_supported()  # only the shared engine profile
        for _, mig in sorted(gpu.migs.items()):
            a = mig.attributes
            if mig.gpu_instance_id != owner.gpu_instance_id or a.get("computeInstanceSliceCount", 0) != _PROFILE_SLICES[profile]:
                continue
            return {"id": profile, "sliceCount": _PROFILE_SLICES[profile],
                    "instanceCount": owner.attributes.get("gpuInstanceSliceCount", 0) // _PROFILE_SLICES[profile],
                    "multiprocessorCount": a.get("multiprocessorCount", 0),
                    "sharedCopyEngineCount": a.get("sharedCopyEngineCount", 0),
                    "sharedDecoderCount": a.get("sharedDecoderCount", 0),
                    "sharedEncoderCount": a.get("sharedEncoderCount", 0),
                    "sharedJpegCount": a.get("sharedJpegCount", 0),
                    "sharedOfaCount": a.get("sharedOfaCount", 0)}, f"MIG {mig.profile}"
        _not_supported()

    def _instance(self, handle: Any, compute: bool, call: str) -> _InstanceRef:
        """The GPU (or compute) instance behind a handle; ``InvalidArgument`` for anything else and for
        a created instance since destroyed. The parent GPU's lost state and ``fail`` entries apply."""
        self._ready()
        ref = _decode_instance(handle, compute)
        gpus = self.profile.gpus
        if ref is None or not 0 <= ref.index < len(gpus):
            raise pynvml.NVMLError_InvalidArgument()
        gpu = gpus[ref.index]
        if ref.created:
            created = self._created_of(ref.index)
            if ref.gi not in created.gis or (compute and (ref.gi, ref.ci) not in created.cis):
                raise pynvml.NVMLError_InvalidArgument()
        elif ref.slot not in gpu.migs:
            raise pynvml.NVMLError_InvalidArgument()
        self._any(_Handle(gpu, ref.index), call)
        return ref

    def _created_migs(self, index: int) -> dict[int, MigSpec]:
        """The MIG devices of the created compute instances of GPU ``index``, by slot."""
        gpu = self.profile.gpus[index]
        if gpu.mig_catalog is None:
            return {}
        out: dict[int, MigSpec] = {}
        created = self._created_of(index)
        for (gi, ci), c in sorted(created.cis.items()):
            spec = created.gis[gi].profile
            if c.slot in out or c.slot in gpu.migs:
                continue
            out[c.slot] = MigSpec(
                uuid=mig_uuid(gpu.uuid, gi, ci, created.resets), profile=spec.name, gpu_instance_id=gi, compute_instance_id=ci,
                attributes={
                    "multiprocessorCount": spec.multiprocessors, "sharedCopyEngineCount": spec.copy_engines,
                    "sharedDecoderCount": spec.decoders, "sharedEncoderCount": spec.encoders,
                    "sharedJpegCount": spec.jpeg, "sharedOfaCount": spec.ofa,
                    "gpuInstanceSliceCount": spec.slices, "computeInstanceSliceCount": spec.slices,
                    "memorySizeMB": spec.memory_mib,
                })
        return out

    def _mig_mode_of(self, index: int) -> tuple[int, int]:
        """GPU ``index``'s (current, pending) MIG mode: as last set (by any process, through the
        state file, ``<current><pending>`` as a number: 11, 10, 1, 0), else the profile's."""
        gpu = self.profile.gpus[index]
        if self._state_dir is None:
            return self._mig_modes.get(index, gpu.mig_mode)
        try:
            value = int((self._state_dir / "state" / gpu.uuid / MIG_MODE_FILE).read_text())
        except (FileNotFoundError, ValueError):
            return gpu.mig_mode
        return value // 10, value % 10

    def _set_mig_mode(self, index: int, mode: tuple[int, int]) -> None:
        if self._state_dir is None:
            self._mig_modes[index] = mode
            return
        directory = self._state_dir / "state" / self.profile.gpus[index].uuid
        try:
            directory.mkdir(parents=True, exist_ok=True)
            tmp = directory / f".{MIG_MODE_FILE}.{os.getpid()}.{threading.get_ident()}"
            tmp.write_text(f"{mode[0] * 10 + mode[1]}\n")
            os.replace(tmp, directory / MIG_MODE_FILE)
        except OSError as exc:
            raise _error_for(exc) from None

    def _mig_on(self, h: _Handle) -> bool:
        return h.gpu.mig_capable and self._mig_mode_of(h.index)[0] == pynvml.NVML_DEVICE_MIG_ENABLE

    def _state_file(self, index: int) -> Path | None:
        if self._state_dir is None:
            return None
        return self._state_dir / "state" / self.profile.gpus[index].uuid / MIG_STATE_FILE

    def _created_of(self, index: int, force: bool = False) -> _Created:
        """GPU ``index``'s created instances: the state file's, read again when it changed; in memory
        without a state directory."""
        gpu = self.profile.gpus[index]
        path = self._state_file(index)
        with self._mig_lock:
            if path is None or gpu.mig_catalog is None:
                return self._created.setdefault(index, _Created())
            try:
                with path.open("rb") as f:
                    st = os.fstat(f.fileno())
                    key: tuple[int, int, int] | None = (st.st_ino, st.st_size, st.st_mtime_ns)
                    if not force and index in self._created and self._created_seen.get(index) == key:
                        return self._created[index]
                    text = f.read().decode(errors="replace")
            except FileNotFoundError:
                key, text = None, ""
                if not force and index in self._created and self._created_seen.get(index) is None:
                    return self._created[index]
            self._created[index] = _parse_instances(text, gpu.mig_catalog)
            self._created[index].resets = _read_resets(path.parent)
            self._created_seen[index] = key
            return self._created[index]

    def reset_gpu(self, uuid: str) -> None:
        """What a GPU reset (or a reload of the kernel module) does to MIG, as the mock ``nvidia-smi
        -r`` does it (tests/mocknvml/nvidia_smi.c): every GPU and compute instance of the GPU gone,
        MIG mode kept, the reset counted, so instances made again get new UUIDs."""
        index = next((i for i, gpu in enumerate(self.profile.gpus) if gpu.uuid == uuid), None)
        if index is None:
            raise pynvml.NVMLError_NotFound()
        with self._change(index) as created:
            created.gis.clear()
            created.cis.clear()
            created.resets += 1
            path = self._state_file(index)
            if path is not None:  # the count first: the emptied file's readers then see it
                _write_resets(path.parent, created.resets)

    @contextlib.contextmanager
    def _change(self, index: int) -> Iterator[_Created]:
        """Change GPU ``index``'s instances: a fresh copy to change, saved atomically (temporary file,
        rename) under the file lock the mock library takes too, unless the block raises."""
        path = self._state_file(index)
        with self._mig_lock:
            if path is None:
                current = self._created.setdefault(index, _Created())
                changed = current.copy()
                yield changed
                self._created[index] = changed
                return
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                lock = os.open(path.parent / f".{MIG_STATE_FILE}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except PermissionError:
                raise pynvml.NVMLError_NoPermission() from None
            except OSError as exc:
                raise _error_for(exc) from None
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
                changed = self._created_of(index, force=True).copy()
                yield changed
                tmp = path.parent / f".{MIG_STATE_FILE}.{os.getpid()}.{threading.get_ident()}.tmp"
                try:
                    with tmp.open("w") as f:
                        f.write(_format_instances(self.profile.gpus[index].uuid, changed))
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, path)
                except OSError as exc:
                    tmp.unlink(missing_ok=True)
                    raise _error_for(exc) from None
                self._created_of(index, force=True)
            finally:
                os.close(lock)  # releases the flock

    def _log(self, line: str) -> None:
        """A successful create/destroy, in the state directory's calls.log as the mock library logs it."""
        if self._state_dir is None:
            return
        try:
            fd = os.open(self._state_dir / "calls.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, (line + "\n").encode())
            finally:
                os.close(fd)
        except OSError:
            pass

    # -- compute mode -------------------------------------------------------------------------

    def nvmlDeviceGetComputeMode(self, handle: _Handle) -> int:
        index = self._gpu(handle, "nvmlDeviceGetComputeMode").index
        return self._compute_modes.get(index, pynvml.NVML_COMPUTEMODE_DEFAULT)

    def nvmlDeviceSetComputeMode(self, handle: _Handle, mode: int) -> None:
        index = self._gpu(handle, "nvmlDeviceSetComputeMode").index
        if mode not in _SETTABLE_COMPUTE_MODES:
            raise pynvml.NVMLError_InvalidArgument()
        self._compute_modes[index] = mode

    # -- health: the recovery-action field and events ------------------------------------------

    def nvmlDeviceGetFieldValues(self, handle: _Handle, field_ids: list[Any]) -> Any:
        """Only NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (per GPU; a MIG handle reads its parent's);
        other fields get NOT_SUPPORTED in their own ``nvmlReturn``, as the real call reports."""
        h = self._any(handle, "nvmlDeviceGetFieldValues")
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for value, field_id in zip(values, field_ids):
            value.fieldId, value.scopeId = field_id if isinstance(field_id, tuple) else (field_id, 0)
            value.timestamp = time.time_ns() // 1000
            if value.fieldId == pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION:
                value.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                value.value.uiVal = self._recovery_actions.get(h.index, pynvml.NVML_GPU_RECOVERY_ACTION_NONE)
                value.nvmlReturn = pynvml.NVML_SUCCESS
            else:
                value.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    def nvmlEventSetCreate(self) -> _EventSet:
        self._ready()
        inotify = -1
        if self._events is not None:  # watched before the file is measured: no line slips in between
            try:
                self._events.parent.mkdir(parents=True, exist_ok=True)
                inotify = _watch_dir(self._events.parent)
            except OSError:
                pass  # waits look every _WAIT_STEP instead
        try:  # only events from now on, as NVML
            offset = self._events.stat().st_size if self._events is not None else 0
        except FileNotFoundError:
            offset = 0
        return _EventSet(offset, inotify)

    def nvmlEventSetFree(self, event_set: _EventSet) -> None:
        self._ready()
        self._event_set(event_set).close()

    def nvmlDeviceGetSupportedEventTypes(self, handle: _Handle) -> int:
        self._gpu(handle, "nvmlDeviceGetSupportedEventTypes")
        return SUPPORTED_EVENTS

    def nvmlDeviceRegisterEvents(self, handle: _Handle, event_types: int, event_set: _EventSet) -> None:
        index = self._gpu(handle, "nvmlDeviceRegisterEvents").index
        if event_types & ~SUPPORTED_EVENTS:
            _not_supported()
        target = self._event_set(event_set)
        target.masks[index] = target.masks.get(index, 0) | event_types

    def nvmlEventSetWait_v2(self, event_set: _EventSet, timeoutms: int) -> Any:
        """The next event registered in ``event_set``: :class:`EventData`; ``GpuIsLost`` when a
        registered GPU was lost; ``Timeout`` after ``timeoutms`` without one."""
        self._ready()
        target = self._event_set(event_set)
        deadline = time.monotonic() + timeoutms / 1000
        while True:
            data = self._next_event(target)
            if data is not None:
                return data
            left = deadline - time.monotonic()
            if left <= 0:
                raise pynvml.NVMLError_Timeout()
            if self._events is None:  # nothing is ever injected: a blocking call's wait, all of it
                time.sleep(left)
            elif target.inotify >= 0:  # until the state directory changes (queued since create)
                _wait_readable(target.inotify, left)
            else:
                time.sleep(min(_WAIT_STEP, left))  # no inotify: look again every 10 ms

    def nvmlEventSetWait(self, event_set: _EventSet, timeoutms: int) -> Any:
        return self.nvmlEventSetWait_v2(event_set, timeoutms)

    def _next_event(self, target: _EventSet) -> Any:
        if self._events is None:
            return None
        while True:
            lines, _ = _read_lines(self._events, target.offset)
            if not lines:
                return None
            line = lines[0]
            target.offset += len(line.encode()) + 1
            words = line.split()
            handle = self._find(words[1]) if len(words) >= 2 else None
            if handle is None:
                continue
            registered = target.masks.get(handle.index, 0)
            verb = words[0]
            if verb == "lost" and registered:
                raise pynvml.NVMLError_GpuIsLost()
            kind = (pynvml.nvmlEventTypeXidCriticalError if verb == "xid" and len(words) == 3
                    else pynvml.nvmlEventTypeDoubleBitEccError if verb == "ecc" else 0)
            if not kind or not registered & kind:
                continue
            return EventData(
                device=_Handle(handle.gpu, handle.index), eventType=kind,
                eventData=int(words[2]) if kind == pynvml.nvmlEventTypeXidCriticalError else 0,
                gpuInstanceId=handle.mig.gpu_instance_id if handle.mig else NO_INSTANCE,
                computeInstanceId=handle.mig.compute_instance_id if handle.mig else NO_INSTANCE)

    def _event_set(self, event_set: Any) -> _EventSet:
        if not isinstance(event_set, _EventSet) or event_set.freed:
            raise pynvml.NVMLError_InvalidArgument()
        return event_set

    def _refresh_health(self) -> None:
        """Fold the lost/action/recover lines appended since the last look into the GPUs' state."""
        if self._events is None:
            return
        with self._health_lock:
            try:
                size = self._events.stat().st_size
            except FileNotFoundError:
                return
            if size < self._health_offset:  # replaced by a shorter file: start over
                self._health_offset, self._lost, self._recovery_actions = 0, set(), {}
            lines, self._health_offset = _read_lines(self._events, self._health_offset)
            for line in lines:
                words = line.split()
                handle = self._find(words[1]) if len(words) >= 2 else None
                if handle is None:
                    continue
                if words[0] == "lost":
                    self._lost.add(handle.index)
                elif words[0] == "recover":
                    self._lost.discard(handle.index)
                    self._recovery_actions.pop(handle.index, None)
                elif words[0] == "action" and len(words) == 3:
                    self._recovery_actions[handle.index] = int(words[2])

    def _check_lost(self, index: int) -> None:
        self._refresh_health()
        if index in self._lost:
            raise pynvml.NVMLError_GpuIsLost()

    # -- checks shared by every call ------------------------------------------------------------

    def _ready(self) -> None:
        if self._refcount <= 0:
            raise pynvml.NVMLError_Uninitialized()

    def _any(self, handle: Any, call: str) -> _Handle:
        self._ready()
        if not isinstance(handle, _Handle):
            raise pynvml.NVMLError_InvalidArgument()
        if handle.created:  # the MIG device in its slot now: gone (destroyed) -> an invalid handle
            mig = self._created_migs(handle.index).get(handle.slot)
            if mig is None:
                raise pynvml.NVMLError_InvalidArgument()
            handle = _Handle(handle.gpu, handle.index, mig, handle.slot, created=True)
        self._check_lost(handle.index)
        faults = handle.mig.fail if handle.mig else handle.gpu.fail
        if call in faults:
            raise _error_class(faults[call])()
        return handle

    def _gpu(self, handle: Any, call: str) -> _Handle:
        h = self._any(handle, call)
        if h.mig:
            _not_supported()
        return h

    def _mig(self, handle: Any, call: str, error: type[pynvml.NVMLError]) -> _Handle:
        h = self._any(handle, call)
        if not h.mig:
            raise error()
        return h

    def _mig_capable(self, handle: Any, call: str) -> GpuSpec:
        gpu = self._gpu(handle, call).gpu
        if not gpu.mig_capable:
            _not_supported()
        return gpu


def _not_supported() -> NoReturn:
    raise pynvml.NVMLError_NotSupported()


# NVML_GPU_INSTANCE_PROFILE_<n>_SLICE: the profiles a GPU without a catalog derives from its MIG devices
_PROFILE_SLICES = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7, 5: 8, 6: 6}


def _profile_info(gpu: GpuSpec, index: int) -> tuple[dict[str, int], str]:
    """The fields of c_nvmlGpuInstanceProfileInfo_t for profile ``index`` and the profile's name:
    from the catalog; without one, from the first MIG device whose GPU instance has that many
    slices, as the mock library answers (ID = the index). ``NotSupported`` where there is none."""
    catalog = gpu.mig_catalog
    if catalog is not None:
        spec = catalog.by_index(index)
        if spec is None:
            _not_supported()
        return {
            "id": spec.id, "isP2pSupported": 0, "sliceCount": spec.slices, "instanceCount": spec.instances,
            "multiprocessorCount": spec.multiprocessors, "copyEngineCount": spec.copy_engines,
            "decoderCount": spec.decoders, "encoderCount": spec.encoders, "jpegCount": spec.jpeg,
            "ofaCount": spec.ofa, "memorySizeMB": spec.memory_mib,
        }, spec.name
    slices = _PROFILE_SLICES.get(index)
    for _, mig in sorted(gpu.migs.items()):
        a = mig.attributes
        if slices is None or a.get("gpuInstanceSliceCount", 0) != slices:
            continue
        ci_slices = a.get("computeInstanceSliceCount", 0) or 1
        return {
            "id": index, "isP2pSupported": 0, "sliceCount": slices, "instanceCount": gpu.max_mig_devices // slices,
            # a GPU instance's share of the GPU: its compute instance scaled back up to the whole GI
            "multiprocessorCount": a.get("multiprocessorCount", 0) * slices // ci_slices,
            "copyEngineCount": a.get("sharedCopyEngineCount", 0), "decoderCount": a.get("sharedDecoderCount", 0),
            "encoderCount": a.get("sharedEncoderCount", 0), "jpegCount": a.get("sharedJpegCount", 0),
            "ofaCount": a.get("sharedOfaCount", 0), "memorySizeMB": a.get("memorySizeMB", 0),
        }, gpu_instance_profile(mig.profile)
    _not_supported()


def _profile_info_v2(fields: dict[str, int], name: str) -> Any:
    info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()  # its version field set, as pynvml sends it
    for key, value in fields.items():
        setattr(info, key, value)
    info.name = f"MIG {name}"
    return info


def _out_uint(ref: Any) -> Any:
    """An unsigned-int out-argument as pynvml passes it (``byref(c_uint)``, ``pointer(c_uint)`` or the
    ``c_uint``), indexable like a pointer; ``InvalidArgument`` for NULL, as NVML answers."""
    obj = getattr(ref, "_obj", ref)  # byref(x) -> x
    if isinstance(obj, ctypes.c_uint):
        return ctypes.pointer(obj)
    if isinstance(obj, ctypes._Pointer) and obj:
        return obj
    raise pynvml.NVMLError_InvalidArgument()


def _out_array(ref: Any) -> Any:
    """A placements out-argument: None (NULL) or something indexable that placements can be stored in."""
    obj = getattr(ref, "_obj", ref)
    if obj is None or (isinstance(obj, ctypes._Pointer) and not obj):
        return None
    if isinstance(obj, ctypes.Structure):
        return ctypes.pointer(obj)
    if isinstance(obj, (ctypes.Array, ctypes._Pointer)):
        return obj
    raise pynvml.NVMLError_InvalidArgument()


# -- created MIG instances: the state file, handles, resources -------------------------------------

MIG_STATE_FILE = "mig_instances"  # <state>/state/<GPU uuid>/mig_instances, the mock library's too
MIG_MODE_FILE = "mig_mode"  # <state>/state/<GPU uuid>/mig_mode: MIG mode set by nvmlDeviceSetMigMode, the mock's too
_MAX_GIS, _MAX_CIS, _MAX_MIG_SLOTS = 15, 8, 16  # the kernel's capability layout; the mock's slots
_PROFILE_INDEX = {slices: index for index, slices in _PROFILE_SLICES.items()}
_HANDLE_BASE = 0x6D16_0000_0000  # fake instance handle addresses (never dereferenced)
_CREATED_GI, _CREATED_CI, _STATIC_GI, _STATIC_CI = 1, 2, 3, 4


@dataclass
class _CreatedGi:
    profile: MigProfileSpec
    start: int
    size: int


@dataclass
class _CreatedCi:
    profile_id: int
    slot: int


@dataclass
class _Created:
    """The GPU and compute instances created on one GPU: GI ID -> GI, (GI ID, CI ID) -> CI."""

    gis: dict[int, _CreatedGi] = field(default_factory=dict)
    cis: dict[tuple[int, int], _CreatedCi] = field(default_factory=dict)
    resets: int = 0  # the GPU's resets so far (state/<uuid>/resets): part of its MIG devices' UUIDs

    def copy(self) -> _Created:
        return _Created(dict(self.gis), dict(self.cis), self.resets)


@dataclass(frozen=True)
class _InstanceRef:
    """What an instance handle names: a created GI/CI (``gi``, ``ci``) or an inventory one (the MIG
    device in ``slot``), on GPU ``index``."""

    index: int
    created: bool
    gi: int = 0
    ci: int = 0
    slot: int = -1


@dataclass(frozen=True)
class GpuInstanceInfo:
    """pynvml.c_nvmlGpuInstanceInfo_t's fields; ``device`` is this simulator's handle, which a ctypes
    structure cannot hold."""

    device: _Handle
    id: int
    profileId: int
    placement: Any  # c_nvmlGpuInstancePlacement_t


@dataclass(frozen=True)
class ComputeInstanceInfo:
    """pynvml.c_nvmlComputeInstanceInfo_t's fields (``device`` as in :class:`GpuInstanceInfo`)."""

    device: _Handle
    gpuInstance: Any  # c_nvmlGpuInstance_t
    id: int
    profileId: int
    placement: Any  # c_nvmlComputeInstancePlacement_t


def _instance_handle(ctype: Any, kind: int, index: int, a: int, b: int = 0) -> Any:
    """A ``c_nvmlGpuInstance_t`` / ``c_nvmlComputeInstance_t`` as pynvml returns one (so an array of
    them holds it), whose address names the instance: created GI ``a`` (and CI ``b``), or the inventory
    MIG device in slot ``a``."""
    return ctypes.cast(ctypes.c_void_p(_HANDLE_BASE | kind << 28 | index << 16 | a << 8 | b), ctype)


def _decode_instance(handle: Any, compute: bool) -> _InstanceRef | None:
    try:
        address = ctypes.cast(handle, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        return None
    if not address or address & ~0xFFFF_FFFF != _HANDLE_BASE:
        return None
    kind, index, a, b = address >> 28 & 0xF, address >> 16 & 0xFF, address >> 8 & 0xFF, address & 0xFF
    if kind == (_CREATED_CI if compute else _CREATED_GI):
        return _InstanceRef(index, True, gi=a, ci=b)
    if kind == (_STATIC_CI if compute else _STATIC_GI):
        return _InstanceRef(index, False, slot=a)
    return None


def _parse_instances(text: str, catalog: MigCatalog) -> _Created:
    """The state file (format: tests/mocknvml/mock_nvml.c); lines it cannot use are skipped, as there."""
    created = _Created()
    for line in text.splitlines():
        words = line.split()
        if len(words) != 5 or not all(w.isdigit() for w in words[1:]):
            continue
        a, b, c, d = (int(w) for w in words[1:])
        if words[0] == "gi" and a < _MAX_GIS:
            spec = catalog.by_id(b)
            if spec is not None and d == spec.placement_size and c + d <= catalog.memory_slices:
                created.gis[a] = _CreatedGi(spec, c, d)
        elif words[0] == "ci" and a < _MAX_GIS and b < _MAX_CIS and a in created.gis and d < _MAX_MIG_SLOTS:
            created.cis[(a, b)] = _CreatedCi(c, d)
    return created


def _read_resets(directory: Path) -> int:
    try:
        return int((directory / "resets").read_text())
    except (FileNotFoundError, ValueError):
        return 0


def _write_resets(directory: Path, resets: int) -> None:
    """``resets`` replaced atomically, as the mocks' value files are (tests/mocknvml/mock_state.h)."""
    tmp = directory / f".resets.{os.getpid()}"
    tmp.write_text(f"{resets}\n")
    os.replace(tmp, directory / "resets")


def _format_instances(uuid: str, created: _Created) -> str:
    lines = [f"# gpudra mock NVML: MIG instances created on {uuid} (tests/mocknvml/mock_nvml.c)"]
    for gi, g in sorted(created.gis.items()):
        lines.append(f"gi {gi} {g.profile.id} {g.start} {g.size}")
        lines += [f"ci {gi} {ci} {c.profile_id} {c.slot}" for (g2, ci), c in sorted(created.cis.items()) if g2 == gi]
    return "\n".join(lines) + "\n"


def _error_for(exc: OSError) -> pynvml.NVMLError:
    import errno

    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return pynvml.NVMLError_NoPermission()
    return pynvml.NVMLError_Unknown()


def tree_gpu_instance_id(memory_slices: int, start: int, size: int) -> int | None:
    """The GPU instance ID NVML gives a placement: its node in the binary tree of the memory slices,
    ``(memory_slices/size - 1) + start/size`` (the full GPU 0, halves 1-2, quarters 3-6, eighths
    7-14), as ``nvidia-smi mig -lgi`` shows on real GPUs; None where the placement is no such node."""
    if size <= 0 or memory_slices % size or start % size:
        return None
    n = memory_slices // size
    if n & (n - 1):
        return None
    gi = n - 1 + start // size
    return gi if gi < _MAX_GIS else None


def _tree_placement(memory_slices: int, gi: int) -> tuple[int, int] | None:
    n = 1
    while 2 * n - 1 <= gi:
        n *= 2
    if memory_slices % n:
        return None
    size = memory_slices // n
    return (gi - (n - 1)) * size, size


def _static_placement(gpu: GpuSpec, mig: MigSpec) -> tuple[int, int] | None:
    """The memory slices an inventory GPU instance occupies, as its ID says (the tree), where that
    placement has its catalog profile's size; None otherwise."""
    catalog = gpu.mig_catalog
    spec = catalog.by_name(gpu_instance_profile(mig.profile)) if catalog else None
    placed = _tree_placement(catalog.memory_slices, mig.gpu_instance_id) if catalog and spec else None
    return placed if spec and placed and placed[1] == spec.placement_size else None


def _first_slot_of_gi(gpu: GpuSpec, gi: int) -> int | None:
    return next((slot for slot, mig in sorted(gpu.migs.items()) if mig.gpu_instance_id == gi), None)


def _fits(gpu: GpuSpec, catalog: MigCatalog, created: _Created, spec: MigProfileSpec, start: int) -> int | None:
    """The GPU instance ID ``spec`` at ``start`` gets beside the GPU's instances (inventory and
    created), or None where it does not fit (INSUFFICIENT_RESOURCES): overlapping memory slices, the
    profile's instanceCount reached, or more compute slices or engines than the GPU has (its full
    profile's)."""
    full = max(catalog.profiles, key=lambda p: (p.slices, p.placement_size))
    used: list[tuple[MigProfileSpec, tuple[int, int] | None]] = []
    static_gis = set()
    for slot, mig in sorted(gpu.migs.items()):
        if mig.gpu_instance_id in static_gis:
            continue
        static_gis.add(mig.gpu_instance_id)
        known = catalog.by_name(gpu_instance_profile(mig.profile))
        if known is None:  # compute slices only
            used.append((MigProfileSpec("?", -1, -1, mig.attributes.get("gpuInstanceSliceCount", 0), 1, 0, 0, 0, 0,
                                        0, 0, 0, (0,), 1), None))
        else:
            placed = _static_placement(gpu, mig)
            used.append((known, placed if placed and placed[0] + placed[1] <= catalog.memory_slices else None))
    used += [(g.profile, (g.start, g.size)) for g in created.gis.values()]
    if sum(p == spec for p, _ in used) >= spec.instances:
        return None
    mine = set(range(start, start + spec.placement_size))
    if any(placed and mine & set(range(placed[0], placed[0] + placed[1])) for _, placed in used):
        return None
    for attr, total in (("slices", catalog.compute_slices), ("copy_engines", full.copy_engines),
                        ("decoders", full.decoders), ("encoders", full.encoders), ("jpeg", full.jpeg),
                        ("ofa", full.ofa)):
        if sum(getattr(p, attr) for p, _ in used) + getattr(spec, attr) > total:
            return None
    taken = static_gis | set(created.gis)
    gi = tree_gpu_instance_id(catalog.memory_slices, start, spec.placement_size)
    if gi is None:
        gi = next((i for i in range(1, _MAX_GIS) if i not in taken), None)
    return None if gi is None or gi in taken else gi


def creatable_instances(catalog: MigCatalog) -> dict[int, int]:
    """GPU instance ID -> the most compute slices a GPU instance with that ID can have: every GPU
    instance the simulators can create on a GPU with this catalog (its compute instances are IDs 0 to
    that many minus one on a real GPU)."""
    out: dict[int, int] = {}
    for spec in catalog.profiles:
        for start in spec.placement_starts:
            gi = tree_gpu_instance_id(catalog.memory_slices, start, spec.placement_size)
            for i in ([gi] if gi is not None else range(1, _MAX_GIS)):
                out[i] = max(out.get(i, 0), spec.slices)
    return out


def _fnv1a64(data: bytes, h: int) -> int:
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFF_FFFF_FFFF_FFFF
    return h


def mig_uuid(parent_uuid: str, gi: int, ci: int, resets: int = 0) -> str:
    """The UUID of a created MIG device: MIG-<8-4-4-4-12 hex> from FNV-1a 64 over ``<parent>/<gi>/<ci>``
    (``<parent>/<gi>/<ci>/<resets>`` once the GPU was reset: an instance made again has another UUID)
    (twice, the second continuing with ``#``), version nibble 5, variant 10 — the mock library's."""
    text = (f"{parent_uuid}/{gi}/{ci}" + (f"/{resets}" if resets else "")).encode()
    h1 = _fnv1a64(text, 0xCBF29CE484222325)
    h2 = _fnv1a64(b"#", _fnv1a64(text, h1))
    x = f"{h1:016x}{h2:016x}"
    x = x[:12] + "5" + x[13:16] + "89ab"[int(x[16], 16) & 3] + x[17:]
    return f"MIG-{x[:8]}-{x[8:12]}-{x[12:16]}-{x[16:20]}-{x[20:]}"


def _in_struct(ref: Any) -> Any:
    """An in-argument structure as a caller may pass it (the structure, ``byref`` or a pointer);
    ``InvalidArgument`` for NULL."""
    obj = getattr(ref, "_obj", ref)
    if isinstance(obj, ctypes._Pointer):
        if not obj:
            raise pynvml.NVMLError_InvalidArgument()
        obj = obj.contents
    if not isinstance(obj, ctypes.Structure) or not hasattr(obj, "start") or not hasattr(obj, "size"):
        raise pynvml.NVMLError_InvalidArgument()
    return obj
