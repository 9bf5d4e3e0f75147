"""Start-up recovery: make the checkpoint and the CDI directory agree before any kubelet call.

Runs once per agent start, under the node lock (a peer instance may be serving during a rolling
update), and again, under the lock a call holds, when a call finds the checkpoint corrupt
(:mod:`.state`): the same path, so a corruption while the agent runs costs no restart. What a
crash at any point can leave, and what happens to it, is decided by the pure
:func:`checkpoint.reconcile`; this module reads the disk, applies the decision and writes the result:

* half-done prepares (PrepareStarted) are rolled back: their specs go, the kubelet prepares again;
* completed claims whose spec is missing, or differs from what the checkpoint says, are rewritten;
* specs of ours with no completed entry (a crash in unprepare, between its checkpoint write and the
  spec removal) are orphans and removed; so are device metadata files (:mod:`.devicemetadata`)
  whose claim has neither an entry nor a kept spec; a completed claim's missing or differing
  metadata files are rewritten with its spec;
* temp files of interrupted writes are removed;
* MPS daemons (:mod:`.mps`) of claims no longer in the checkpoint are stopped, those of prepared
  claims started if they are not running;
* GPUs whose sharing settings (:mod:`.gpusettings`) a rolled-back claim asked for get the settings
  the remaining claims ask for, or their defaults.

A corrupt checkpoint (a failed checksum: a disk fault or a hand edit) is copied aside, and every
spec of ours is adopted with the devices it names, so running containers keep their devices and
nobody else is given them until the kubelet unprepares those claims. Found by a running agent, the
adopted claims keep the namespace and name it knew them by (a UID names one object forever), so
the leak sweep can look them up; found at start, nothing names them, and they stay adopted until
their unprepare comes or the node reboots.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time

from gpudra_driver.plugin import checkpoint as ckpt
from gpudra_driver.plugin.cdi import CdiDir
from gpudra_driver.plugin.driverfiles import DriverFilesError
from gpudra_driver.plugin.miglifecycle import MigLifecycle
from gpudra_driver.plugin.specs import ClaimSpecs
from gpudra_driver.plugin.sharing.controller import SharingController

log = logging.getLogger(__name__)


class Recovery:
    """The reconciliation of one node's checkpoint, CDI specs, MPS daemons and GPU settings."""

    def __init__(self, store: ckpt.CheckpointFile, specs: ClaimSpecs, sharing: SharingController, *,
                 boot_id: str, mig: MigLifecycle | None = None) -> None:
        self.store = store
        self.specs = specs
        self.sharing = sharing
        self.boot_id = boot_id
        self.mig = mig or MigLifecycle(None)

    def reconcile(self, known: ckpt.Checkpoint | None = None) -> ckpt.Reconciliation:
        """The start-up reconciliation (:meth:`DeviceState.recover`), for a caller holding the node lock. ``known``: the checkpoint this
        instance last read or wrote, whose claims' names the adopted ones keep."""
        store, cdi = self.store, self.specs.cdi
        read = _read(store)
        on_disk, listed = _list_specs(cdi)
        loaded = read if read is not None else self._adopt_kept_specs(on_disk, listed, known)
        # an adopted spec is forgotten only when the directory was read and it is not there
        result = ckpt.reconcile(loaded, on_disk if listed else on_disk | set(loaded.adopted))
        if listed and read is not None and result.checkpoint.adopted:
            # what kept specs name now: a crashed prepare of an adopted claim may have rewritten one
            # (a start that just adopted them has read them already)
            adopted = result.checkpoint.adopted
            result = dataclasses.replace(result, checkpoint=result.checkpoint.adopting(
                {uid: self.specs.held_devices(uid, pairs) for uid, pairs in adopted.items()}))
        if loaded.boot_id == self.boot_id:  # a reboot took every MIG instance with it
            self.mig.rolled_back(loaded, result.rolled_back)
        for uid in result.remove_specs:
            self.specs.remove_files(uid)
        stale = [e.claim for u, e in result.checkpoint.claims.items() if e.claim.devices and u in on_disk
                 and not self.specs.intact(e.claim)]
        result = dataclasses.replace(result, rewrite_specs=result.rewrite_specs + tuple(stale))
        for claim in result.rewrite_specs:
            try:
                self.specs.rewrite_metadata(claim)  # first: the spec mounts them
                cdi.write(claim)
            except DriverFilesError as error:  # the driver is being (re)loaded: never crash-loop on
                # it (running pods need their unprepare); a missing spec is written again when the
                # kubelet next asks to prepare the claim
                kept = "is kept as it is" if cdi.exists(claim.uid) else "is missing"
                log.warning("%s: its CDI spec %s; it cannot be brought up to date now: %s", claim.ref, kept, error)
        if on_disk or cdi.path.is_dir():
            cdi.remove_temp_files()
        if listed:  # device metadata no entry or kept spec names (a crash before its spec or in unprepare)
            self.specs.remove_orphans(set(result.checkpoint.claims) | set(result.checkpoint.adopted), temp_files=True)
        # MPS daemons: those of claims gone or rolled back stop, those of prepared claims run, those of
        # adopted claims stay as they are
        for uid, problem in self.sharing.converge_mps(result.checkpoint).items():
            log.warning("claim %s: %s", uid, problem)
        # GPUs recorded as touched get what their remaining holders ask, or their defaults back
        # (a claim rolled back, a crash between a checkpoint write and a reset, a reset that failed)
        settled = result.checkpoint
        if settled.touched:
            settled = settled.untouched(self.sharing.converge_gpus(settled))
            result = dataclasses.replace(result, checkpoint=settled)
        if result.checkpoint != read or not store.is_cached:
            # no file, or not one this boot can use (another boot's is replaced too: read once,
            # warned once): write the reconciled one
            store.save(result.checkpoint)
        for leftover in store.leftovers():
            os.unlink(leftover)
        if result.changed:
            log.info("reconciliation: rolled back %s, removed orphan specs %s, rewrote specs %s",
                     list(result.rolled_back), list(result.remove_specs), [c.uid for c in result.rewrite_specs])
        return result

    def _adopt_kept_specs(self, on_disk: set[str], listed: bool, known: ckpt.Checkpoint | None) -> ckpt.Checkpoint:
        """In place of a corrupt checkpoint: every spec of ours adopted, with the devices it names,
        and the name ``known`` gives its claim. Where the devices cannot be told, the start stops
        (the next one tries again) rather than forget a spec or a device a running container may use."""
        path, cdi = self.store.path, self.specs.cdi
        if not listed:
            raise RuntimeError(f"{path} is unusable and the CDI directory {cdi.path} "
                               "cannot be read: cannot tell which specs running containers need")
        named = {uid: cdi.device_names(uid) for uid in on_disk}
        if unreadable := sorted(uid for uid, names in named.items() if names is None):
            raise RuntimeError(f"{path} is unusable and the CDI specs of claim(s) {', '.join(unreadable)} "
                               "cannot be read: cannot tell which devices running containers hold")
        return ckpt.Checkpoint(self.boot_id).adopting(
            {uid: [(self.specs.node, device) for device in names or ()] for uid, names in named.items()}).naming(
            _known_names(known, on_disk))


def _read(store: ckpt.CheckpointFile) -> ckpt.Checkpoint | None:
    """The checkpoint; None when it is corrupt (then a copy is set aside; the file itself stays
    until the checkpoint recording the kept specs replaces it, so that a crash before then finds
    it, and keeps them, again). A newer agent's stops the start."""
    try:
        return store.load()
    except ckpt.NewerCheckpoint as error:
        raise RuntimeError(f"{store.path}: {error}") from None
    except ckpt.CheckpointError as error:
        aside = store.path.with_name(f"{store.path.name}.corrupt-{time.time_ns()}")  # one per corruption
        shutil.copyfile(store.path, aside)
        log.error("checkpoint %s is unusable (%s); a copy is in %s. Existing CDI specs are kept for "
                  "running containers, and their devices held, until the kubelet unprepares their "
                  "claims", store.path, error, aside)
        return None


def _list_specs(cdi: CdiDir) -> tuple[set[str], bool]:
    """The claim UIDs with a spec of ours, and whether the directory could be listed at all."""
    try:
        cdi.path.mkdir(parents=True, exist_ok=True)
        return cdi.claim_uids(), True
    except OSError as error:
        log.error("CDI directory %s is unusable: %s", cdi.path, error)
        return set(), False


def _known_names(known: ckpt.Checkpoint | None, uids: set[str]) -> dict[str, tuple[str, str]]:
    """The (namespace, name) ``known`` records for ``uids``: its entries' and its adoptions'."""
    if known is None:
        return {}
    names = {uid: (e.claim.ref.namespace, e.claim.ref.name) for uid, e in known.claims.items() if uid in uids}
    return {**{uid: n for uid, n in known.adopted_names.items() if uid in uids}, **names}
