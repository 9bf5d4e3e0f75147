"""Changing a GPU's sharing settings (I/O): the compute mode through NVML, the time slice with the
driver root's ``nvidia-smi``, since nvidia-ml-py has no setter for it (NVIDIA's driver does the
same: ``nvidia-smi compute-policy -i <uuid> --set-timeslice <0-3>``).

Every failure is a :class:`GpuControlError` naming the GPU and what failed: a per-claim error for a
prepare, a warning for an unprepare (the kubelet retries it, and a retry applies the settings
again)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpudra_driver.plugin.gpusettings import GpuSettings

SMI_TIMEOUT = 15.0  # seconds; a hung driver call must not hold the node lock past the kubelet's budget


class GpuControlError(RuntimeError):
    pass


class GpuControl:
    def __init__(self, load_nvml: Callable[[], Any], nvidia_smi: Path,
                 run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run) -> None:
        """``load_nvml``: the agent's NVML (pynvml against the driver root, or the simulator);
        ``nvidia_smi``: its path as this process sees it (inside the driver root)."""
        self.load_nvml = load_nvml
        self.nvidia_smi = nvidia_smi
        self.run = run

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
        try:
            done = self.run(command, capture_output=True, text=True, timeout=SMI_TIMEOUT, check=False)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise GpuControlError(f"GPU {uuid}: {' '.join(command)} failed: {error}") from None
        if done.returncode != 0:
            detail = (done.stderr or done.stdout or "").strip().splitlines()
            raise GpuControlError(f"GPU {uuid}: {' '.join(command)} exited {done.returncode}"
                                  + (f": {detail[-1]}" if detail else ""))
