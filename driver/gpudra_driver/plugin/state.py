"""Prepare and unprepare on this node: the checkpoint and the CDI specs, changed only under the
node lock (the role of dra-example-driver's device_state.go). Start-up is :mod:`.recovery`.

Each claim is read first (:func:`.allocation.read_claim`: tenant input, bounded and decoded
before any lock, so a bad claim costs its neighbours nothing). Then one call at a time per agent
(an asyncio lock), and one agent instance at a time per node (the node lock, a flock: during a
rolling update two instances serve side by side). Under both, a prepare of a batch of claims (one
kubelet call):

1. reads the checkpoint (another instance may have changed it) and rolls back half-done prepares
   a crashed instance left (found under the lock, PrepareStarted entries cannot be a live one's);
   a checkpoint found corrupt is set aside and the CDI specs adopted, as at start-up
   (:func:`.recovery.recover_locked`), so the node serves on without a restart;
2. plans each claim (pure, :func:`plan_prepare`); an already completed claim is answered again;
3. writes the checkpoint with the new claims as PrepareStarted;
4. writes one CDI spec per claim;
5. writes the checkpoint with them as PrepareCompleted, claims whose spec failed dropped. This is
   the commit; then it answers.

Unprepare drops the entries (one checkpoint write), then removes the specs.

Every write is a temp file renamed into place, with no fsync (:mod:`.fsutil`): the state promises to
survive the agent process and the kubelet, not the kernel. A crash between any two steps leaves
what :mod:`.recovery` resolves at the next start: PrepareStarted entries are rolled back (the
kubelet never got an answer and prepares again), specs without a completed entry are orphans and
go, a completed entry's missing spec is rewritten. PrepareStarted is kept, although the specs alone
could be reconciled, because sharing and MPS add side effects outside the CDI directory that
start-up must be able to roll back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpudra_driver.plugin import checkpoint as ckpt
from gpudra_driver.plugin import recovery
from gpudra_driver.sharing import plan as gpusettings
from gpudra_driver.sharing.mps import plan as mps
from gpudra_driver.plugin.allocation import ClaimAllocation, read_claim
from gpudra_driver.plugin.cdi import CdiDir
from gpudra_driver.plugin.devicenodes import NodeDevice
from gpudra_driver.plugin.driverfiles import DriverFilesError
from gpudra_driver.plugin.faults import FaultHook
from gpudra_driver.sharing.apply import GpuControl, GpuControlError
from gpudra_driver.plugin.locking import LOCK_FILE, LOCK_TIMEOUT, LockTimeout, node_lock_async
from gpudra_driver.plugin.model import ClaimError, ClaimRef, PreparedClaim
from gpudra_driver.sharing.mps.apply import MpsDaemons
from gpudra_driver.plugin.plan import plan_prepare
from gpudra_driver.plugin.sweep import HeldClaim

log = logging.getLogger(__name__)
CHECKPOINT_FILE = "checkpoint.json"


@dataclass(frozen=True)
class PrepareResult:
    claim: PreparedClaim | None = None
    error: str | None = None


# What the plugin hands over per claim: the GET result, or the reason the GET failed.
Fetched = Mapping[str, Any] | None | ClaimError
# A claim as read before the locks: what planning needs from it, or why it is refused.
Read = ClaimAllocation | ClaimError


class DeviceState:
    def __init__(self, plugin_dir: Path, cdi: CdiDir, *, driver: str, node: str, boot_id: str,
                 fault: FaultHook | None = None, lock_timeout: float = LOCK_TIMEOUT,
                 gpu_control: GpuControl | None = None) -> None:
        self.plugin_dir = plugin_dir
        self.gpu_control = gpu_control
        self.cdi = cdi
        self.driver = driver
        self.node = node
        self.boot_id = boot_id
        self.fault = fault or FaultHook()
        self.lock_timeout = lock_timeout
        self.checkpoint = ckpt.CheckpointFile(plugin_dir / CHECKPOINT_FILE, boot_id)
        self.mps = MpsDaemons(plugin_dir / mps.ROOT)
        self.lock_path = plugin_dir / LOCK_FILE
        self.devices: Mapping[str, NodeDevice] | None = None  # swapped whole by set_devices
        self._one_call = asyncio.Lock()
        self._queued: list[_QueuedPrepare] = []  # prepare calls waiting for their turn
        self._busy_since: float | None = None  # time.monotonic() since the call holding the lock began
        self.others_coming: Callable[[], int] = lambda: 0  # prepare calls reading their claims now

    @property
    def checkpoint_path(self) -> Path:
        return self.checkpoint.path

    @property
    def prepared_count(self) -> int:
        return self.checkpoint.prepared_count

    def set_devices(self, devices: Mapping[str, NodeDevice]) -> None:
        self.devices = dict(devices)

    def prepared_claims(self) -> list[PreparedClaim]:
        """The claims the checkpoint holds as prepared (PrepareCompleted)."""
        return [entry.claim for entry in self.checkpoint.load().claims.values() if entry.state == ckpt.COMPLETED]

    def held_claims(self) -> list[HeldClaim]:
        """What the leak sweep looks up: the prepared claims, and the adopted ones whose name is
        known (an adoption at start-up knows none: see :func:`.recovery.recover_locked`)."""
        checkpoint = self.checkpoint.load()
        held = [HeldClaim.of(e.claim) for e in checkpoint.claims.values() if e.state == ckpt.COMPLETED]
        return held + [HeldClaim(ClaimRef(namespace, name, uid), checkpoint.adopted[uid])
                       for uid, (namespace, name) in checkpoint.adopted_names.items() if uid in checkpoint.adopted]

    def busy_for(self) -> float:
        """Seconds the call holding the node lock has taken so far; 0 when none does (the liveness
        check: a call stuck on a hung disk answers no call again)."""
        started = self._busy_since
        return 0.0 if started is None else time.monotonic() - started

    @asynccontextmanager
    async def _one_at_a_time(self, deadline: float | None) -> AsyncIterator[float | None]:
        """This instance's calls one at a time (FIFO), waited for until ``deadline``
        (time.monotonic) at the latest: the kubelet's call budget. Yields the node lock's timeout:
        what is left of the budget, at most ``lock_timeout``."""
        timeout = self.lock_timeout
        if deadline is not None:
            timeout = max(0.0, min(timeout, deadline - time.monotonic()))
        waited_until = time.monotonic() + timeout
        try:
            async with asyncio.timeout(timeout):
                await self._one_call.acquire()
        except TimeoutError:
            raise LockTimeout(f"the calls before this one on node {self.node} took over {timeout:.1f}s") from None
        try:
            yield max(0.0, waited_until - time.monotonic())
        finally:
            self._one_call.release()

    @asynccontextmanager
    async def _node_locked(self, timeout: float | None) -> AsyncIterator[None]:
        async with node_lock_async(self.lock_path, self.lock_timeout if timeout is None else timeout):
            self._busy_since = time.monotonic()
            try:
                yield
            finally:
                self._busy_since = None

    # -- prepare ----------------------------------------------------------------------------------
    async def prepare(self, claims: Sequence[tuple[ClaimRef, Fetched]],
                      deadline: float | None = None) -> dict[str, PrepareResult]:
        """Every claim's answer. A failure of the node rather than of a claim (the lock held by a
        peer past the timeout, an unreadable checkpoint, a failing disk) is the error of each claim
        not answered yet; claims answered before it (already prepared, or refused) keep theirs.

        Calls that queued while another call held the node are done as one batch by the first of
        them to get its turn (one checkpoint write per phase for all of them); nothing waits for
        calls to arrive."""
        # tenant input, before any lock: each claim bounded and its configs decoded, or refused
        call = _QueuedPrepare([(ref, read_claim(ref, fetched, driver=self.driver)) for ref, fetched in claims],
                              deadline)
        self._queued.append(call)
        try:
            async with self._one_at_a_time(deadline) as lock_timeout:
                if call.results is None:  # not done in an earlier call's batch (nor in one cancelled)
                    batch = [call, *(queued for queued in self._queued if queued is not call)]
                    self._queued = []
                    await self._prepare_batch(batch, lock_timeout)
        except LockTimeout as error:
            call.fail(error, self.node)
        finally:
            if call in self._queued:
                self._queued.remove(call)
        return call.results or {}

    async def _prepare_batch(self, batch: list[_QueuedPrepare], lock_timeout: float | None) -> None:
        deadlines = [call.deadline for call in batch if call.deadline is not None]
        if deadlines:  # the earliest caller's budget
            lock_timeout = max(0.0, min(lock_timeout or self.lock_timeout, min(deadlines) - time.monotonic()))
        results: dict[str, PrepareResult] = {}
        claims = [item for call in batch for item in call.claims]
        try:
            async with self._node_locked(lock_timeout):
                # Off the loop (still under the locks) when driver calls may block, or when other
                # calls are on their way: the loop then reads their claims while this batch is on
                # disk, and they queue up as the next batch. A lone call stays on the loop.
                if self._may_change_gpus(claims) or self.others_coming() > 0:
                    await asyncio.to_thread(self._prepare_locked, claims, results)
                else:
                    self._prepare_locked(claims, results)
        except (OSError, ckpt.CheckpointError) as error:  # LockTimeout is an OSError too
            log.error("prepare on node %s failed: %s", self.node, error)
            for call in batch:
                call.fail(error, self.node, results)
            return
        for call in batch:
            call.results = {ref.uid: results[ref.uid] for ref, _ in call.claims}

    def _prepare_locked(self, claims: Sequence[tuple[ClaimRef, Read]], results: dict[str, PrepareResult]) -> None:
        checkpoint = self._load()
        if checkpoint.half_done and (rolled := self._roll_back_half_done(checkpoint)) != checkpoint:
            checkpoint = rolled
            self.checkpoint.save(checkpoint)
        original = checkpoint
        planned: list[PreparedClaim] = []
        for ref, read in claims:
            if ref.uid in results or any(c.uid == ref.uid for c in planned):
                continue  # the same claim twice in one call: one answer
            try:
                plan = plan_prepare(ref, read, self.devices, checkpoint, node=self.node, driver=self.driver)
            except ClaimError as error:
                results[ref.uid] = PrepareResult(error=str(error))
                continue
            except Exception as error:  # a claim shaped as no API server would return it
                log.exception("planning %s failed", ref)
                results[ref.uid] = PrepareResult(error=f"{ref}: its allocation cannot be read: {error!r}")
                continue
            if plan.done:
                results[ref.uid] = self._answer_again(plan.claim)
            else:
                planned.append(plan.claim)
                checkpoint = checkpoint.started(plan.claim)
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
            self.checkpoint.save(checkpoint)
            self.fault("after-checkpoint-started")
            settled, ready = self._apply_settings(original, planned, results)
            written = self._write_specs(ready, results)
            failed = [claim for claim in planned if claim not in written]
            for claim in planned:
                checkpoint = checkpoint.completed(claim.uid) if claim in written else checkpoint.without(claim.uid)
            # an adopted claim whose prepare failed stays adopted, its spec kept
            checkpoint = checkpoint.adopting(self._readopted(original, failed))
            # what failed after its GPU settings: back to the others' settings before the commit,
            # which then forgets the GPUs whose defaults are back
            if failed:
                self._converge_mps(checkpoint)
            checkpoint = checkpoint.untouched(self._settle(settled, checkpoint))
            self.checkpoint.save(checkpoint)
        except OSError as error:  # adopted claims stay adopted, with the devices their spec names now
            self._remove_specs(({c.uid for c in written} | replaced) - original.adopted.keys())
            for claim in planned:
                results.setdefault(claim.uid, PrepareResult(error=f"{claim.ref}: recording the prepared "
                                                                  f"claim failed: {error}"))
            rolled_back = original.without(*replaced).adopting(self._readopted(original, planned))
            self._converge_mps_quietly(rolled_back)
            rolled_back = rolled_back.touching(checkpoint.touched).untouched(self._settle(settled, rolled_back))
            self._save_quietly(rolled_back)
            return
        self._remove_specs(c.uid for c in failed if c.uid in replaced and c.uid not in original.adopted)
        self.fault("after-checkpoint-completed")
        for claim in written:
            results[claim.uid] = PrepareResult(claim)

    def _may_change_gpus(self, claims: Sequence[tuple[ClaimRef, Read]]) -> bool:
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
        return any(isinstance(read, ClaimAllocation) and read.shares_gpus for _, read in claims)

    def _load(self) -> ckpt.Checkpoint:
        """The checkpoint, under the node lock. A corrupt one is handled as at start-up: set aside,
        every CDI spec adopted (:func:`.recovery.recover_locked`), so claims go on being prepared
        and unprepared without a restart; the claims this instance knew keep their names, for the
        leak sweep. Raises what leaves the node unusable: a newer agent's checkpoint, a CDI
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
            return recovery.recover_locked(self, known).checkpoint
        except RuntimeError as error:
            raise ckpt.CheckpointError(str(error)) from None

    def _apply_settings(self, before: ckpt.Checkpoint, planned: Sequence[PreparedClaim],
                        results: dict[str, PrepareResult]) -> tuple[ckpt.Checkpoint, list[PreparedClaim]]:
        """The GPU settings each planned claim's sharing asks for (:mod:`.gpusettings`), claim by
        claim: one that cannot be applied is that claim's error, its changes undone. Returns the
        checkpoint whose settings are now in effect and the claims to go on with."""
        current, ready = before, []
        for claim in planned:
            after = current.started(claim)
            wanted = gpusettings.changes(current, after)
            try:
                for uuid, settings in wanted.items():
                    self._gpu_control().apply(uuid, settings)
            except GpuControlError as error:
                results[claim.uid] = PrepareResult(error=f"{claim.ref}: {error}")
                self._settle(after, current)
                continue
            # its MPS daemon, once its GPUs are EXCLUSIVE_PROCESS (the daemon's server starts later)
            if mps.daemon_for(claim) is not None and (problem := self._converge_mps(after).get(claim.uid)):
                results[claim.uid] = PrepareResult(error=f"{claim.ref}: {problem}")
                self._converge_mps(current)
                self._settle(after, current)
                continue
            current = after
            ready.append(claim)
        return current, ready

    def _converge_mps(self, checkpoint: ckpt.Checkpoint) -> dict[str, str]:
        """The MPS daemons ``checkpoint``'s claims ask for, and no others (:mod:`.mps`), except that
        the daemons of adopted claims (a checkpoint recovered: their devices are unknown, their pods
        still run) stay as they are; claim UID -> why its daemon is not running."""
        return self.mps.converge(mps.wanted({uid: entry.claim for uid, entry in checkpoint.claims.items()}),
                                 keep=checkpoint.adopted.keys())

    def _settle(self, before: ckpt.Checkpoint, after: ckpt.Checkpoint) -> set[str]:
        """Best effort: the GPU settings of ``after`` where they differ from ``before``'s. Returns
        the GPUs whose defaults are back; a failure is logged, and the GPU stays recorded as
        touched for the next start to converge (not retried per call: a GPU stuck in the driver
        would slow every call down)."""
        return self._apply(gpusettings.changes(before, after), "the next start")

    def _apply(self, wanted: Mapping[str, gpusettings.GpuSettings], retry: str) -> set[str]:
        reset: set[str] = set()
        for uuid, settings in wanted.items():
            try:
                self._gpu_control().apply(uuid, settings)
            except GpuControlError as error:
                log.warning("%s; it stays recorded in the checkpoint for %s", error, retry)
                continue
            if settings == gpusettings.DEFAULTS:
                reset.add(uuid)
        return reset

    def _converge(self, checkpoint: ckpt.Checkpoint) -> set[str]:
        """Every GPU ``checkpoint`` records as touched gets what its holders ask, or its defaults
        (start-up). Returns the GPUs whose defaults are back."""
        return self._apply(gpusettings.converge(checkpoint), "the next start")

    def _gpu_control(self) -> GpuControl:
        if self.gpu_control is None:
            raise GpuControlError("this agent was started without GPU control (no NVML): it cannot change "
                                  "a GPU's sharing settings")
        return self.gpu_control

    def _roll_back_half_done(self, checkpoint: ckpt.Checkpoint) -> ckpt.Checkpoint:
        """Roll back, as start-up would, the half-done prepares found under the node lock: a crashed
        instance's (a peer SIGKILLed during a rolling update; or this one, when a commit and its
        rollback both failed). Their specs are removed, except an adopted claim's, which stays
        adopted with the devices its spec names now. The kubelet, which got no answer for them,
        prepares them again. Returns the checkpoint without them, for the caller to save."""
        gone: list[str] = []
        kept: dict[str, list[tuple[str, str]]] = {}
        for uid in checkpoint.half_done:
            if uid in checkpoint.adopted:
                kept[uid] = self.spec_devices(uid, checkpoint.possible_devices(uid))
                continue
            try:
                self.cdi.remove(uid)
                gone.append(uid)
            except OSError as error:  # the entry stays: the next call or start tries again
                log.warning("removing the CDI spec of half-done claim %s failed: %s", uid, error)
        if gone or kept:
            log.info("rolled back the half-done prepare of claim(s) %s, left by an agent instance that "
                     "crashed", gone + list(kept))
        rolled = checkpoint.rolled_back(*gone, *kept).adopting(kept)
        self._converge_mps_quietly(rolled)
        return rolled.untouched(self._settle(checkpoint, rolled))

    def _readopted(self, original: ckpt.Checkpoint,
                   failed: Iterable[PreparedClaim]) -> dict[str, list[tuple[str, str]]]:
        """The adoptions of the ``failed`` prepares' adopted claims: the devices their spec names
        now (the prepare may have rewritten it; if it cannot be read, the old and the new ones)."""
        return {c.uid: self.spec_devices(c.uid, original.started(c).possible_devices(c.uid))
                for c in failed if c.uid in original.adopted}

    def spec_devices(self, claim_uid: str, known: Iterable[tuple[str, str]] = ()) -> list[tuple[str, str]]:
        """The (pool, device) pairs the claim's spec on disk names: what an adopted claim holds.
        When the spec cannot be read, ``known``: what it may name (better to hold a device too
        many than to hand one a container may use to another claim)."""
        names = self.cdi.device_names(claim_uid)
        return list(known) if names is None else [(self.node, device) for device in names]

    def _remove_specs(self, uids: Iterable[str]) -> None:
        """Best effort, after a failure: a spec left behind is an orphan that start-up removes."""
        for uid in uids:
            try:
                self.cdi.remove(uid)
            except OSError as error:
                log.warning("removing the CDI spec of claim %s failed: %s", uid, error)

    def _write_specs(self, planned: Sequence[PreparedClaim], results: dict[str, PrepareResult]) -> list[PreparedClaim]:
        """Each planned claim's CDI spec; the claims whose spec is there (or who need none). A
        failure is that claim's error in ``results``."""
        written: list[PreparedClaim] = []
        for claim in planned:
            if not claim.devices:  # nothing of ours in this claim: nothing to write
                written.append(claim)
                continue
            try:
                self.cdi.write(claim)
                written.append(claim)
                self.fault("after-cdi-write")
            except DriverFilesError as error:  # the node's driver is not ready for it: retryable
                results[claim.uid] = PrepareResult(error=f"{claim.ref}: {error}")
            except OSError as error:
                results[claim.uid] = PrepareResult(error=f"{claim.ref}: writing its CDI spec into "
                                                         f"{self.cdi.path} failed: {error}")
        return written

    def _answer_again(self, claim: PreparedClaim) -> PrepareResult:
        if claim.devices and not self.cdi.exists(claim.uid):  # someone deleted it: put it back
            try:
                self.cdi.write(claim)
            except OSError as error:
                return PrepareResult(error=f"{claim.ref}: rewriting its missing CDI spec failed: {error}")
        return PrepareResult(claim)

    def _converge_mps_quietly(self, checkpoint: ckpt.Checkpoint) -> None:
        """Best effort, after a failure or a rollback: a daemon left running is stopped by the next
        start's reconciliation (recovery)."""
        try:
            self._converge_mps(checkpoint)
        except OSError as error:
            log.warning("stopping MPS daemons of rolled-back claims failed: %s", error)

    def _save_quietly(self, checkpoint: ckpt.Checkpoint) -> None:
        try:
            self.checkpoint.save(checkpoint)
        except OSError as error:  # the next call or start rolls the PrepareStarted entries back
            log.error("could not roll the checkpoint back: %s", error)

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
                async with self._one_at_a_time(deadline) as lock_timeout, self._node_locked(lock_timeout):
                    if self._may_change_gpus([]):
                        results.update(await asyncio.to_thread(self._unprepare_locked, valid))
                    else:
                        results.update(self._unprepare_locked(valid))
            except (OSError, ckpt.CheckpointError) as error:  # of the node, not of a claim
                log.error("unprepare on node %s failed: %s", self.node, error)  # the kubelet retries
                results.update((uid, f"claim {uid}: unpreparing on node {self.node} failed: {error}") for uid in valid)
        return results

    def _unprepare_locked(self, uids: Sequence[str]) -> dict[str, str | None]:
        results: dict[str, str | None] = dict.fromkeys(uids)
        checkpoint = self._load()
        remaining = checkpoint.without(*uids)
        if remaining.half_done:
            remaining = self._roll_back_half_done(remaining)
        if remaining != checkpoint:
            self.checkpoint.save(remaining)
            self.fault("unprepare-after-checkpoint")
            # Their MPS daemons gone before the compute mode goes back to DEFAULT (no MPS server may
            # hold a GPU handed to another claim): the supervisor kills them at once, so this wait,
            # under the node lock, is bounded by their exit (mpsdaemons.STOP_TIMEOUT), not by tenants.
            self._converge_mps_quietly(remaining)
            # the last claim sharing a GPU gone: its defaults back, then forgotten
            if reset := self._settle(checkpoint, remaining):
                self.checkpoint.save(remaining.untouched(reset))
        for uid in uids:
            try:
                self.cdi.remove(uid)
            except OSError as error:
                results[uid] = f"claim {uid}: removing its CDI spec failed: {error}"
        return results


@dataclass(eq=False)  # identity: two calls with the same claims are still two callers
class _QueuedPrepare:
    claims: list[tuple[ClaimRef, Read]]
    deadline: float | None
    results: dict[str, PrepareResult] | None = None  # set once done, by whichever call ran its batch

    def fail(self, error: Exception, node: str, answered: Mapping[str, PrepareResult] | None = None) -> None:
        """Each claim not answered yet gets the node's ``error``."""
        results = dict(self.results or {})
        for ref, _ in self.claims:
            results.setdefault(ref.uid, (answered or {}).get(ref.uid) or PrepareResult(
                error=f"{ref}: preparing on node {node} failed: {error}"))
        self.results = results

