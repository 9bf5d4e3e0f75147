"""GPU sharing on this node kept as the checkpoint says: the GPUs' sharing settings
(:mod:`.plan`, applied by :mod:`.apply`) and the claims' MPS daemons (:mod:`.mps.plan`, run by
:mod:`.mps.apply`). Both are node-wide side effects outside the CDI directory, so both are derived
from the one record of which claims hold which GPUs, and a prepare, an unprepare, a rollback and
start-up all converge them the same way. Called under the node lock, off the event loop (driver
calls and the MPS supervisor may block); the caller decides when the checkpoint is written."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from gpudra_driver.plugin.checkpoint import Checkpoint
from gpudra_driver.plugin.model import PreparedClaim, PrepareResult
from gpudra_driver.plugin.sharing import plan as gpusettings
from gpudra_driver.plugin.sharing.apply import GpuControl, GpuControlError
from gpudra_driver.plugin.sharing.mps import plan as mps
from gpudra_driver.plugin.sharing.mps.apply import MpsDaemons

log = logging.getLogger(__name__)


class SharingController:
    def __init__(self, gpu_control: GpuControl | None, mps_daemons: MpsDaemons) -> None:
        """``gpu_control``: None where the agent has no NVML (a claim asking for sharing then
        fails); ``mps_daemons``: the MPS supervisor's side of this node."""
        self.gpu_control = gpu_control
        self.mps = mps_daemons

    def apply(self, before: Checkpoint, planned: Sequence[PreparedClaim],
              results: dict[str, PrepareResult]) -> tuple[Checkpoint, list[PreparedClaim]]:
        """The GPU settings each planned claim's sharing asks for (:mod:`.gpusettings`), claim by
        claim: one that cannot be applied is that claim's error, its changes undone. Returns the
        checkpoint whose settings are now in effect and the claims to go on with."""
        current, ready = before, []
        for claim in planned:
            after = current.started(claim)
            wanted = gpusettings.changes(current, after)
            try:
                for uuid, settings in wanted.items():
                    self._control().apply(uuid, settings)
            except GpuControlError as error:
                results[claim.uid] = PrepareResult(error=f"{claim.ref}: {error}")
                self.settle(after, current)
                continue
            # its MPS daemon, once its GPUs are EXCLUSIVE_PROCESS (the daemon's server starts later)
            if mps.daemon_for(claim) is not None and (problem := self.converge_mps(after).get(claim.uid)):
                results[claim.uid] = PrepareResult(error=f"{claim.ref}: {problem}")
                self.converge_mps(current)
                self.settle(after, current)
                continue
            current = after
            ready.append(claim)
        return current, ready

    def converge_mps(self, checkpoint: Checkpoint) -> dict[str, str]:
        """The MPS daemons ``checkpoint``'s claims ask for, and no others (:mod:`.mps`), except that
        the daemons of adopted claims (a checkpoint recovered: their devices are unknown, their pods
        still run) stay as they are; claim UID -> why its daemon is not running."""
        return self.mps.converge(mps.wanted({uid: entry.claim for uid, entry in checkpoint.claims.items()}),
                                 keep=checkpoint.adopted.keys())

    def converge_mps_quietly(self, checkpoint: Checkpoint) -> None:
        """Best effort, after a failure or a rollback: a daemon left running is stopped by the next
        start's reconciliation (recovery)."""
        try:
            self.converge_mps(checkpoint)
        except OSError as error:
            log.warning("stopping MPS daemons of rolled-back claims failed: %s", error)

    def settle(self, before: Checkpoint, after: Checkpoint) -> set[str]:
        """Best effort: the GPU settings of ``after`` where they differ from ``before``'s. Returns
        the GPUs whose defaults are back; a failure is logged, and the GPU stays recorded as
        touched for the next start to converge (not retried per call: a GPU stuck in the driver
        would slow every call down)."""
        return self._apply(gpusettings.changes(before, after))

    def converge_gpus(self, checkpoint: Checkpoint) -> set[str]:
        """Every GPU ``checkpoint`` records as touched gets what its holders ask, or its defaults
        (start-up). Returns the GPUs whose defaults are back."""
        return self._apply(gpusettings.converge(checkpoint))

    def _apply(self, wanted: Mapping[str, gpusettings.GpuSettings]) -> set[str]:
        reset: set[str] = set()
        for uuid, settings in wanted.items():
            try:
                self._control().apply(uuid, settings)
            except GpuControlError as error:
                log.warning("%s; it stays recorded in the checkpoint for the next start", error)
                continue
            if settings == gpusettings.DEFAULTS:
                reset.add(uuid)
        return reset

    def _control(self) -> GpuControl:
        if self.gpu_control is None:
            raise GpuControlError("this agent was started without GPU control (no NVML): it cannot change "
                                  "a GPU's sharing settings")
        return self.gpu_control
