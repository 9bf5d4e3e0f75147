"""The CDI spec side of prepare and unprepare: each claim's spec written, answered again or
removed, a failure that claim's own error (or, where it follows another failure, a warning: a spec
left behind is an orphan start-up removes), so one claim's spec never fails its neighbours. What a
spec contains, and how a file is replaced, is :mod:`.cdi`'s."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from gpudra_driver.plugin.cdi import CdiDir
from gpudra_driver.plugin.driverfiles import DriverFilesError
from gpudra_driver.plugin.faults import FaultHook
from gpudra_driver.plugin.model import PreparedClaim, PrepareResult

log = logging.getLogger(__name__)


class ClaimSpecs:
    def __init__(self, cdi: CdiDir, node: str, fault: FaultHook) -> None:
        """``node``: the pool of the devices a spec names; ``fault``: the test-only crash hook."""
        self.cdi = cdi
        self.node = node
        self.fault = fault

    def write(self, planned: Sequence[PreparedClaim], results: dict[str, PrepareResult]) -> list[PreparedClaim]:
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

    def answer_again(self, claim: PreparedClaim) -> PrepareResult:
        """The answer for a claim prepared already; its spec written again if someone deleted it."""
        if claim.devices and not self.cdi.exists(claim.uid):  # someone deleted it: put it back
            try:
                self.cdi.write(claim)
            except OSError as error:
                return PrepareResult(error=f"{claim.ref}: rewriting its missing CDI spec failed: {error}")
        return PrepareResult(claim)

    def remove(self, uids: Sequence[str]) -> dict[str, str | None]:
        """Unprepare: each claim's spec removed; claim UID -> why its spec is still there, or None."""
        results: dict[str, str | None] = dict.fromkeys(uids)
        for uid in uids:
            try:
                self.cdi.remove(uid)
            except OSError as error:
                results[uid] = f"claim {uid}: removing its CDI spec failed: {error}"
        return results

    def remove_quietly(self, uids: Iterable[str]) -> None:
        """Best effort, after a failure: a spec left behind is an orphan that start-up removes."""
        for uid in uids:
            try:
                self.cdi.remove(uid)
            except OSError as error:
                log.warning("removing the CDI spec of claim %s failed: %s", uid, error)

    def held_devices(self, claim_uid: str, known: Iterable[tuple[str, str]] = ()) -> list[tuple[str, str]]:
        """The (pool, device) pairs the claim's spec on disk names: what an adopted claim holds.
        When the spec cannot be read, ``known``: what it may name (better to hold a device too
        many than to hand one a container may use to another claim)."""
        names = self.cdi.device_names(claim_uid)
        return list(known) if names is None else [(self.node, device) for device in names]
