"""Prepared claims whose dynamic MIG instance is gone: made again at the recorded placement.

A GPU reset (``nvidia-smi -r``) or a reload of the NVIDIA kernel module destroys every MIG
instance of the GPU, while its MIG mode persists (NVIDIA's MIG user guide, "Deployment
Considerations": MIG mode, like ECC mode, persists until it is toggled; the instances themselves
are not kept). The checkpoint then names instances that are gone, for claims the kubelet holds as
prepared and whose placement the scheduler still counts as theirs. So the instance is made again
at the recorded placement, and the claim's CDI spec rewritten with its new UUID and capability
nodes: containers resolve CDI device names when they are created, so a container (re)started
from then on gets a working device. Done when the kubelet prepares the claim again (after a
kubelet restart: :meth:`.state.DeviceState.prepare`) and at agent start and every rescan
(:meth:`.state.DeviceState.check_mig_instances`), each time said in the log and, by the agent, in
Warning Events on the Node and the claim's pods (:class:`gpudra_driver.migevents.Reporter`).

The checkpoint transitions, under the node lock, for one claim (its entry stays PrepareCompleted
throughout: a PrepareStarted entry would be rolled back at start-up, its spec removed, while the
kubelet holds the claim as prepared and would not ask again):

1. the instance looked up by its recorded profile, placement, IDs and MIG device UUID
   (:meth:`.miginstances.MigInstances.state`): there, nothing to do; one of someone else's at the
   placement (made after the reset), the claim is left as it is and the reason reported; gone:
2. the entry written with the lost devices' instance IDs cleared (:func:`awaiting_instance`),
   before NVML is called. An entry in this state means "the instance of this profile at this
   placement, whatever its IDs": the next check or prepare makes it or takes over the one a crash
   left (:meth:`~.miginstances.MigInstances.create` reuses it), and an unprepare destroys it by its
   placement, as for a prepare that did not complete;
3. NVML makes the GPU and compute instance; the spec is rewritten; the entry records the new IDs,
   UUID and device nodes (:func:`remade`). A refusal (MIG mode off now, the placement overlapped)
   puts the entry back as it was (nothing of it exists, and its old UUID matches no instance, so
   its unprepare destroys nothing) and is reported.

:func:`lost_devices`, :func:`awaiting_instance`, :func:`remade` and :func:`message` are pure.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpudra_driver.plugin.checkpoint import COMPLETED, Checkpoint, CheckpointFile
from gpudra_driver.plugin.faults import FaultHook
from gpudra_driver.plugin.miginstances import InstanceState, MigInstanceError, MigInstances
from gpudra_driver.plugin.model import MigPlacement, PreparedClaim, PreparedDevice
from gpudra_driver.plugin.specs import ClaimSpecs

log = logging.getLogger(__name__)

LOST_REASON = "MigInstanceLost"  # the Warning Event's reason


@dataclass(frozen=True)
class Outcome:
    """What a check found for one claim: the devices whose instance was gone (made again unless
    ``error`` says why not), or held by an instance someone else made."""

    claim: PreparedClaim  # as recorded now (with the new instances' IDs when they were made)
    lost: tuple[str, ...]  # device names
    error: str | None = None


# -- the pure part --------------------------------------------------------------------------------

def has_mig(claim: PreparedClaim) -> bool:
    return any(device.mig is not None for device in claim.devices)


def lost_devices(claim: PreparedClaim, states: Mapping[str, InstanceState]) -> tuple[list[str], list[str]]:
    """(devices whose instance is gone, devices whose placement holds someone else's instance), by
    name, from each MIG device's :meth:`~.miginstances.MigInstances.state`."""
    gone = [d.device for d in claim.devices if d.mig is not None and states.get(d.device) == "missing"]
    foreign = [d.device for d in claim.devices if d.mig is not None and states.get(d.device) == "foreign"]
    return gone, foreign


def awaiting_instance(claim: PreparedClaim, devices: Iterable[str]) -> PreparedClaim:
    """The record written before NVML is asked to make ``devices``' instances again: their
    instance IDs cleared, so whatever NVML made at the placement is found by its place."""
    names = set(devices)
    return dataclasses.replace(claim, devices=tuple(
        dataclasses.replace(d, mig=dataclasses.replace(d.mig, gi=None, ci=None))
        if d.mig is not None and d.device in names else d for d in claim.devices))


def remade(claim: PreparedClaim, made: Mapping[str, tuple[MigPlacement, str, tuple[str, ...]]]) -> PreparedClaim:
    """The claim with the instances ``made`` (device name -> placement with its IDs, MIG device
    UUID, device nodes: what :meth:`~.miginstances.MigInstances.create` answers)."""
    def one(device: PreparedDevice) -> PreparedDevice:
        if device.device not in made:
            return device
        placement, uuid, nodes = made[device.device]
        return dataclasses.replace(device, mig=placement, uuid=uuid, device_nodes=nodes)

    return dataclasses.replace(claim, devices=tuple(one(d) for d in claim.devices))


def message(outcome: Outcome) -> str:
    """The log line and Event message for one claim."""
    claim = outcome.claim
    where = "; ".join(_described(d) for d in claim.devices if d.device in outcome.lost)
    head = (f"ResourceClaim {claim.ref.namespace}/{claim.ref.name}: the MIG instance of {where} is gone "
            "(a GPU reset or an NVIDIA driver reload destroys every MIG instance of the GPU)")
    if outcome.error is not None:
        return f"{head}; it could not be made again: {outcome.error}"
    uuids = ", ".join(d.uuid for d in claim.devices if d.device in outcome.lost)
    return (f"{head}; made again at its placement as {uuids}. Running containers lost the device: "
            "restart them (a restarted container gets the new instance)")


def _described(device: PreparedDevice) -> str:
    assert device.mig is not None
    return f"{device.device} ({device.mig.profile} at memory slice {device.mig.start} of GPU {device.mig.parent_uuid})"


def _recorded(checkpoint: Checkpoint, claim: PreparedClaim) -> Checkpoint:
    """``claim`` as its PrepareCompleted entry's content."""
    return checkpoint.started(claim).completed(claim.uid)


# -- the imperative part --------------------------------------------------------------------------

class MigRepair:
    def __init__(self, store: CheckpointFile, specs: ClaimSpecs, instances: MigInstances | None,
                 fault: FaultHook | None = None) -> None:
        self.store = store
        self.specs = specs
        self.instances = instances
        self.fault = fault or FaultHook()

    def repair(self, checkpoint: Checkpoint, uids: Iterable[str]) -> tuple[Checkpoint, list[Outcome]]:
        """For a caller holding the node lock: the instances of these completed claims of
        ``checkpoint`` made again where they are gone (each step saved, see the module docstring).
        Returns the checkpoint as saved, and what was found for each claim that had a lost instance."""
        outcomes: list[Outcome] = []
        for uid in uids:
            entry = checkpoint.claims.get(uid)
            if entry is None or entry.state != COMPLETED or not has_mig(entry.claim) or self.instances is None:
                continue
            checkpoint, outcome = self._repair_one(checkpoint, entry.claim)
            if outcome is not None:  # logged by whoever reports it (gpudra_driver.migevents)
                outcomes.append(outcome)
        return checkpoint, outcomes

    def _repair_one(self, checkpoint: Checkpoint, claim: PreparedClaim) -> tuple[Checkpoint, Outcome | None]:
        assert self.instances is not None
        try:
            states = {d.device: self.instances.state(d.mig, d.uuid) for d in claim.devices if d.mig is not None}
        except MigInstanceError as error:  # NVML down (a driver being reloaded): the next check tells
            log.warning("%s: cannot tell whether its MIG instance is there: %s", claim.ref, error)
            return checkpoint, None
        gone, foreign = lost_devices(claim, states)
        if foreign:
            return checkpoint, Outcome(claim, tuple(foreign), error=(
                "an instance someone else made holds its placement now; gpudra leaves it alone: destroy it "
                "(nvidia-smi mig -dci, -dgi) and gpudra makes the claim's again, or delete the claim's pods"))
        if not gone:
            return checkpoint, None
        before = checkpoint
        checkpoint = _recorded(checkpoint, awaiting_instance(claim, gone))
        self.store.save(checkpoint)  # the record before NVML is called
        made: dict[str, tuple[MigPlacement, str, tuple[str, ...]]] = {}
        try:
            for device in claim.devices:
                if device.device in gone:
                    assert device.mig is not None
                    made[device.device] = self.instances.create(dataclasses.replace(device.mig, gi=None, ci=None))
                    self.fault("after-mig-instance")  # made, its IDs not recorded: found by its place
        except MigInstanceError as error:
            for placement, uuid, _ in made.values():  # none of this claim's half: all or nothing
                try:
                    self.instances.destroy(placement, uuid)
                except MigInstanceError as undo:
                    log.error("%s: %s", claim.ref, undo)
            self.store.save(before)  # as it was: its instances gone, the old UUIDs match nothing
            return before, Outcome(claim, tuple(gone), error=str(error))
        fixed = remade(claim, made)
        try:
            self.specs.write_files(fixed)  # its metadata files name the new instance
        except OSError as error:  # recorded anyway: the instance exists; start-up rewrites a stale spec
            log.error("%s: rewriting its CDI spec for the new MIG instance failed: %s", claim.ref, error)
        checkpoint = _recorded(checkpoint, fixed)
        self.store.save(checkpoint)
        return checkpoint, Outcome(fixed, tuple(gone))
