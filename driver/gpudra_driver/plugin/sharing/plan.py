"""What the GPUs' sharing settings must be, given the checkpoint (pure).

A GPU's compute mode and time slice are node-wide state outside the CDI directory: the agent sets
them for the claims that ask (TimeSlicing) and puts them back when the last such claim is gone.
The agent derives the settings every GPU should have from the checkpoint, the one record of which
claims hold which GPUs, and applies the difference between two checkpoints: before and after a
prepare, an unprepare, or a rollback. PrepareStarted entries count as holders. The checkpoint also
records which GPUs were moved away from their defaults (``touched``), before they are changed,
and forgets one only once its defaults are back: a crash at any point, or a reset that failed,
leaves the GPU recorded, and start-up converges it (:func:`converge`). The compute mode goes back
to DEFAULT, not to what it was before: gpudra manages the sharing settings of the GPUs it
publishes.

MPS asks for compute mode EXCLUSIVE_PROCESS (see :func:`device_settings`); its control daemons
are :mod:`.mps`'s. Time-slicing is for whole GPUs: a MIG device is isolated by the hardware and has no time slice of
its own (``nvidia-smi compute-policy`` refuses MIG devices).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpudra_driver.plugin.checkpoint import Checkpoint
from gpudra_driver.plugin.model import MPS, TIME_SLICING, PreparedDevice

COMPUTE_MODE_DEFAULT = 0  # NVML_COMPUTEMODE_DEFAULT
COMPUTE_MODE_EXCLUSIVE_PROCESS = 3  # NVML_COMPUTEMODE_EXCLUSIVE_PROCESS: one context, the MPS server's
TIMESLICE_DEFAULT = 0  # nvidia-smi compute-policy --set-timeslice 0: the driver's default


@dataclass(frozen=True)
class GpuSettings:
    compute_mode: int = COMPUTE_MODE_DEFAULT
    timeslice: int = TIMESLICE_DEFAULT


DEFAULTS = GpuSettings()


class SettingsConflict(ValueError):
    """Claims sharing one GPU ask for settings that cannot hold together."""


def wanted(checkpoint: Checkpoint) -> dict[str, GpuSettings]:
    """GPU UUID -> the settings its holders ask for; GPUs nobody asks anything of are absent."""
    asked: dict[str, GpuSettings] = {}
    for entry in checkpoint.claims.values():
        if not entry.shares_gpus:  # an exclusive device asks nothing of its GPU
            continue
        for device in entry.claim.devices:
            settings = device_settings(device)
            if settings is not None:
                asked[device.uuid] = settings  # conflicts are refused when planning (see conflict())
    return asked


def device_settings(device: PreparedDevice) -> GpuSettings | None:
    """The settings ``device``'s sharing asks of its GPU; None when it asks nothing.

    MPS on a whole GPU asks for EXCLUSIVE_PROCESS, so that the claim's MPS server is the GPU's
    only context (NVIDIA's MPS guide recommends it; a process that bypasses MPS then fails instead
    of sharing the GPU unlimited). Not for a share of a GPU (consumable capacity): other claims'
    servers must run on it too, each time-sliced with the others and held to its own limits; nor
    for a MIG device, whose compute mode is its parent's."""
    if device.admin_access:
        return None
    if device.sharing.strategy == TIME_SLICING:
        return GpuSettings(COMPUTE_MODE_DEFAULT, device.sharing.timeslice or TIMESLICE_DEFAULT)
    if device.sharing.strategy == MPS and device.share_id is None and device.uuid.startswith("GPU-"):
        return GpuSettings(COMPUTE_MODE_EXCLUSIVE_PROCESS)
    return None


def changes(before: Checkpoint, after: Checkpoint) -> dict[str, GpuSettings]:
    """GPU UUID -> the settings to apply to go from ``before`` to ``after``: new or changed wishes,
    and the defaults back where nobody asks any more."""
    old, new = wanted(before), wanted(after)
    result = {uuid: settings for uuid, settings in new.items() if old.get(uuid) != settings}
    result.update((uuid, DEFAULTS) for uuid in old if uuid not in new)
    return result


def touches(before: Checkpoint, after: Checkpoint) -> set[str]:
    """GPUs the step from ``before`` to ``after`` moves away from their defaults: to be recorded in
    the checkpoint (``touched``) before they are changed."""
    return {uuid for uuid, settings in changes(before, after).items() if settings != DEFAULTS}


def converge(checkpoint: Checkpoint) -> dict[str, GpuSettings]:
    """What every GPU the checkpoint records as touched must get: its holders' settings, or the
    defaults (start-up, after a crash or a reset that failed)."""
    asked = wanted(checkpoint)
    return {uuid: asked.get(uuid, DEFAULTS) for uuid in checkpoint.touched}


def conflict(device: PreparedDevice, others: Mapping[str, PreparedDevice]) -> str | None:
    """Why ``device``'s settings cannot join those of the other claims (claim UID -> their entry
    for the same GPU) holding it; None when they can."""
    mine = device_settings(device)
    for uid, other in others.items():
        theirs = device_settings(other)
        if mine is not None and theirs is not None and mine != theirs:
            return (f"claim {uid} already runs GPU {device.device} with {_describe(theirs)}; "
                    f"this claim asks for {_describe(mine)}")
    return None


def _describe(settings: GpuSettings) -> str:
    if settings.compute_mode == COMPUTE_MODE_EXCLUSIVE_PROCESS:
        return "compute mode EXCLUSIVE_PROCESS (MPS)"
    return f"time slice {settings.timeslice}"
