"""A dynamic MIG GPU's MIG mode, turned off for a claim of the whole GPU and on again (I/O, NVML).

A dynamic GPU rests with MIG mode on, so that placements are created at once. The scheduler gives
its whole GPU only while no placement is allocated (the whole GPU takes every counter of the GPU:
:mod:`gpudra_core.migpartitions`), and the kubelet prepares the claim before any of its containers
start and unprepares it after they have all stopped, so the switch never happens under a workload
of ours. NVML's ``nvmlDeviceSetMigMode`` changes the *pending* mode and tries to activate it: on
Hopper and later an idle GPU switches at once; on Ampere, or where the GPU is not idle, the change
stays pending until a GPU reset and the call's activation status says why (RESET_REQUIRED,
IN_USE). A switch that is only pending would leave the GPU unusable as a whole *and* as MIG
devices, so it is taken back at once and the claim refused.

Both calls are idempotent (the mode found is the mode wanted: nothing to do), so a prepare,
unprepare or rollback repeated after a crash ends in the same state. Failures are
:class:`~.miginstances.MigInstanceError`: per-claim errors naming the GPU and the reason."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

from gpudra_core.migpartitions import MigGeometry
from gpudra_driver.plugin.miginstances import MigInstanceError, nvml_session


class MigModeSwitch:
    def __init__(self, load_nvml: Callable[[], Any]) -> None:
        """``load_nvml``: the agent's NVML (pynvml on the driver root, or the simulator)."""
        self.load_nvml = load_nvml

    def turn_off(self, uuid: str) -> MigGeometry | None:
        """GPU ``uuid``'s MIG mode off, for a claim of its whole GPU. Returns its MIG geometry, read
        while MIG mode was still on (None where it was off already and NVML does not report it).
        Refused while the GPU has a GPU instance (a stale or foreign one: the scheduler gave the whole
        GPU, so none is a claim's), and where the switch would only be pending: the mode is then
        set back on."""
        from gpudra_driver.discovery import read_mig_geometry

        with self._nvml(f"turning MIG mode off on GPU {uuid} for a claim of the whole GPU") as nvml:
            handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
            current, pending = nvml.nvmlDeviceGetMigMode(handle)
            try:
                geometry: MigGeometry | None = read_mig_geometry(nvml, handle)
            except Exception as error:  # noqa: BLE001 - _CallFailed, ValueError
                if current == nvml.NVML_DEVICE_MIG_ENABLE:
                    raise MigInstanceError(f"GPU {uuid}: its MIG profiles cannot be read: {error}") from None
                geometry = None  # MIG mode off already (a crashed prepare's), and NVML does not report them
            if current == nvml.NVML_DEVICE_MIG_DISABLE and pending == nvml.NVML_DEVICE_MIG_DISABLE:
                return geometry
            if current == nvml.NVML_DEVICE_MIG_ENABLE and geometry is not None \
                    and (held := _gpu_instances(nvml, handle, geometry)):
                raise MigInstanceError(
                    f"GPU {uuid} has {held} MIG GPU instance(s) that no claim of its whole GPU may share (made by "
                    "someone else, or left by a claim whose unprepare was lost): its MIG mode stays on until "
                    "they are destroyed")
            status = nvml.nvmlDeviceSetMigMode(handle, nvml.NVML_DEVICE_MIG_DISABLE)
            if nvml.nvmlDeviceGetMigMode(handle)[0] != nvml.NVML_DEVICE_MIG_DISABLE:
                nvml.nvmlDeviceSetMigMode(handle, nvml.NVML_DEVICE_MIG_ENABLE)  # no change left pending
                raise MigInstanceError(
                    f"GPU {uuid}: turning MIG mode off would only be pending until a GPU reset (activation "
                    f"status {_status(nvml, status)}: the GPU needs a reset to switch MIG mode, as Ampere GPUs "
                    "do, or is not idle); MIG mode stays on: ask for its largest MIG profile instead")
            return geometry

    def turn_on(self, uuid: str) -> None:
        """GPU ``uuid``'s MIG mode on again, the claim of its whole GPU gone. Raises while it cannot
        be (a process still on the GPU): the claim then stays prepared, for a retry."""
        with self._nvml(f"turning MIG mode on again on GPU {uuid}") as nvml:
            handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
            if tuple(nvml.nvmlDeviceGetMigMode(handle)) == (nvml.NVML_DEVICE_MIG_ENABLE,) * 2:
                return
            status = nvml.nvmlDeviceSetMigMode(handle, nvml.NVML_DEVICE_MIG_ENABLE)
            if nvml.nvmlDeviceGetMigMode(handle)[0] != nvml.NVML_DEVICE_MIG_ENABLE:
                raise MigInstanceError(f"GPU {uuid}: MIG mode is not on again yet (activation status "
                                       f"{_status(nvml, status)}: a process may still use the GPU)")

    def _nvml(self, doing: str) -> Any:
        return nvml_session(self.load_nvml, doing)


def _gpu_instances(nvml: Any, handle: Any, geometry: MigGeometry) -> int:
    """How many GPU instances the GPU has, of any of its profiles."""
    total = 0
    for profile in geometry.profiles:
        count = ctypes.c_uint(0)
        found = (nvml.c_nvmlGpuInstance_t * 8)()
        count.value = len(found)
        nvml.nvmlDeviceGetGpuInstances(handle, profile.profile_id, found, ctypes.byref(count))
        total += count.value
    return total


def _status(nvml: Any, status: int) -> str:
    """An activation status (an nvmlReturn_t) by name: ``RESET_REQUIRED``, ``IN_USE``."""
    names = {getattr(nvml, n): n.removeprefix("NVML_ERROR_") for n in ("NVML_ERROR_RESET_REQUIRED", "NVML_ERROR_IN_USE",
                                                                       "NVML_ERROR_NOT_SUPPORTED", "NVML_SUCCESS")
             if hasattr(nvml, n)}
    return names.get(status, str(status))
