"""Changing a GPU's sharing settings (I/O): the compute mode through NVML, the time slice with the
driver root's ``nvidia-smi``, since nvidia-ml-py has no setter for it (NVIDIA's driver does the
same: ``nvidia-smi compute-policy -i <uuid> --set-timeslice <0-3>``).

``nvidia-smi`` loads ``libnvidia-ml.so.1`` by its soname, which the agent's image does not have on
its loader path (the agent opens the driver root's NVML by full path): the root's library is
preloaded for it, as NVIDIA's driver does. The calls block (a driver call, a process): the plugin
runs them off the event loop, and a process that outlives its timeout is killed and waited for a
bounded time, so a GPU stuck in the driver cannot hang the agent.

Every failure is a :class:`GpuControlError` naming the GPU and what failed: a per-claim error for a
prepare; for a reset, the GPU stays recorded as changed in the checkpoint and start-up tries again
(:mod:`.state`)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpudra_driver.plugin.sharing.plan import GpuSettings

SMI_TIMEOUT = 10.0  # seconds; a hung driver call must not hold the node lock past the kubelet's budget
KILL_WAIT = 5.0  # seconds to wait for a killed nvidia-smi; one in uninterruptible sleep is left behind


class GpuControlError(RuntimeError):
    pass


class GpuControl:
    def __init__(self, load_nvml: Callable[[], Any], nvidia_smi: Path,
                 nvml_library: Callable[[], Path | None] = lambda: None) -> None:
        """``load_nvml``: the agent's NVML (pynvml against the driver root, or the simulator);
        ``nvidia_smi``: its path as this process sees it (inside the driver root);
        ``nvml_library``: the root's libnvidia-ml, to preload for nvidia-smi (None: none)."""
        self.load_nvml = load_nvml
        self.nvidia_smi = nvidia_smi
        self.nvml_library = nvml_library

    def apply(self, uuid: str, settings: GpuSettings) -> None:
        self._set_compute_mode(uuid, settings.compute_mode)
        self._set_timeslice(uuid, settings.timeslice)

    def _set_compute_mode(self, uuid: str, mode: int) -> None:
        try:
            nvml = self.load_nvml()
            nvml.nvmlInit()
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
                if nvml.nvmlDeviceGetComputeMode(handle) != mode:
                    nvml.nvmlDeviceSetComputeMode(handle, mode)
            finally:
                nvml.nvmlShutdown()
        except Exception as error:  # NVMLError and its subclasses, NvmlUnavailable
            raise GpuControlError(f"GPU {uuid}: setting its compute mode to {mode} through NVML failed: "
                                  f"{error}") from None

    def _set_timeslice(self, uuid: str, level: int) -> None:
        command = [str(self.nvidia_smi), "compute-policy", "-i", uuid, "--set-timeslice", str(level)]
        env = dict(os.environ)
        try:
            if (library := self.nvml_library()) is not None:
                env["LD_PRELOAD"] = str(library)
        except (OSError, RuntimeError):  # no library found (DriverRootError): nvidia-smi says what it misses
            pass
        try:
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                       close_fds=True)
        except OSError as error:
            raise GpuControlError(f"GPU {uuid}: {' '.join(command)} failed: {error}") from None
        try:
            out, err = process.communicate(timeout=SMI_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            try:
                process.communicate(timeout=KILL_WAIT)
            except subprocess.TimeoutExpired:
                pass
            raise GpuControlError(f"GPU {uuid}: {' '.join(command)} did not finish within {SMI_TIMEOUT:g}s "
                                  "(the GPU may be stuck in the driver)") from None
        if process.returncode != 0:
            detail = (err or out or b"").decode(errors="replace").strip().splitlines()
            raise GpuControlError(f"GPU {uuid}: {' '.join(command)} exited {process.returncode}"
                                  + (f": {detail[-1]}" if detail else ""))
