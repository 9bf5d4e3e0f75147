"""Undoing prepares that did not complete, while the agent runs: a crashed peer's half-done ones
(and the orphan specs of its one-write prepares) found under the node lock, and this call's own
when its commit fails. The kubelet got no answer
for them and prepares them again, so nothing of theirs may stay: their specs, MPS daemons, GPU
settings and dynamic MIG instances go. Except an adopted claim's (kept from a corrupt checkpoint: its pods may still run),
which stays adopted with the devices its spec names now. Start-up's rollback is :mod:`.recovery`'s."""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Sequence

from gpudra_driver.plugin.checkpoint import Checkpoint, CheckpointFile
from gpudra_driver.plugin.miglifecycle import MigLifecycle
from gpudra_driver.plugin.model import PreparedClaim
from gpudra_driver.plugin.specs import ClaimSpecs
from gpudra_driver.plugin.sharing.controller import SharingController

log = logging.getLogger(__name__)


class Rollback:
    def __init__(self, store: CheckpointFile, specs: ClaimSpecs, sharing: SharingController,
                 mig: MigLifecycle | None = None) -> None:
        self.store = store
        self.specs = specs
        self.sharing = sharing
        self.mig = mig or MigLifecycle(None)

    def half_done(self, checkpoint: Checkpoint) -> Checkpoint:
        """Roll back, as start-up would, the half-done prepares found under the node lock: a crashed
        instance's (a peer SIGKILLed during a rolling update; or this one, when a commit and its
        rollback both failed). Their specs are removed, except an adopted claim's, which stays
        adopted with the devices its spec names now. The kubelet, which got no answer for them,
        prepares them again. Returns the checkpoint without them, for the caller to save."""
        gone: list[str] = []
        kept: dict[str, list[tuple[str, str]]] = {}
        self.mig.rolled_back(checkpoint, checkpoint.half_done)
        for uid in checkpoint.half_done:
            if uid in checkpoint.adopted:
                kept[uid] = self.specs.held_devices(uid, checkpoint.possible_devices(uid))
                continue
            try:
                self.specs.remove_files(uid)
                gone.append(uid)
            except OSError as error:  # the entry stays: the next call or start tries again
                log.warning("removing the CDI spec of half-done claim %s failed: %s", uid, error)
        if gone or kept:
            log.info("rolled back the half-done prepare of claim(s) %s, left by an agent instance that "
                     "crashed", gone + list(kept))
        rolled = checkpoint.rolled_back(*gone, *kept).adopting(kept)
        self.sharing.converge_mps_quietly(rolled)
        return rolled.untouched(self.sharing.settle(checkpoint, rolled))

    def orphan_specs(self, checkpoint: Checkpoint, keep: Collection[str] = ()) -> None:
        """Best effort: remove the specs, and device metadata files, of ours that no entry of
        ``checkpoint`` names (other than ``keep``'s). Under the node lock no live instance is between a spec and its commit, so such
        a spec is what an instance killed there left of a one-write prepare (:func:`.plan.
        needs_prepare_started`); the kubelet got no answer for it, and no container names it."""
        try:
            orphans = self.specs.cdi.claim_uids() - checkpoint.claims.keys() - checkpoint.adopted.keys() - set(keep)
        except OSError as error:
            log.warning("listing the CDI directory for orphan specs failed: %s", error)
            return
        if orphans:
            log.info("removing the CDI specs of claim(s) %s, left by an agent instance that crashed before "
                     "their commit", sorted(orphans))
            self.specs.remove_quietly(orphans)
        # their metadata files, and those a crash between the files and the spec left
        self.specs.remove_orphans(set(checkpoint.claims) | set(checkpoint.adopted) | set(keep))

    def readopted(self, original: Checkpoint, failed: Iterable[PreparedClaim]) -> dict[str, list[tuple[str, str]]]:
        """The adoptions of the ``failed`` prepares' adopted claims: the devices their spec names
        now (the prepare may have rewritten it; if it cannot be read, the old and the new ones)."""
        return {c.uid: self.specs.held_devices(c.uid, original.started(c).possible_devices(c.uid))
                for c in failed if c.uid in original.adopted}

    def failed_commit(self, original: Checkpoint, attempted: Checkpoint, settled: Checkpoint,
                      planned: Sequence[PreparedClaim], written: Iterable[PreparedClaim],
                      replaced: Collection[str]) -> None:
        """Best effort, after a prepare's checkpoint write failed: back to ``original`` without the
        ``replaced`` entries (whatever fails, a claim allocated anew must not get its old entry and
        spec back), the ``written`` specs removed, the MPS daemons and the GPU settings (``settled``:
        those in effect) converged to it. ``attempted``: the checkpoint the prepare went for; the
        GPUs it touched stay recorded until their defaults are back. What fails here is left for
        the next call or start (the PrepareStarted entries are rolled back then)."""
        self.specs.remove_quietly(({c.uid for c in written} | set(replaced)) - original.adopted.keys())
        rolled_back = original.without(*replaced).adopting(self.readopted(original, planned))
        self.sharing.converge_mps_quietly(rolled_back)
        rolled_back = rolled_back.touching(attempted.touched).untouched(self.sharing.settle(settled, rolled_back))
        try:
            self.store.save(rolled_back)
        except OSError as error:  # the next call or start rolls the PrepareStarted entries back
            log.error("could not roll the checkpoint back: %s", error)
