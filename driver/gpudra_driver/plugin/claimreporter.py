"""The I/O shell of :mod:`.claimreport`: claim status written, the per-pod series served.

The kubelet's call is answered first; the status write follows on its own task, so an API server
that is slow or down never delays a pod's start (the kubelet does not read the status). Nor do the
writes compete with the calls for the CPU: they wait until the kubelet has made no call for
:data:`QUIET` seconds (a burst of pod starts first), or at most :data:`MAX_DEFER`. Writes
are queued per claim, the latest wanted state replacing an older one not yet written, and sent one
at a time with each request's deadline. A failure the API server may get over (a timeout, 429, 5xx)
is retried with backoff; an answer that will not change (the claim gone, re-created, no longer
allocated these devices, or this agent not allowed) drops the write, logged.

An agent that restarts, or a peer instance during a rolling update, learns what is prepared from
the checkpoint (:meth:`refresh`) and what the API server holds from the leak sweep's periodic GET
of every prepared claim (:meth:`seen`), and writes only what is missing. The sweep's GET also
refreshes which pods hold each claim (a pod that joins a shared claim is seen at once: the kubelet
prepares the claim again for it).

The info series (:class:`gpudra_driver.metrics.ClaimDevices`) are kept as an immutable snapshot
that the metrics thread reads."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from gpudra_core.devicemodel import Device
from gpudra_core.kubeapi import Kube, Obj, error_message
from gpudra_driver import metrics
from gpudra_driver.plugin.claimreport import (INFO_LABELS, consumer_pods, device_status_entries, generation_of,
                                              info_series, live_entries, same_entries, status_apply)
from gpudra_driver.plugin.model import ClaimRef, PreparedClaim

log = logging.getLogger(__name__)

INFO_METRIC = metrics.ClaimDevices.NAME
MAX_BACKOFF = 60.0
QUIET = 0.5  # seconds without a kubelet call before a status write goes
MAX_DEFER = 30.0  # ... or since the oldest write waiting, under a steady stream of calls
# Answers that will not change by asking again: not found, UID precondition failed (re-created),
# invalid (no longer allocated these devices), forbidden (RBAC or the admission policy).
_FINAL = (403, 404, 409, 422)


def write_delay(now: float, last_call: float, pending_since: float) -> float:
    """Seconds before the next status write may go (0: now): until the kubelet has been quiet for
    :data:`QUIET`, unless the oldest write has waited :data:`MAX_DEFER` already (pure)."""
    if now - pending_since >= MAX_DEFER:
        return 0.0
    return max(0.0, min(QUIET - (now - last_call), MAX_DEFER - (now - pending_since)))


class ClaimReporter:
    def __init__(self, kube: Kube | None, *, driver: str, node: str,
                 prepared_claims: Callable[[], Sequence[PreparedClaim]], write_status: bool = True) -> None:
        """``kube``: writes the status (None, or ``write_status`` False: only the series are kept)."""
        self.kube = kube if write_status else None
        self.driver, self.node = driver, node
        self.prepared_claims = prepared_claims
        self.published: Mapping[str, Device] = {}
        self._claims: dict[str, PreparedClaim] = {}
        self._pods: dict[str, tuple[str, ...]] = {}
        self._pending: dict[str, tuple[ClaimRef, Obj]] = {}  # claim UID -> the apply still to send
        self._pending_since = 0.0  # monotonic: when the oldest write waiting was queued
        self._last_call = float("-inf")  # monotonic: the kubelet's last prepare or unprepare
        # what the kubelet's calls told, taken in by the writer's task: nothing but an append on the
        # call's own path (claim, its live object) for a prepare, (ref, None) for an unprepare
        self._calls: list[tuple[PreparedClaim, Mapping[str, Any] | None] | tuple[ClaimRef, None]] = []
        self._wake = asyncio.Event()
        self._series: tuple[tuple[str, ...], ...] = ()
        metrics.CLAIM_DEVICES.labels, metrics.CLAIM_DEVICES.series = INFO_LABELS, lambda: self._series

    # -- what the plugin and the sweep tell it (on the event loop) ------------------------------------
    def set_devices(self, devices: Sequence[Device]) -> None:
        self.published = {d.name: d for d in devices}
        self._snapshot()

    def refresh(self) -> None:
        """The checkpoint's prepared claims become the ones reported (a peer instance's included)."""
        claims = {c.uid: c for c in self.prepared_claims()}
        self._claims = claims
        self._pods = {uid: pods for uid, pods in self._pods.items() if uid in claims}
        self._snapshot()

    def prepared(self, claim: PreparedClaim, live: Mapping[str, Any] | None) -> None:
        """``claim`` was prepared (or answered again) with ``live`` read just before. Called before
        the kubelet's answer goes: only noted here, taken in by :meth:`take_calls`."""
        self._last_call = time.monotonic()
        self._calls.append((claim, live))
        self._wake.set()

    def unprepared(self, ref: ClaimRef) -> None:
        """``ref`` was unprepared (noted as :meth:`prepared`)."""
        self._last_call = time.monotonic()
        self._calls.append((ref, None))
        self._wake.set()

    def take_calls(self) -> None:
        """The prepares and unprepares noted since the last time: the series, and the writes."""
        calls, self._calls = self._calls, []
        for subject, live in calls:
            if isinstance(subject, PreparedClaim):
                self._claims[subject.uid] = subject
                self._pods[subject.uid] = consumer_pods(live)
                self._want(subject, live)
            else:
                self._claims.pop(subject.uid, None)
                self._pods.pop(subject.uid, None)
                if self.kube is not None:
                    self._queue(subject, status_apply(subject, []))
        if calls:
            self._snapshot()

    def seen(self, ref: ClaimRef, live: Mapping[str, Any] | None) -> None:
        """The leak sweep read a prepared claim: its pods, and its status if ours is missing."""
        claim = self._claims.get(ref.uid)
        if claim is None or live is None or (live.get("metadata") or {}).get("uid") != ref.uid:
            return
        self._pods[ref.uid] = consumer_pods(live)
        self._snapshot()
        self._want(claim, live)

    def _want(self, claim: PreparedClaim, live: Mapping[str, Any] | None) -> None:
        if self.kube is None:
            return
        entries = device_status_entries(claim, driver=self.driver, node=self.node, generation=generation_of(live),
                                        published=self.published, now=time.time())
        if live is not None and same_entries(live_entries(live, self.driver), entries):
            self._pending.pop(claim.uid, None)  # written already (by this or an earlier instance)
            return
        self._queue(claim.ref, status_apply(claim.ref, entries))

    def _queue(self, ref: ClaimRef, body: Obj) -> None:
        if not self._pending:
            self._pending_since = time.monotonic()
        self._pending[ref.uid] = (ref, body)
        self._wake.set()

    # -- the writer ------------------------------------------------------------------------------
    async def run(self, refresh_interval: float = 60.0) -> None:
        """Take in the calls, write the queued statuses (none without ``kube``), and refresh the
        reported claims from the checkpoint."""
        backoff, refreshed = 0.0, time.monotonic()
        self.refresh()
        while True:
            if not self._pending and not self._calls:
                self._wake.clear()
                try:
                    async with asyncio.timeout(refresh_interval):
                        await self._wake.wait()
                except TimeoutError:
                    pass
            self.take_calls()
            if time.monotonic() - refreshed >= refresh_interval:
                self.refresh()
                refreshed = time.monotonic()
            if not self._pending:
                continue
            if (wait := write_delay(time.monotonic(), self._last_call, self._pending_since)) > 0:
                await asyncio.sleep(wait)  # the kubelet's calls first, not a synchronisation
                continue
            uid = next(iter(self._pending))
            ref, body = self._pending.pop(uid)
            assert self.kube is not None  # nothing is queued without it
            try:
                await self.kube.apply(body, subresource="status")
                backoff = 0.0
            except ApiException as error:
                if error.status in _FINAL:
                    log.warning("status of %s not written (%s): %s", ref, error.status, error_message(error))
                    continue
                backoff = self._retry_later(uid, ref, body, backoff, error)
            except (OSError, TimeoutError) as error:  # no answer: the API server may be restarting
                backoff = self._retry_later(uid, ref, body, backoff, error)
            if backoff:
                await asyncio.sleep(backoff)  # backoff before the next write, not a synchronisation

    def _retry_later(self, uid: str, ref: ClaimRef, body: Obj, backoff: float, error: BaseException) -> float:
        if uid not in self._pending:  # a newer wanted state queued meanwhile wins
            self._queue(ref, body)
        log.info("writing the status of %s failed (%s); retrying", ref, error_message(error) or repr(error))
        return min(MAX_BACKOFF, max(0.5, backoff * 2))

    # -- the info series (read by the metrics thread: an immutable snapshot, swapped whole) ----------
    def _snapshot(self) -> None:
        self._series = tuple(s for uid, claim in sorted(self._claims.items())
                             for s in info_series(claim, self._pods.get(uid, ()), self.published))
