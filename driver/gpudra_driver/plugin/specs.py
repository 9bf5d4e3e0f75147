"""The CDI spec side of prepare and unprepare: each claim's spec written, answered again or
removed, a failure that claim's own error (or, where it follows another failure, a warning: a spec
left behind is an orphan start-up removes), so one claim's spec never fails its neighbours. What a
spec contains, and how a file is replaced, is :mod:`.cdi`'s.

A claim's device metadata files (:mod:`.devicemetadata`) go with its spec: written before it (the
spec names them), removed after it. So a spec on disk always finds its files, and files without a
spec are what a crash left: no entry names their claim, and orphan cleanup removes them with the
orphan specs (:meth:`remove_orphans`)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from gpudra_driver.plugin.cdi import CdiDir
from gpudra_driver.plugin.devicemetadata import MetadataFiles
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
        self.metadata = None if cdi.metadata_root is None else MetadataFiles(cdi.metadata_root, cdi.driver,
                                                                             cdi.legacy_metadata_roots)

    def write_files(self, claim: PreparedClaim) -> None:
        """The claim's metadata files, then its spec (which mounts them)."""
        if claim.metadata is not None and self.metadata is not None:
            self.metadata.write(claim)
            self.fault("after-metadata-write")
        self.cdi.write(claim)

    def remove_files(self, uid: str) -> None:
        """The claim's spec, then its metadata files (a spec never names missing files)."""
        if failed := self._remove_all([uid]):
            raise failed[uid]

    def write(self, planned: Sequence[PreparedClaim], results: dict[str, PrepareResult]) -> list[PreparedClaim]:
        """Each planned claim's CDI spec; the claims whose spec is there (or who need none). A
        failure is that claim's error in ``results``."""
        written: list[PreparedClaim] = []
        for claim in planned:
            if not claim.devices:  # nothing of ours in this claim: nothing to write
                written.append(claim)
                continue
            try:
                self.write_files(claim)
                written.append(claim)
                self.fault("after-cdi-write")
            except DriverFilesError as error:  # the node's driver is not ready for it: retryable
                results[claim.uid] = PrepareResult(error=f"{claim.ref}: {error}")
                self._drop_unused_metadata(claim.uid)
            except OSError as error:
                results[claim.uid] = PrepareResult(error=f"{claim.ref}: writing its CDI spec into "
                                                         f"{self.cdi.path} failed: {error}")
                self._drop_unused_metadata(claim.uid)
        return written

    def _drop_unused_metadata(self, uid: str) -> None:
        """After a failed write: the claim's metadata files, unless a spec (an adopted claim's, one
        being replaced) mounts them; what stays is an orphan for the next cleanup."""
        if self.metadata is not None and not self.cdi.exists(uid):
            for error in self.metadata.remove([uid]).values():
                log.warning("removing the device metadata of claim %s failed: %s", uid, error)

    def answer_again(self, claim: PreparedClaim) -> PrepareResult:
        """The answer for a claim prepared already; its spec and metadata files written again if
        someone deleted them."""
        if claim.devices and (not self.cdi.exists(claim.uid) or not self.metadata_matches(claim)):
            try:  # someone deleted it: put it back
                self.write_files(claim)
            except OSError as error:
                return PrepareResult(error=f"{claim.ref}: rewriting its missing CDI spec failed: {error}")
        return PrepareResult(claim)

    def remove(self, uids: Sequence[str]) -> dict[str, str | None]:
        """Unprepare: each claim's spec removed, then its metadata files (all claims' in one
        listing); claim UID -> why its spec or files are still there, or None."""
        errors = self._remove_all(uids)
        results: dict[str, str | None] = dict.fromkeys(uids)
        for uid, error in errors.items():
            results[uid] = f"claim {uid}: removing its CDI spec or device metadata failed: {error}"
        return results

    def remove_quietly(self, uids: Iterable[str]) -> None:
        """Best effort, after a failure: a spec left behind is an orphan that start-up removes."""
        for uid, error in self._remove_all(list(uids)).items():
            log.warning("removing the CDI spec or device metadata of claim %s failed: %s", uid, error)

    def _remove_all(self, uids: Sequence[str]) -> dict[str, OSError]:
        """The claims' specs, then the metadata files of those whose spec is gone (a spec never
        names missing files); claim UID -> the first error."""
        failed: dict[str, OSError] = {}
        for uid in uids:
            try:
                self.cdi.remove(uid)
            except OSError as error:
                failed[uid] = error
        if self.metadata is not None:
            failed.update(self.metadata.remove([uid for uid in uids if uid not in failed]))
        return failed

    def metadata_matches(self, claim: PreparedClaim) -> bool:
        """True when the claim needs no metadata files or has them as recorded (where this release
        puts them, or where the release that prepared it did)."""
        return claim.metadata is None or self.metadata is None or self.metadata.root_of(claim) is not None

    def intact(self, claim: PreparedClaim) -> bool:
        """Start-up: the claim's spec and metadata files are as recorded, the spec mounting the
        files where they are (a claim an earlier release prepared keeps both as they are)."""
        if claim.metadata is None or self.metadata is None:
            return self.cdi.matches(claim)
        root = self.metadata.root_of(claim)
        return root is not None and self.cdi.matches(claim, root)

    def rewrite_metadata(self, claim: PreparedClaim) -> None:
        """Start-up, before its spec is written again (mounting this release's directory): a
        prepared claim's metadata files there as recorded."""
        if claim.metadata is not None and self.metadata is not None and not self.metadata.holds(claim):
            self.metadata.write(claim)

    def remove_orphans(self, keep: set[str], *, temp_files: bool = False) -> None:
        """Best effort: the metadata files of claims not in ``keep`` (no entry, no adoption: what a
        crash between them and the commit, or in unprepare, left); with ``temp_files`` (at start-up:
        only a crash leaves them), the temp files of interrupted writes."""
        if self.metadata is None:
            return
        try:
            for uid, error in self.metadata.remove(self.metadata.claim_uids() - keep).items():
                log.warning("removing the orphan device metadata of claim %s failed: %s", uid, error)
            if temp_files:
                self.metadata.remove_temp_files()
                self.metadata.remove_empty_legacy_roots()
        except OSError as error:
            log.warning("removing orphan device metadata under %s failed: %s", self.metadata.root, error)

    def held_devices(self, claim_uid: str, known: Iterable[tuple[str, str]] = ()) -> list[tuple[str, str]]:
        """The (pool, device) pairs the claim's spec on disk names: what an adopted claim holds.
        When the spec cannot be read, ``known``: what it may name (better to hold a device too
        many than to hand one a container may use to another claim)."""
        names = self.cdi.device_names(claim_uid)
        return list(known) if names is None else [(self.node, device) for device in names]
