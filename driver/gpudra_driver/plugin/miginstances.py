"""Dynamic MIG instances through NVML (I/O): a GPU instance at the placement the scheduler
allocated and its one full-size compute instance, created at prepare and destroyed at unprepare.

Every call is idempotent, so a prepare or unprepare repeated after a crash ends in the same state:
- create reuses the GPU instance already at the placement with the same profile (a crashed
  prepare's, which the checkpoint recorded as this claim's intent before NVML was called), and
  its compute instance;
- destroy finds the instance by the recorded IDs, or by the placement where none were recorded
  yet, and treats "not there" as done. It destroys only an instance whose profile and placement
  are the ones recorded, and, where a MIG device UUID was recorded, whose UUID it is: a GPU reset
  or a driver reload destroys every instance (:mod:`.migrepair`), and NVML may give the same IDs
  at the same place to one someone else makes afterwards, which is never touched.

The calls block in the driver: the plugin runs them off the event loop, under the node lock. Each
failure is a :class:`MigInstanceError` naming the GPU and what failed: a per-claim error."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Literal

from gpudra_driver.plugin.devicenodes import CAPS_DIR, CapMinor
from gpudra_driver.plugin.model import MigPlacement

# Whether a prepared claim's recorded instance is there (:meth:`MigInstances.state`)
InstanceState = Literal["present", "missing", "foreign"]


class MigInstanceError(RuntimeError):
    pass


class MigInstances:
    def __init__(self, load_nvml: Callable[[], Any], cap_minor: CapMinor) -> None:
        """``load_nvml``: the agent's NVML (pynvml on the driver root, or the simulator);
        ``cap_minor``: the capability device minor of a GPU or compute instance."""
        self.load_nvml = load_nvml
        self.cap_minor = cap_minor

    def create(self, placement: MigPlacement) -> tuple[MigPlacement, str, tuple[str, ...]]:
        """The instance at ``placement``, made if missing: the placement with its IDs, the MIG
        device's UUID and its device nodes (container paths: the parent GPU's node and the
        instance's two capability nodes)."""
        where = _where(placement)
        with self._nvml(f"creating the MIG instance {where}") as nvml:
            handle = nvml.nvmlDeviceGetHandleByUUID(placement.parent_uuid)
            profile_id, slices = _profile(nvml, handle, placement.profile)
            gi = _gpu_instance_at(nvml, handle, profile_id, placement.start)
            if gi is None:
                spot = nvml.c_nvmlGpuInstancePlacement_t(placement.start, placement.size)
                gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, profile_id, ctypes.byref(spot))
            try:
                ci_profile = _full_compute_profile(nvml, gi, slices)
                cis = _compute_instances(nvml, gi, ci_profile)
                ci = cis[0] if cis else nvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile)
                gi_id = int(nvml.nvmlGpuInstanceGetInfo(gi).id)
                ci_id = int(nvml.nvmlComputeInstanceGetInfo(ci).id)
                uuid = _mig_device_uuid(nvml, handle, gi_id, ci_id)
            except Exception:
                _destroy(nvml, gi, slices)  # nothing half made stays: this call made it, or a crashed one did
                raise
        made = replace(placement, gi=gi_id, ci=ci_id)
        minor = placement.parent_minor
        nodes = (f"/dev/nvidia{minor}", f"{CAPS_DIR}/nvidia-cap{self.cap_minor(minor, gi_id, None)}",
                 f"{CAPS_DIR}/nvidia-cap{self.cap_minor(minor, gi_id, ci_id)}")
        return made, uuid, nodes

    def destroy(self, placement: MigPlacement, uuid: str = "") -> bool:
        """The instance at ``placement`` destroyed (compute instances first); False when there was
        none, or none that is the one recorded (IDs, and ``uuid``: the MIG device's, when known).
        Raises when it is still in use (a process on it: NVML answers IN_USE)."""
        with self._nvml(f"destroying the MIG instance {_where(placement)}") as nvml:
            handle = nvml.nvmlDeviceGetHandleByUUID(placement.parent_uuid)
            profile_id, slices = _profile(nvml, handle, placement.profile)
            gi = _gpu_instance_at(nvml, handle, profile_id, placement.start)
            if gi is None or _foreign(nvml, handle, gi, placement, uuid):
                return False
            _destroy(nvml, gi, slices)
            return True

    def state(self, placement: MigPlacement, uuid: str) -> InstanceState:
        """Whether a prepared claim's instance is there: ``present`` (its profile at its placement,
        with the recorded IDs and MIG device UUID ``uuid``); ``missing`` (none of its profile
        there: a GPU reset or a driver reload destroyed it; or no IDs recorded yet: :meth:`create`
        makes it or takes over the one a crashed call made); ``foreign`` (one of its profile there
        that is not the one recorded: someone else made it since)."""
        with self._nvml(f"looking up the MIG instance {_where(placement)}") as nvml:
            handle = nvml.nvmlDeviceGetHandleByUUID(placement.parent_uuid)
            profile_id, _ = _profile(nvml, handle, placement.profile)
            gi = _gpu_instance_at(nvml, handle, profile_id, placement.start)
            if gi is None or not placement.created:
                return "missing"
            if _foreign(nvml, handle, gi, placement, uuid):
                return "foreign"
            return "present" if _listed_uuid(nvml, handle, placement) is not None else "missing"

    def _nvml(self, doing: str) -> Any:
        return nvml_session(self.load_nvml, doing)


@contextmanager
def nvml_session(load_nvml: Callable[[], Any], doing: str) -> Iterator[Any]:
    """One NVML session for a MIG change (``doing``, for the error): every failure, starting NVML
    included, is a :class:`MigInstanceError` naming what was being done; NVML is shut down after."""
    try:
        nvml = load_nvml()
        nvml.nvmlInit()
    except Exception as error:  # NvmlUnavailable, NVMLError
        raise MigInstanceError(f"{doing}: NVML failed to start: {error}") from None
    try:
        yield nvml
    except MigInstanceError:
        raise
    except nvml.NVMLError as error:
        raise MigInstanceError(f"{doing}: {_named(error)}") from None
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass


def _where(placement: MigPlacement) -> str:
    return (f"{placement.profile} at memory slice {placement.start} of GPU {placement.parent_uuid}"
            + (f" (GPU instance {placement.gi})" if placement.gi is not None else ""))


def _named(error: Exception) -> str:
    return f"{type(error).__name__.removeprefix('NVMLError_')}: {error}"


def _profile(nvml: Any, handle: Any, name: str) -> tuple[int, int]:
    """(profile ID, compute slices) of the GPU instance profile named ``name`` on this GPU."""
    for index in range(int(getattr(nvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", 18))):
        try:
            info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, index)
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_InvalidArgument):
            continue
        text = info.name.decode() if isinstance(info.name, bytes) else str(info.name)
        if text.removeprefix("MIG ").strip() == name:
            return int(info.id), int(info.sliceCount)
    raise MigInstanceError(f"GPU has no MIG profile {name!r} (NVML lists its profiles)")


def _gpu_instance_at(nvml: Any, handle: Any, profile_id: int, start: int) -> Any:
    """The GPU instance of ``profile_id`` at memory slice ``start``, or None."""
    count = ctypes.c_uint(0)
    found = (nvml.c_nvmlGpuInstance_t * 8)()
    count.value = len(found)
    nvml.nvmlDeviceGetGpuInstances(handle, profile_id, found, ctypes.byref(count))
    for gi in found[: count.value]:
        if int(nvml.nvmlGpuInstanceGetInfo(gi).placement.start) == start:
            return gi
    return None


def _full_compute_profile(nvml: Any, gi: Any, slices: int) -> int:
    """The compute instance profile that takes the whole GPU instance."""
    for index in range(int(getattr(nvml, "NVML_COMPUTE_INSTANCE_PROFILE_COUNT", 9))):
        try:
            info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, index, 0)
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_InvalidArgument):
            continue
        if int(info.sliceCount) == slices:
            return int(info.id)
    raise MigInstanceError(f"no compute instance profile of {slices} slice(s) on the GPU instance")


def _compute_instances(nvml: Any, gi: Any, profile_id: int) -> list[Any]:
    count = ctypes.c_uint(0)
    found = (nvml.c_nvmlComputeInstance_t * 8)()
    count.value = len(found)
    nvml.nvmlGpuInstanceGetComputeInstances(gi, profile_id, found, ctypes.byref(count))
    return list(found[: count.value])


def _destroy(nvml: Any, gi: Any, slices: int) -> None:
    """The GPU instance and its compute instance (the full-size one, the only kind gpudra makes:
    should another exist, NVML refuses the GPU instance's destruction with IN_USE)."""
    for ci in _compute_instances(nvml, gi, _full_compute_profile(nvml, gi, slices)):
        nvml.nvmlComputeInstanceDestroy(ci)
    nvml.nvmlGpuInstanceDestroy(gi)


def _foreign(nvml: Any, handle: Any, gi: Any, placement: MigPlacement, uuid: str) -> bool:
    """Whether GPU instance ``gi``, at ``placement``'s place, is not the instance recorded there:
    another GPU instance ID, or another MIG device UUID than ``uuid`` (when IDs and a UUID were
    recorded: the same IDs at the same place are what NVML gives any instance made there again)."""
    if placement.gi is None:
        return False  # no IDs recorded yet: a crashed prepare's, found by its place
    if int(nvml.nvmlGpuInstanceGetInfo(gi).id) != placement.gi:
        return True
    listed = _listed_uuid(nvml, handle, placement) if uuid.startswith("MIG-") else None
    return listed is not None and listed != uuid


def _listed_uuid(nvml: Any, handle: Any, placement: MigPlacement) -> str | None:
    """The UUID of the MIG device of the recorded GPU and compute instance, None when NVML lists none."""
    if placement.gi is None or placement.ci is None:
        return None
    try:
        return _mig_device_uuid(nvml, handle, placement.gi, placement.ci)
    except MigInstanceError:
        return None


def _mig_device_uuid(nvml: Any, handle: Any, gi_id: int, ci_id: int) -> str:
    for slot in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except (nvml.NVMLError_NotFound, nvml.NVMLError_InvalidArgument):
            continue
        if (int(nvml.nvmlDeviceGetGpuInstanceId(mig)), int(nvml.nvmlDeviceGetComputeInstanceId(mig))) == (gi_id, ci_id):
            uuid = nvml.nvmlDeviceGetUUID(mig)
            return uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    raise MigInstanceError(f"the MIG device of GPU instance {gi_id}, compute instance {ci_id} is not listed by NVML")
