"""Which dynamic MIG instances a batch makes and unmakes, around the checkpoint's two phases: a
claim's placements are recorded (PrepareStarted) before :class:`.miginstances.MigInstances` is
asked to create them, so a crash anywhere leaves only instances a record names; those of a
prepare that did not complete are destroyed by whoever next holds the node lock (start-up, or a
live peer: :mod:`.rollback`), and those of an unprepared claim before its entry goes."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

from gpudra_driver.plugin.checkpoint import Checkpoint
from gpudra_core.migpartitions import geometry_to_json
from gpudra_driver.plugin.miginstances import MigInstanceError, MigInstances
from gpudra_driver.plugin.migmodeswitch import MigModeSwitch
from gpudra_driver.plugin.model import MigModeOff, PreparedClaim, PreparedDevice, PrepareResult

log = logging.getLogger(__name__)


class MigLifecycle:
    def __init__(self, instances: MigInstances | None, switch: MigModeSwitch | None = None) -> None:
        """``switch``: turns a dynamic GPU's MIG mode off for a claim of its whole GPU, and on again
        (None: such a claim fails); the same two phases as an instance's."""
        self.instances = instances
        self.switch = switch

    def create(self, planned: Sequence[PreparedClaim], results: dict[str, PrepareResult],
               fault: Callable[[str], None]) -> tuple[list[PreparedClaim], list[PreparedClaim]]:
        """(the claims with their instances made, the claims refused). A refused claim's answer is
        in ``results``, and what it made is destroyed again."""
        done: list[PreparedClaim] = []
        refused: list[PreparedClaim] = []
        for claim in planned:
            if not any(device.mig is not None or device.mig_mode_off is not None for device in claim.devices):
                done.append(claim)
                continue
            devices = []
            try:
                for device in claim.devices:
                    if device.mig_mode_off is not None:
                        devices.append(self._turn_off(device))
                        fault("after-mig-mode-off")
                        continue
                    if device.mig is None:
                        devices.append(device)
                        continue
                    if self.instances is None:
                        raise MigInstanceError("this agent has no NVML to create MIG instances with")
                    placement, uuid, nodes = self.instances.create(device.mig)
                    devices.append(dataclasses.replace(device, uuid=uuid, device_nodes=nodes, mig=placement))
                    fault("after-mig-instance")
            except MigInstanceError as error:
                results[claim.uid] = PrepareResult(error=f"{claim.ref}: {error}")
                self.destroy_quietly([claim])
                refused.append(claim)
                continue
            done.append(dataclasses.replace(claim, devices=tuple(devices)))
        return done, refused

    def _turn_off(self, device: PreparedDevice) -> PreparedDevice:
        """The whole GPU's MIG mode off; the device with the geometry read before, for its record."""
        if self.switch is None:
            raise MigInstanceError("this agent has no NVML to switch MIG mode with")
        geometry = self.switch.turn_off(device.uuid)
        return dataclasses.replace(device, mig_mode_off=MigModeOff(
            None if geometry is None else tuple(geometry_to_json(geometry))))

    def destroy_quietly(self, claims: Iterable[PreparedClaim]) -> None:
        """Best effort: the claims' instances destroyed, and the MIG mode their whole GPUs turned
        off on again; what fails is logged (its record, where one was written, lets the next start
        or call try again)."""
        for claim in claims:
            for device in claim.devices:
                if device.mig_mode_off is not None and self.switch is not None:
                    try:
                        self.switch.turn_on(device.uuid)
                    except MigInstanceError as error:
                        log.error("%s: %s", claim.ref, error)
                if device.mig is None or self.instances is None:
                    continue
                try:
                    self.instances.destroy(device.mig, device.uuid)
                except MigInstanceError as error:
                    log.error("%s: %s", claim.ref, error)

    def destroy_of(self, checkpoint: Checkpoint, uids: Sequence[str]) -> Mapping[str, str]:
        """The instances of these claims of ``checkpoint`` destroyed; claim UID -> why not, for each
        claim whose instance could not be (in use: a process still runs on it)."""
        failed: dict[str, str] = {}
        for uid in uids:
            entry = checkpoint.claims.get(uid)
            if entry is None:
                continue
            for device in entry.claim.devices:
                if device.mig_mode_off is not None and self.switch is not None:
                    try:
                        self.switch.turn_on(device.uuid)
                    except MigInstanceError as error:
                        failed[uid] = f"{entry.claim.ref}: {error}"
                if device.mig is None or self.instances is None:
                    continue
                try:
                    self.instances.destroy(device.mig, device.uuid)
                except MigInstanceError as error:
                    failed[uid] = f"{entry.claim.ref}: {error}"
        return failed

    def rolled_back(self, checkpoint: Checkpoint, uids: Iterable[str]) -> None:
        """Best effort: the instances of half-done prepares (``uids`` of ``checkpoint``) destroyed,
        found by their recorded placement where no IDs were recorded yet."""
        self.destroy_quietly(checkpoint.claims[uid].claim for uid in uids if uid in checkpoint.claims)
