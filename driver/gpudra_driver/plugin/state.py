"""Prepare and unprepare on this node: the order of their steps, which is what makes them crash
safe (the role of dra-example-driver's device_state.go). Start-up is :mod:`.recovery`. Each step's
own concern is a class of its own, composed here: whose turn it is (:mod:`.calllocks`), the queue
of prepare calls (:mod:`.batching`), the CDI specs (:mod:`.specs`), GPU sharing settings and MPS
daemons (:mod:`gpudra_driver.plugin.sharing.controller`), undoing unfinished prepares (:mod:`.rollback`).

Each claim is read first (:func:`.allocation.read_claim`: tenant input, bounded and decoded
before any lock, so a bad claim costs its neighbours nothing). Then one call at a time per agent
(an asyncio lock), and one agent instance at a time per node (the node lock, a flock: during a
rolling update two instances serve side by side). Under both, a prepare of a batch of claims (one
or more kubelet calls):

1. reads the checkpoint (another instance may have changed it) and rolls back half-done prepares
   a crashed instance left (found under the lock, PrepareStarted entries cannot be a live one's);
   a checkpoint found corrupt is set aside and the CDI specs adopted, as at start-up
   (:meth:`.recovery.Recovery.reconcile`), so the node serves on without a restart;
2. plans each claim (pure, :func:`plan_prepare`); an already completed claim is answered again;
3. writes the checkpoint with the new claims as PrepareStarted (and the GPUs whose sharing settings
   they change as touched), only if the batch does something outside the CDI directory or replaces
   an entry (:func:`.plan.needs_prepare_started`);
4. applies the claims' GPU sharing settings and MPS daemons, then writes each claim's device
   metadata files (:mod:`.devicemetadata`) and one CDI spec per claim, which mounts them;
5. writes the checkpoint with them as PrepareCompleted, claims whose spec failed dropped. This is
   the commit; then it answers.

So a plain claim (new, no sharing) costs one checkpoint write, and one with side effects two. A
completed claim with a dynamic MIG instance is looked up in NVML when the kubelet prepares it again,
and its instance made again where a GPU reset or a driver reload destroyed it (:mod:`.migrepair`);
:meth:`DeviceState.check_mig_instances` does the same for every such claim at start and each rescan.
Unprepare drops the entries (one checkpoint write), then removes the specs, and with them any spec
no entry names (:meth:`.rollback.Rollback.orphan_specs`).

Every write is a temp file renamed into place, with no fsync (:mod:`.fsutil`): the state promises to
survive the agent process and the kubelet, not the kernel. A crash between any two steps leaves
what :mod:`.recovery` resolves at the next start: PrepareStarted entries are rolled back (the
kubelet never got an answer and prepares again), specs without a completed entry are orphans and
go (a one-write prepare killed between its specs and its commit leaves just that), a completed
entry's missing spec is rewritten. PrepareStarted stays for sharing and MPS because their side
effects are outside the CDI directory: only the entry tells start-up what to roll back.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gpudra_core.migpartitions import MigGeometry, geometry_from_json
from gpudra_driver.plugin import checkpoint as ckpt
from gpudra_driver.plugin.allocation import ClaimAllocation, ReadClaim, read_claim
from gpudra_driver.plugin.batching import PrepareQueue
from gpudra_driver.plugin.calllocks import CallLocks, on_thread
from gpudra_driver.plugin.cdi import CdiDir
from gpudra_driver.plugin.devicenodes import DYNAMIC_WHOLE_GPU, PLACEMENT, NodeDevice
from gpudra_driver.plugin.faults import FaultHook
from gpudra_driver.plugin.locking import LOCK_FILE, LOCK_TIMEOUT
from gpudra_driver.plugin.model import ClaimError, ClaimRef, MigPlacement, PreparedClaim, PrepareResult
from gpudra_driver.plugin.plan import needs_prepare_started, plan_prepare
from gpudra_driver.plugin.recovery import Recovery
from gpudra_driver.plugin.rollback import Rollback
from gpudra_driver.plugin.specs import ClaimSpecs
from gpudra_driver.plugin.sweep import HeldClaim
from gpudra_driver.plugin.sharing import plan as gpusettings
from gpudra_driver.plugin.sharing.apply import GpuControl
from gpudra_driver.plugin.miglifecycle import MigLifecycle
from gpudra_driver.plugin.miginstances import MigInstances
from gpudra_driver.plugin.migmodeswitch import MigModeSwitch
from gpudra_driver.plugin.migrepair import MigRepair, Outcome, has_mig
from gpudra_driver.plugin.sharing.controller import SharingController
from gpudra_driver.plugin.sharing.mps import plan as mps
from gpudra_driver.plugin.sharing.mps.apply import MpsDaemons

log = logging.getLogger(__name__)
CHECKPOINT_FILE = "checkpoint.json"

# What the plugin hands over per claim: the GET result, or the reason the GET failed.
Fetched = Mapping[str, Any] | None | ClaimError


class DeviceState:
    def __init__(self, plugin_dir: Path, cdi: CdiDir, *, driver: str, node: str, boot_id: str,
                 fault: FaultHook | None = None, lock_timeout: float = LOCK_TIMEOUT,
                 gpu_control: GpuControl | None = None,
                 mig: MigInstances | None = None, device_metadata: bool = True) -> None:
        """``mig``: creates and destroys dynamic MIG instances (None: a claim on a placement fails).
        ``device_metadata``: new claims get device metadata files (:mod:`.devicemetadata`), where
        ``cdi`` knows their directory; claims prepared with them keep them either way."""
        self.plugin_dir = plugin_dir
        self.cdi = cdi
        self.driver = driver
        self.node = node
        self.fault = fault or FaultHook()
        self.device_metadata = device_metadata and cdi.metadata_root is not None
        self.checkpoint = ckpt.CheckpointFile(plugin_dir / CHECKPOINT_FILE, boot_id)
        self.devices: Mapping[str, NodeDevice] | None = None  # swapped whole by set_devices
        self.locks = CallLocks(plugin_dir / LOCK_FILE, node, lock_timeout)
        self.queue = PrepareQueue(self.locks, self._prepare_batch)
        self.sharing = SharingController(gpu_control, MpsDaemons(plugin_dir / mps.ROOT))
        self.specs = ClaimSpecs(cdi, node, self.fault)
        self.mig = MigLifecycle(mig, None if mig is None else MigModeSwitch(mig.load_nvml))
        self.mig_repair = MigRepair(self.checkpoint, self.specs, mig, self.fault)
        # found by prepares since the last check_mig_instances; added to by a prepare on a thread
        # while that check takes them on the loop, hence the lock
        self._mig_lost: list[Outcome] = []
        self._mig_lost_lock = threading.Lock()
        self.rollback = Rollback(self.checkpoint, self.specs, self.sharing, self.mig)
        self.recovery = Recovery(self.checkpoint, self.specs, self.sharing, boot_id=boot_id, mig=self.mig)

    def _note_mig_lost(self, outcomes: list[Outcome]) -> None:
        with self._mig_lost_lock:
            self._mig_lost.extend(outcomes)

    def recover(self) -> ckpt.Reconciliation:
        """Reconcile the checkpoint with the CDI directory, the MPS daemons and the GPU settings,
        under the node lock, before any call (blocking: run it off the event loop)."""
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        with self.locks.node_locked_blocking():
            result = self.recovery.reconcile()
            # instances a GPU reset or a driver reload destroyed while no agent ran, and one a crash
            # left being made again: before discovery, which would take that one for someone else's
            _, found = self.mig_repair.repair(
                result.checkpoint, [uid for uid, e in result.checkpoint.claims.items() if e.state == ckpt.COMPLETED])
            self._note_mig_lost(found)  # reported by the agent with the first check
            return result

    @property
    def checkpoint_path(self) -> Path:
        return self.checkpoint.path

    @property
    def prepared_count(self) -> int:
        return self.checkpoint.prepared_count

    def set_devices(self, devices: Mapping[str, NodeDevice]) -> None:
        self.devices = dict(devices)

    def prepared_claims(self) -> list[PreparedClaim]:
        """The claims the checkpoint holds as prepared (PrepareCompleted); for callers without the
        node lock."""
        return [entry.claim for entry in self.checkpoint.load_unlocked().claims.values()
                if entry.state == ckpt.COMPLETED]

    def owned_mig_instances(self) -> set[tuple[str, int]]:
        """(parent GPU UUID, GPU instance ID) of every dynamic MIG instance a checkpoint entry
        names: discovery keeps their GPUs dynamic; for callers without the node lock."""
        return {(d.mig.parent_uuid, d.mig.gi) for e in self.checkpoint.load_unlocked().claims.values()
                for d in e.claim.devices if d.mig is not None and d.mig.gi is not None}

    def mig_placements(self) -> list[MigPlacement]:
        """The dynamic MIG placements checkpoint entries name, with their instance IDs once created:
        device health places an event NVML attributes to an instance by them; for callers without
        the node lock."""
        return [d.mig for e in self.checkpoint.load_unlocked().claims.values() for d in e.claim.devices
                if d.mig is not None]

    def mig_mode_off_gpus(self) -> dict[str, MigGeometry | None]:
        """GPU UUID -> the MIG geometry recorded (None before it was) of every dynamic MIG GPU whose
        MIG mode a claim of the whole GPU turns off: discovery publishes them as dynamic still, from
        that geometry, so their slice does not change under the claim; for callers without the node
        lock."""
        return {d.uuid: None if d.mig_mode_off.geometry is None else geometry_from_json(list(d.mig_mode_off.geometry))
                for e in self.checkpoint.load_unlocked().claims.values()
                for d in e.claim.devices if d.mig_mode_off is not None}

    def held_claims(self) -> list[HeldClaim]:
        """What the leak sweep looks up: the prepared claims, and the adopted ones whose name is
        known (an adoption at start-up knows none: see :meth:`.recovery.Recovery.reconcile`); for
        callers without the node lock."""
        checkpoint = self.checkpoint.load_unlocked()
        held = [HeldClaim.of(e.claim) for e in checkpoint.claims.values() if e.state == ckpt.COMPLETED]
        return held + [HeldClaim(ClaimRef(namespace, name, uid), checkpoint.adopted[uid])
                       for uid, (namespace, name) in checkpoint.adopted_names.items() if uid in checkpoint.adopted]

    # -- prepare ----------------------------------------------------------------------------------
    async def prepare(self, claims: Sequence[tuple[ClaimRef, Fetched]],
                      deadline: float | None = None) -> dict[str, PrepareResult]:
        """Every claim's answer. A failure of the node rather than of a claim (the lock held by a
        peer past the timeout, an unreadable checkpoint, a failing disk) is the error of each claim
        not answered yet; claims answered before it (already prepared, or refused) keep theirs.

        Calls that queued while another call held the node are done as one batch by the first of
        them to get its turn (:mod:`.batching`)."""
        return await self.prepare_read([(ref, self.read(ref, fetched)) for ref, fetched in claims], deadline)

    def read(self, ref: ClaimRef, fetched: Fetched) -> ReadClaim:
        """Tenant input, before any lock: the claim bounded and its configs decoded, or refused."""
        return read_claim(ref, fetched, driver=self.driver)

    async def prepare_read(self, claims: Sequence[tuple[ClaimRef, ReadClaim]],
                           deadline: float | None = None) -> dict[str, PrepareResult]:
        """:meth:`prepare` of claims :meth:`read` already (the plugin reads each as its GET returns,
        while the others' are still in flight)."""
        return await self.queue.prepare(list(claims), deadline)

    async def _prepare_batch(self, claims: Sequence[tuple[ClaimRef, ReadClaim]], lock_timeout: float | None,
                             results: dict[str, PrepareResult]) -> None:
        async with self.locks.node_locked(lock_timeout):
            # Off the loop (still under the locks) only when driver calls may block. A batch of
            # plain claims stays on the loop even while other calls are reading theirs: on a
            # thread, each of its system calls handed the GIL to the loop and waited to get it back,
            # which cost more CPU per claim than the overlap won (bench/README.md).
            if self._may_change_gpus(claims):
                await on_thread(self._prepare_locked, claims, results)
            else:
                self._prepare_locked(claims, results)

    def _prepare_locked(self, claims: Sequence[tuple[ClaimRef, ReadClaim]], results: dict[str, PrepareResult]) -> None:
        checkpoint = self._load()
        if checkpoint.half_done and (rolled := self.rollback.half_done(checkpoint)) != checkpoint:
            checkpoint = rolled
            self.checkpoint.save(checkpoint)
        original = checkpoint
        planned: list[PreparedClaim] = []
        remake: list[str] = []  # prepared claims with dynamic MIG instances: looked up before answering
        for ref, read in claims:
            if ref.uid in results or any(c.uid == ref.uid for c in planned):
                continue  # the same claim twice in one call: one answer
            try:
                plan = plan_prepare(ref, read, self.devices, checkpoint, node=self.node, driver=self.driver,
                                    device_metadata=self.device_metadata)
            except ClaimError as error:
                results[ref.uid] = PrepareResult(error=str(error))
                continue
            except Exception as error:  # a claim shaped as no API server would return it
                log.exception("planning %s failed", ref)
                results[ref.uid] = PrepareResult(error=f"{ref}: its allocation cannot be read: {error!r}")
                continue
            if plan.done and has_mig(plan.claim):
                remake.append(ref.uid)
            elif plan.done:
                results[ref.uid] = self.specs.answer_again(plan.claim)
            else:
                planned.append(plan.claim)
                checkpoint = checkpoint.started(plan.claim)
        if remake:  # saved as it goes; the new claims' entries then go on top of what it saved
            original, outcomes = self.mig_repair.repair(original, remake)
            self._note_mig_lost(outcomes)
            failed_remake = {o.claim.uid: o for o in outcomes if o.error is not None}
            for uid in remake:
                if uid in failed_remake:
                    results[uid] = PrepareResult(error=f"{failed_remake[uid].claim.ref}: its MIG instance is gone "
                                                       f"and could not be made again: {failed_remake[uid].error}")
                else:
                    results[uid] = self.specs.answer_again(original.claims[uid].claim)
            checkpoint = original
            for claim in planned:
                checkpoint = checkpoint.started(claim)
        if not planned:
            return
        # Entries this call replaces: a claim allocated anew, or one a crashed peer left half-done.
        # Whatever fails, their old entries and specs must not come back.
        replaced = {claim.uid for claim in planned if claim.uid in original.claims}
        written: list[PreparedClaim] = []
        settled = original  # the checkpoint whose GPU settings are in effect
        # GPUs this call may move away from their defaults: recorded before they are changed
        checkpoint = checkpoint.touching(gpusettings.touches(original, checkpoint))
        try:
            started = needs_prepare_started(original, planned)
            if started:
                self.checkpoint.save(checkpoint)
                self.fault("after-checkpoint-started")
            # dynamic MIG: the instances, recorded as intended above; a claim whose instance NVML
            # refuses is answered with why and dropped from this batch
            planned, refused = self.mig.create(planned, results, self.fault)
            for claim in refused:
                checkpoint = checkpoint.rolled_back(claim.uid)
            for claim in planned:
                if any(device.mig is not None or device.mig_mode_off is not None for device in claim.devices):
                    checkpoint = checkpoint.started(claim)  # with the instances' IDs, or the GPU's MIG geometry
            settled, ready = self.sharing.apply(original, planned, results)
            written = self.specs.write(ready, results)
            failed = [claim for claim in planned if claim not in written]
            for claim in planned:
                checkpoint = checkpoint.completed(claim.uid) if claim in written else checkpoint.without(claim.uid)
            # an adopted claim whose prepare failed stays adopted, its spec kept
            checkpoint = checkpoint.adopting(self.rollback.readopted(original, failed))
            # what failed after its GPU settings: back to the others' settings before the commit,
            # which then forgets the GPUs whose defaults are back
            if failed:
                self.sharing.converge_mps(checkpoint)
                self.mig.destroy_quietly(failed)
            checkpoint = checkpoint.untouched(self.sharing.settle(settled, checkpoint))
            if started or checkpoint != original:  # one write: none at all when every claim failed
                self.checkpoint.save(checkpoint)
        except OSError as error:  # adopted claims stay adopted, with the devices their spec names now
            for claim in planned:
                results.setdefault(claim.uid, PrepareResult(error=f"{claim.ref}: recording the prepared "
                                                                  f"claim failed: {error}"))
            self.rollback.failed_commit(original, checkpoint, settled, planned, written, replaced)
            self.mig.destroy_quietly(planned)
            return
        self.specs.remove_quietly(c.uid for c in failed if c.uid in replaced and c.uid not in original.adopted)
        self.fault("after-checkpoint-completed")
        for claim in written:
            results[claim.uid] = PrepareResult(claim)

    async def check_mig_instances(self) -> list[Outcome]:
        """Every prepared claim's dynamic MIG instances looked up, and made again where they are
        gone (:mod:`.migrepair`), under both locks like a call; what was found, with what the
        prepares since the last check found. No NVML call and no lock without such a claim."""
        with self._mig_lost_lock:
            found, self._mig_lost = self._mig_lost, []
        try:
            uids = [uid for uid, e in self.checkpoint.load_unlocked().claims.items()
                    if e.state == ckpt.COMPLETED and has_mig(e.claim)]
        except ckpt.CheckpointError:
            return found  # the next call recovers it
        if not uids:
            return found
        async with self.locks.one_at_a_time(None) as lock_timeout, self.locks.node_locked(lock_timeout):
            found += await on_thread(self._check_mig_locked)
        return found

    def _check_mig_locked(self) -> list[Outcome]:
        checkpoint = self._load()
        _, outcomes = self.mig_repair.repair(
            checkpoint, [uid for uid, e in checkpoint.claims.items() if e.state == ckpt.COMPLETED])
        return outcomes

    def _may_change_gpus(self, claims: Sequence[tuple[ClaimRef, ReadClaim]]) -> bool:
        """Whether this call may call into the driver or block: a claim asking for GPU sharing, a
        checkpoint with GPU settings (an unprepare or a rollback may reset them), or one to
        recover. Judged on the checkpoint last seen, not read again: a peer's change seen late
        only decides whether the call runs on the loop or a thread."""
        try:
            known = self.checkpoint.last or self.checkpoint.load()
        except ckpt.CheckpointError:
            return True  # recovering from it stops MPS daemons and resets GPUs, as a start does
        if known.changes_gpus:
            return True
        devices = self.devices or {}
        return any(isinstance(read, ClaimAllocation) and (read.shares_gpus or any(
            (found := devices.get(d.device)) is not None and found.kind in (PLACEMENT, DYNAMIC_WHOLE_GPU)
            for d in read.devices))
            for _, read in claims)

    def _load(self) -> ckpt.Checkpoint:
        """The checkpoint, under the node lock. A corrupt one is handled as at start-up: set aside,
        every CDI spec adopted (:meth:`.recovery.Recovery.reconcile`), so claims go on being
        prepared and unprepared without a restart; the claims this instance knew keep their names,
        for the leak sweep. Raises what leaves the node unusable: a newer agent's checkpoint, a CDI
        directory or spec that cannot be read (the start would stop on it too)."""
        known = self.checkpoint.last  # load() forgets it when the file changed
        try:
            return self.checkpoint.load()
        except ckpt.NewerCheckpoint:
            raise
        except ckpt.CheckpointError as error:
            log.error("checkpoint %s turned unusable while the agent runs (%s); recovering as at start-up",
                      self.checkpoint.path, error)
        try:
            return self.recovery.reconcile(known).checkpoint
        except RuntimeError as error:
            raise ckpt.CheckpointError(str(error)) from None

    # -- unprepare --------------------------------------------------------------------------------
    async def unprepare(self, refs: Sequence[ClaimRef], deadline: float | None = None) -> dict[str, str | None]:
        results: dict[str, str | None] = {}
        valid: list[str] = []
        for ref in refs:
            try:
                ref.check()
                valid.append(ref.uid)
                results[ref.uid] = None
            except ClaimError as error:
                results[ref.uid] = str(error)
        if valid:
            try:
                async with self.locks.one_at_a_time(deadline) as lock_timeout, self.locks.node_locked(lock_timeout):
                    if self._may_change_gpus([]):
                        results.update(await on_thread(self._unprepare_locked, valid))
                    else:
                        results.update(self._unprepare_locked(valid))
            except (OSError, ckpt.CheckpointError) as error:  # of the node, not of a claim
                log.error("unprepare on node %s failed: %s", self.node, error)  # the kubelet retries
                results.update((uid, f"claim {uid}: unpreparing on node {self.node} failed: {error}") for uid in valid)
        return results

    def _unprepare_locked(self, uids: Sequence[str]) -> dict[str, str | None]:
        checkpoint = self._load()
        # dynamic MIG instances first: one still in use keeps its claim prepared, for a retry
        in_use = self.mig.destroy_of(checkpoint, uids)
        uids = [uid for uid in uids if uid not in in_use]
        remaining = checkpoint.without(*uids)
        if remaining.half_done:
            remaining = self.rollback.half_done(remaining)
        self.rollback.orphan_specs(remaining, keep=uids)
        if remaining != checkpoint:
            self.checkpoint.save(remaining)
            self.fault("unprepare-after-checkpoint")
            # Their MPS daemons gone before the compute mode goes back to DEFAULT (no MPS server may
            # hold a GPU handed to another claim): the supervisor kills them at once, so this wait,
            # under the node lock, is bounded by their exit (mpsdaemons.STOP_TIMEOUT), not by tenants.
            self.sharing.converge_mps_quietly(remaining)
            # the last claim sharing a GPU gone: its defaults back, then forgotten
            if reset := self.sharing.settle(checkpoint, remaining):
                self.checkpoint.save(remaining.untouched(reset))
        return {**self.specs.remove(uids), **in_use}
