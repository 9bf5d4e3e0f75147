"""Prepared-claim state on this node: the checkpoint and the CDI specs, changed only under the
node lock (the role of dra-example-driver's device_state.go).

:meth:`DeviceState.prepare` and :meth:`DeviceState.unprepare` are coroutines that the plugin runs
one round at a time (:mod:`.groupcommit`). A prepare does its page-cache work on the event loop
(reading the checkpoint, the PrepareStarted write, the CDI specs on tmpfs: microseconds each) and
awaits what waits: the fsyncs, on the stager thread, and a node lock held by a peer instance.
Unprepare, off the kubelet's pod-start path, takes the lock on the loop and does the rest on the
stager thread. Start-up is blocking.

Prepare, for all claims of one batch of kubelet calls together (the plugin batches calls that
arrive while the previous batch is on disk: group commit):

1. lock; read the checkpoint (another instance may have changed it);
2. plan each claim (pure, :func:`plan_prepare`); an already completed claim is answered again;
3. one checkpoint write: the new claims as PrepareStarted;
4. one atomic CDI spec write per claim;
5. one durable checkpoint write (temp file, fsync, rename, fsync dir): PrepareCompleted, failed
   claims dropped. This is the commit. Its temp file is written and fsync'd on the stager thread
   during 3 and 4 (the commit as it will be if every spec is written); once the specs are
   written, the same job renames it into place. Unlock; answer; the directory fsync follows on the
   stager, before any later job of it, and the next prepare waits for it before step 3. A failed
   spec means a fresh commit instead.

Durability. Every write is atomic (a new file renamed into place; for the checkpoint, a standing
scratch file exchanged with it, see :func:`fsutil.swap_in`), so no reader and no restarted agent
ever sees a torn file, and the page cache outlives a killed agent, so SIGKILL at any point leaves a
state that start-up reconciliation resolves. Power loss is a reboot, which voids the whole
checkpoint (boot ID), so correctness never rests on what survives one. The commit is still
fsync'd (the temp-file protocol: the states the kubelet was told about reach the disk whole), but
nothing else is: a lost PrepareStarted entry or a lost/torn spec is found at start anyway (a spec
without a completed entry is an orphan and removed, a completed entry whose spec is missing or
differs is rewritten from the checkpoint). The kubelet's answer waits for the commit's fsync and
rename, not for its directory fsync (0.3-0.45 ms on the development VM): what the
kubelet's own checkpoint store waits for (pkg/kubelet/util/store: temp file, fsync, rename; it
never fsyncs the directory). The stager runs one job at a time, so a commit's directory fsync ends
before this instance's next durable write stages over the scratch file it freed (the rule of
:func:`fsutil.swap_in`; a peer instance in a rolling update does not wait, which again matters only
to a power loss). That keeps the prepare path at one fsync'd write per batch, however many claims
it holds.

A crash before 5 leaves PrepareStarted entries, which are rolled back (spec removed) by the next
start or, sooner, by the next call of a live peer instance (a rolling update overlaps two): a
prepare holds the node lock from its PrepareStarted write to its commit, so entries in that state
found under the lock are a crashed instance's. The kubelet, which never got an answer, prepares
again. Unprepare drops the entries first (one
durable checkpoint write), then removes the specs; a crash between leaves orphan specs, removed at
start.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from gpudra_driver.plugin import checkpoint as ckpt
from gpudra_driver.plugin import fsutil
from gpudra_driver.plugin.cdi import CdiDir
from gpudra_driver.plugin.driverfiles import DriverFilesError
from gpudra_driver.plugin.devicenodes import NodeDevice
from gpudra_driver.plugin.faults import FaultHook
from gpudra_driver.plugin.locking import LOCK_FILE, LOCK_TIMEOUT, node_lock, node_lock_async
from gpudra_driver.plugin.model import ClaimError, ClaimRef, PreparedClaim
from gpudra_driver.plugin.prepare import plan_prepare

log = logging.getLogger(__name__)
CHECKPOINT_FILE = "checkpoint.json"
T = TypeVar("T")


@dataclass(frozen=True)
class PrepareResult:
    claim: PreparedClaim | None = None
    error: str | None = None


# What the plugin hands over per claim: the GET result, or the reason the GET failed.
Fetched = Mapping[str, Any] | None | ClaimError


class DeviceState:
    def __init__(self, plugin_dir: Path, cdi: CdiDir, *, driver: str, node: str, boot_id: str,
                 fault: FaultHook | None = None, lock_timeout: float = LOCK_TIMEOUT) -> None:
        self.plugin_dir = plugin_dir
        self.cdi = cdi
        self.driver = driver
        self.node = node
        self.boot_id = boot_id
        self.fault = fault or FaultHook()
        self.lock_timeout = lock_timeout
        self.checkpoint_path = plugin_dir / CHECKPOINT_FILE
        self.lock_path = plugin_dir / LOCK_FILE
        self.devices: Mapping[str, NodeDevice] | None = None  # swapped whole by set_devices
        self.prepared_count = 0  # completed claims in the checkpoint last read or written (a metric)
        self._cached: tuple[bytes, ckpt.Checkpoint] | None = None  # the file's bytes, decoded
        # The fsyncs of prepare's commit (while its specs are written) and unprepare; one at a time.
        self._stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpudra-checkpoint-stager")
        self.dir_synced: Future[None] | None = None  # the last commit's directory fsync, once queued

    def set_devices(self, devices: Mapping[str, NodeDevice]) -> None:
        self.devices = dict(devices)

    def _lock(self):  # type: ignore[no-untyped-def]
        return node_lock(self.lock_path, self.lock_timeout)

    def _lock_async(self, deadline: float | None = None):  # type: ignore[no-untyped-def]
        """The node lock, waited for until ``deadline`` (time.monotonic) at the latest: the
        kubelet's call budget, which calls queued behind a stuck peer have partly spent."""
        timeout = self.lock_timeout
        if deadline is not None:
            timeout = max(0.0, min(timeout, deadline - time.monotonic()))
        return node_lock_async(self.lock_path, timeout)

    def prepared_claims(self) -> list[PreparedClaim]:
        """The claims the checkpoint holds as prepared (PrepareCompleted), for the leak sweep."""
        checkpoint = self._load()
        return [entry.claim for entry in checkpoint.claims.values() if entry.state == ckpt.COMPLETED]

    def _load(self) -> ckpt.Checkpoint:
        """The checkpoint on disk. Decoding and verifying it is O(prepared claims), so the last one
        this instance read or wrote is reused while the file holds exactly its bytes (reading
        them is cheap; another agent instance's write changes them)."""
        data = fsutil.read_file(self.checkpoint_path)
        if data is not None and self._cached is not None and self._cached[0] == data:
            return self._cached[1]
        self._cached = None
        checkpoint, problem = (ckpt.Checkpoint(self.boot_id), None) if data is None else ckpt.parse(data, self.boot_id)
        if problem:
            log.warning("%s", problem)
        if data is not None and not problem:
            self._cached = (data, checkpoint)
        self.prepared_count = checkpoint.completed_count()
        return checkpoint

    def _save(self, checkpoint: ckpt.Checkpoint, *, durable: bool = True) -> None:
        self._cached = None
        self._remember(ckpt.save(self.checkpoint_path, checkpoint, durable=durable), checkpoint)

    def _remember(self, data: bytes, checkpoint: ckpt.Checkpoint) -> None:
        """``checkpoint`` (encoded as ``data``) is now the file."""
        self._cached = (data, checkpoint)
        self.prepared_count = checkpoint.completed_count()

    # -- start-up ---------------------------------------------------------------------------------
    def startup(self) -> ckpt.Reconciliation:
        """Reconcile the checkpoint with the CDI directory (see :func:`checkpoint.reconcile`)."""
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        with self._lock():
            read = self._read_at_start()
            on_disk, listed = self._list_specs()
            loaded = read if read is not None else self._adopt_kept_specs(on_disk, listed)
            # an adopted spec is forgotten only when the directory was read and it is not there
            result = ckpt.reconcile(loaded, on_disk if listed else on_disk | set(loaded.adopted))
            if listed and read is not None and result.checkpoint.adopted:
                # what kept specs name now: a crashed prepare of an adopted claim may have rewritten
                # one (a start that just adopted them has read them already)
                adopted = result.checkpoint.adopted
                result = dataclasses.replace(result, checkpoint=result.checkpoint.adopting(
                    {uid: self._spec_devices(uid, pairs) for uid, pairs in adopted.items()}))
            for uid in result.remove_specs:
                self.cdi.remove(uid)
            stale = [e.claim for u, e in result.checkpoint.claims.items()
                     if e.claim.devices and u in on_disk and not self.cdi.matches(e.claim)]
            result = ckpt.Reconciliation(result.checkpoint, result.remove_specs,
                                         result.rewrite_specs + tuple(stale), result.rolled_back)
            for claim in result.rewrite_specs:
                try:
                    self.cdi.write(claim, durable=False)
                except DriverFilesError as error:  # the driver is being (re)loaded: never crash-loop
                    # on it (running pods need their unprepare); a missing spec is written again
                    # when the kubelet next asks to prepare the claim
                    kept = "is kept as it is" if self.cdi.exists(claim.uid) else "is missing"
                    log.warning("%s: its CDI spec %s; it cannot be brought up to date now: %s",
                                claim.ref, kept, error)
            temp = self.cdi.remove_temp_files() if on_disk or self.cdi.path.is_dir() else 0
            if result.changed or temp:
                self.cdi.sync()
            if result.checkpoint != read or self._cached is None:
                # no file, or not one this boot can use (another boot's is replaced too: read once,
                # warned once): write the reconciled one
                self._save(result.checkpoint)
            for name in os.listdir(self.plugin_dir):
                if ckpt.is_leftover(name, CHECKPOINT_FILE):
                    os.unlink(self.plugin_dir / name)
        if result.changed:
            log.info("start-up reconciliation: rolled back %s, removed orphan specs %s, rewrote specs %s",
                     list(result.rolled_back), list(result.remove_specs), [c.uid for c in result.rewrite_specs])
        return result

    def _read_at_start(self) -> ckpt.Checkpoint | None:
        """The checkpoint; None when it is corrupt (then a copy is set aside; the file itself
        stays until the checkpoint recording the kept specs replaces it, so that a crash before
        then finds it, and keeps them, again). A newer agent's stops the start."""
        try:
            return self._load()
        except ckpt.NewerCheckpoint as error:
            raise RuntimeError(f"{self.checkpoint_path}: {error}") from None
        except ckpt.CheckpointError as error:
            aside = self.checkpoint_path.with_name(f"{CHECKPOINT_FILE}.corrupt-{int(time.time())}")
            shutil.copyfile(self.checkpoint_path, aside)
            log.error("checkpoint %s is unusable (%s); a copy is in %s. Existing CDI specs are kept for "
                      "running containers, and their devices held, until the kubelet unprepares their "
                      "claims", self.checkpoint_path, error, aside)
            return None

    def _list_specs(self) -> tuple[set[str], bool]:
        """The claim UIDs with a spec of ours, and whether the directory could be listed at all."""
        try:
            self.cdi.path.mkdir(parents=True, exist_ok=True)
            return self.cdi.claim_uids(), True
        except OSError as error:
            log.error("CDI directory %s is unusable: %s", self.cdi.path, error)
            return set(), False

    def _adopt_kept_specs(self, on_disk: set[str], listed: bool) -> ckpt.Checkpoint:
        """In place of a corrupt checkpoint: every spec of ours adopted, with the devices it names.
        Where that cannot be told, the start stops (the next one tries again) rather than forget a
        spec or a device a running container may use."""
        if not listed:
            raise RuntimeError(f"{self.checkpoint_path} is unusable and the CDI directory {self.cdi.path} "
                               "cannot be read: cannot tell which specs running containers need")
        named = {uid: self.cdi.device_names(uid) for uid in on_disk}
        if unreadable := sorted(uid for uid, names in named.items() if names is None):
            raise RuntimeError(f"{self.checkpoint_path} is unusable and the CDI specs of claim(s) "
                               f"{', '.join(unreadable)} cannot be read: cannot tell which devices "
                               "running containers hold")
        return ckpt.Checkpoint(self.boot_id).adopting(
            {uid: [(self.node, device) for device in names or ()] for uid, names in named.items()})

    # -- prepare ----------------------------------------------------------------------------------
    async def prepare(self, claims: Sequence[tuple[ClaimRef, Fetched]],
                      deadline: float | None = None) -> dict[str, PrepareResult]:
        """Every claim's answer. A failure of the node rather than of a claim (the lock held by a
        peer past the timeout, an unreadable checkpoint, a failing disk) is the error of each claim
        not answered yet; claims answered before it (already prepared, or refused) keep theirs."""
        results: dict[str, PrepareResult] = {}
        try:
            await self._prepare(claims, results, deadline)
        except (OSError, ckpt.CheckpointError) as error:  # LockTimeout is an OSError too
            log.error("prepare on node %s failed: %s", self.node, error)
            for ref, _ in claims:
                results.setdefault(ref.uid, PrepareResult(error=f"{ref}: preparing on node {self.node} "
                                                                f"failed: {error}"))
        return results

    async def _prepare(self, claims: Sequence[tuple[ClaimRef, Fetched]], results: dict[str, PrepareResult],
                       deadline: float | None) -> None:
        async with self._lock_async(deadline):
            if self.dir_synced is not None and not self.dir_synced.done():
                # The last commit's directory fsync first: PrepareStarted overwrites in place the
                # scratch file that, until then, the disk may still hold as the checkpoint.
                await _settled(self.dir_synced)
            checkpoint = self._load()
            if checkpoint.half_done and (rolled := self._roll_back_half_done(checkpoint)) != checkpoint:
                checkpoint = rolled
                await self._on_stager(self._save, checkpoint)
            original = checkpoint
            planned: list[PreparedClaim] = []
            seen: set[str] = set()
            for ref, fetched in claims:
                if ref.uid in seen:
                    continue  # the same claim twice in one call: one answer
                seen.add(ref.uid)
                try:
                    plan = plan_prepare(ref, fetched, self.devices, checkpoint, node=self.node, driver=self.driver)
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
            # Entries this batch replaces: a claim allocated anew, or one a crashed peer left
            # half-done. Whatever fails, their old entries and specs must not come back.
            replaced = {claim.uid for claim in planned if claim.uid in original.claims}
            # The commit as it will be if every spec is written: staged (written and fsync'd, not
            # yet in place) on the stager thread while the specs are written here, then published
            # there if they all were.
            commit = checkpoint
            for claim in planned:
                commit = commit.completed(claim.uid)
            publish: Future[bool] = Future()
            committing = self._stager.submit(_stage_and_publish, self.checkpoint_path, commit, publish)
            written: list[PreparedClaim] = []
            try:
                self._save(checkpoint, durable=False)
                self.fault("after-checkpoint-started")
                written = self._write_specs(planned, results)
            finally:
                publish.set_result(len(written) == len(planned))
                await _settled(committing)  # never leave the stager writing behind an exception
            try:
                staged = committing.result()  # raises what publishing raised
                if publish.result() and staged is not None:
                    self._remember(staged, commit)
                    # The commit's last step, after the answer (see the module docstring); the
                    # stager runs it before any later write of ours.
                    self.dir_synced = self._stager.submit(_sync_dir, self.plugin_dir)
                else:  # a spec failed (those claims are dropped), or staging did: commit plainly
                    for claim in planned:
                        done = claim in written
                        checkpoint = checkpoint.completed(claim.uid) if done else checkpoint.without(claim.uid)
                    # an adopted claim whose prepare failed stays adopted, its spec kept
                    checkpoint = checkpoint.adopting(self._readopted(original, [c for c in planned if c not in written]))
                    await self._on_stager(self._save, checkpoint)
                    self._remove_specs(c.uid for c in planned if c not in written and c.uid in replaced)
            except OSError as error:  # adopted claims stay adopted, with the devices their spec names now
                self._remove_specs(({c.uid for c in written} | replaced) - original.adopted.keys())
                for claim in written:
                    results[claim.uid] = PrepareResult(error=f"{claim.ref}: recording the prepared claim "
                                                             f"failed: {error}")
                await self._on_stager(self._save_quietly,
                                      original.without(*replaced).adopting(self._readopted(original, planned)))
                return
            self.fault("after-checkpoint-completed")
            for claim in written:
                results[claim.uid] = PrepareResult(claim)

    def _roll_back_half_done(self, checkpoint: ckpt.Checkpoint) -> ckpt.Checkpoint:
        """Roll back, as start-up would, the half-done prepares found under the node lock: a
        crashed instance's (a peer SIGKILLed during a rolling update; or this one, when a commit and
        its rollback both failed). Their specs are removed, except an adopted claim's, which stays
        adopted with the devices its spec names now. The kubelet, which got no answer for them,
        prepares them again. Returns the checkpoint without them, for the caller to save."""
        gone: list[str] = []
        kept: dict[str, list[tuple[str, str]]] = {}
        for uid in checkpoint.half_done:
            if uid in checkpoint.adopted:
                kept[uid] = self._spec_devices(uid, checkpoint.possible_devices(uid))
                continue
            try:
                self.cdi.remove(uid)
                gone.append(uid)
            except OSError as error:  # the entry stays: the next call or start tries again
                log.warning("removing the CDI spec of half-done claim %s failed: %s", uid, error)
        if gone or kept:
            log.info("rolled back the half-done prepare of claim(s) %s, left by an agent instance that "
                     "crashed", gone + list(kept))
        return checkpoint.rolled_back(*gone, *kept).adopting(kept)

    def _readopted(self, original: ckpt.Checkpoint,
                   failed: Iterable[PreparedClaim]) -> dict[str, list[tuple[str, str]]]:
        """The adoptions of the ``failed`` prepares' adopted claims: the devices their spec names
        now (the prepare may have rewritten it; if it cannot be read, the old and the new ones)."""
        return {c.uid: self._spec_devices(c.uid, original.started(c).possible_devices(c.uid))
                for c in failed if c.uid in original.adopted}

    def _spec_devices(self, claim_uid: str, known: Iterable[tuple[str, str]] = ()) -> list[tuple[str, str]]:
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

    async def _on_stager(self, function: Callable[..., T], *args: Any) -> T:
        job = self._stager.submit(function, *args)
        await _settled(job)
        return job.result()

    def _write_specs(self, planned: Sequence[PreparedClaim], results: dict[str, PrepareResult]) -> list[PreparedClaim]:
        """Each planned claim's CDI spec; the claims whose spec is there (or who need none). A
        failure is that claim's error in ``results``."""
        written: list[PreparedClaim] = []
        for claim in planned:
            if not claim.devices:  # nothing of ours in this claim: nothing to write
                written.append(claim)
                continue
            try:
                self.cdi.write(claim, durable=False)
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
                self.cdi.write(claim, durable=False)  # as in prepare: start-up rewrites what is lost
            except OSError as error:
                return PrepareResult(error=f"{claim.ref}: rewriting its missing CDI spec failed: {error}")
        return PrepareResult(claim)

    def _save_quietly(self, checkpoint: ckpt.Checkpoint) -> None:
        try:
            self._save(checkpoint)
        except OSError as error:  # the next start rolls the PrepareStarted entries back
            log.error("could not roll the checkpoint back: %s", error)

    # -- unprepare --------------------------------------------------------------------------------
    async def unprepare(self, refs: Sequence[ClaimRef], deadline: float | None = None) -> dict[str, str | None]:
        """The node lock on the loop (a peer holding it never blocks the loop); the rest, off the
        pod-start path and two durable writes, on the stager thread."""
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
                async with self._lock_async(deadline):
                    results.update(await self._on_stager(self._unprepare_locked, valid))
            except (OSError, ckpt.CheckpointError) as error:  # of the node, not of a claim
                log.error("unprepare on node %s failed: %s", self.node, error)  # the kubelet retries
                results.update((uid, f"claim {uid}: unpreparing on node {self.node} failed: {error}") for uid in valid)
        return results

    def _unprepare_locked(self, uids: Sequence[str]) -> dict[str, str | None]:
        """Unprepare ``uids`` (valid claim UIDs); the caller holds the node lock."""
        results: dict[str, str | None] = dict.fromkeys(uids)
        checkpoint = self._load()
        remaining = checkpoint.without(*uids)
        if remaining.half_done:
            remaining = self._roll_back_half_done(remaining)
        if remaining != checkpoint:
            self._save(remaining)
            self.fault("unprepare-after-checkpoint")
        removed = False
        for uid in uids:
            try:
                removed |= self.cdi.remove(uid)
            except OSError as error:
                results[uid] = f"claim {uid}: removing its CDI spec failed: {error}"
        if removed:
            try:
                self.cdi.sync()
            except OSError as error:
                log.warning("fsync of %s failed: %s", self.cdi.path, error)
        return results


async def _settled(job: Future[Any]) -> None:
    """Wait until the stager ``job`` is done; its outcome stays in it. Cancelled meanwhile (the
    agent shutting down), it still waits for the job, blocking (a job is at most a write and two
    fsyncs), before the cancellation goes on: what runs under the node lock ends before the lock
    is released."""
    done = asyncio.wrap_future(job)
    try:
        await asyncio.wait([done])
    except asyncio.CancelledError:
        wait([job])
        done.add_done_callback(_retrieved)  # its copy of the outcome arrives later: read it then
        raise
    _retrieved(done)  # the caller reads the outcome from ``job``; this copy counts as read


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Mark a future's exception as read (asyncio logs unread ones when they are collected)."""
    if not future.cancelled():
        future.exception()


def _stage_and_publish(path: Path, commit: ckpt.Checkpoint, publish: Future[bool]) -> bytes | None:
    """On the stager thread: stage ``commit`` (written and fsync'd into the scratch file); then, if
    ``publish`` says so once the specs are written, put it in place (rename, directory fsync).
    Returns the bytes staged; None when staging failed (the caller commits plainly instead, and
    meets the error again if the disk is really gone). Publishing's errors are raised."""
    try:
        data = ckpt.stage_commit(path, commit)
    except Exception as error:  # whatever it was, a plain commit is the way out
        log.warning("staging the checkpoint commit failed (%s); committing without staging", error)
        return None
    if publish.result():
        ckpt.publish_commit(path)
    return data


def _sync_dir(directory: Path) -> None:
    """On the stager thread, after prepare answered: the directory fsync that makes its commit's
    rename survive power loss. A failure changes no answer (the commit is in place for every
    reader and every restart short of a reboot, which voids it anyway), so it is logged."""
    try:
        fsutil.fsync_dir(directory)
    except OSError as error:
        log.error("fsync of %s after a prepare's commit failed: %s; the disk may be failing", directory, error)
