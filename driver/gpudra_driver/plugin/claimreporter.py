"""The I/O shell of :mod:`.claimreport`: claim status written, the per-pod series served.

The kubelet's call is answered first; the status write follows on its own task, so an API server
that is slow or down never delays a pod's start (the kubelet does not read the status). Nor do the
writes compete with the calls for the CPU: they wait until the kubelet has made no call for
:data:`QUIET` seconds (a burst of pod starts first), or at most :data:`MAX_DEFER`. Writes
are queued per claim, the latest wanted state replacing an older one not yet written, and sent one
at a time with each request's deadline. A failure the API server may get over (a timeout, 429, 5xx)
is retried with backoff; an answer that will not change (the claim gone, re-created, no longer
allocated these devices, or this agent not allowed) drops the write, logged and counted.

A claim whose opaque config parameters the API server stores in other bytes than it re-encodes them
to (created with whitespace or unsorted keys) refuses the apply: ``status.allocation: field is
immutable`` (see :func:`.claimreport.allocation_refused`). The write is then made again as a merge
patch tied to the resourceVersion read, which passes where the parameters are compact (unsorted
keys: Go clients), and so is their withdrawal (an apply, answered 200, leaves entries that an
Update wrote); where it too is refused (JSON with whitespace: Python's json default) nothing
this agent can send passes, and it says so once for the claim: a warning, an Event on the claim,
``gpudra_agent_claim_status_refused_total{reason="allocation-immutable"}``; no more writes for it.

An agent that restarts, or a peer instance during a rolling update, learns what is prepared from
the checkpoint (:meth:`refresh`) and what the API server holds from the leak sweep's periodic GET
of every prepared claim (:meth:`seen`), and writes only what is missing. The sweep's GET also
refreshes which pods hold each claim (a pod that joins a shared claim is seen at once: the kubelet
prepares the claim again for it).

The info series (:class:`gpudra_driver.metrics.ClaimDevices`) are kept per claim, in a mapping
swapped whole (never changed once published) that the metrics thread flattens, in claim order, at
each scrape: a call builds the series of the claims it changed only (the mapping is copied, not
rebuilt), where it used to build every held claim's."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from gpudra_core.devicemodel import Device
from gpudra_core.kubeapi import Kube, Obj, core_event, error_message, resource_type
from gpudra_driver import metrics
from gpudra_driver.plugin.claimreport import (INFO_LABELS, allocation_refused, carries_exactly, consumer_pods,
                                              device_status_entries, entries_of, generation_of, info_series,
                                              live_entries, refusal_message, same_entries, status_apply,
                                              status_merge_patch)
from gpudra_driver.plugin.model import ClaimRef, PreparedClaim

log = logging.getLogger(__name__)

INFO_METRIC = metrics.ClaimDevices.NAME
MAX_BACKOFF = 60.0
QUIET = 0.5  # seconds without a kubelet call before a status write goes
MAX_DEFER = 30.0  # ... or since the oldest write waiting, under a steady stream of calls
# Answers that will not change by asking again: not found, UID precondition failed (re-created),
# invalid (no longer allocated these devices), forbidden (RBAC or the admission policy).
_FINAL = (403, 404, 409, 422)
_REASONS = {403: "forbidden", 404: "not-found", 409: "conflict", 422: "invalid"}
CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")
COMPONENT = "gpudra-agent"


class _Changed(Exception):
    """The claim changed between the read and the merge patch tied to it: retried."""


class _Refused(Exception):
    """Every status write to this claim is refused (:func:`.claimreport.allocation_refused`)."""


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
        self._refused: set[str] = set()  # claim UIDs whose status the API server refuses (said once)
        self._pending_since = 0.0  # monotonic: when the oldest write waiting was queued
        self._last_call = float("-inf")  # monotonic: the kubelet's last prepare or unprepare
        # what the kubelet's calls told, taken in by the writer's task: nothing but an append on the
        # call's own path (claim, its live object) for a prepare, (ref, None) for an unprepare
        self._calls: list[tuple[PreparedClaim, Mapping[str, Any] | None] | tuple[ClaimRef, None]] = []
        self._wake = asyncio.Event()
        self._series: Mapping[str, tuple[tuple[str, ...], ...]] = {}  # claim UID -> its series; swapped whole
        metrics.CLAIM_DEVICES.labels, metrics.CLAIM_DEVICES.series = INFO_LABELS, self.series

    # -- what the plugin and the sweep tell it (on the event loop) ------------------------------------
    def set_devices(self, devices: Sequence[Device]) -> None:
        self.published = {d.name: d for d in devices}
        self._snapshot_all()

    def refresh(self) -> None:
        """The checkpoint's prepared claims become the ones reported (a peer instance's included)."""
        claims = {c.uid: c for c in self.prepared_claims()}
        self._claims = claims
        self._pods = {uid: pods for uid, pods in self._pods.items() if uid in claims}
        self._refused &= claims.keys()
        self._snapshot_all()

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
        changed: set[str] = set()
        for subject, live in calls:
            changed.add(subject.uid)
            if isinstance(subject, PreparedClaim):
                self._claims[subject.uid] = subject
                self._pods[subject.uid] = consumer_pods(live)
                self._want(subject, live)
            else:
                self._claims.pop(subject.uid, None)
                self._pods.pop(subject.uid, None)
                if subject.uid in self._refused:  # nothing of ours was written: nothing to withdraw
                    self._refused.discard(subject.uid)
                    self._pending.pop(subject.uid, None)
                elif self.kube is not None:
                    self._queue(subject, status_apply(subject, []))
        if changed:
            self._snapshot(changed)

    def seen(self, ref: ClaimRef, live: Mapping[str, Any] | None) -> None:
        """The leak sweep read a prepared claim: its pods, and its status if ours is missing."""
        claim = self._claims.get(ref.uid)
        if claim is None or live is None or (live.get("metadata") or {}).get("uid") != ref.uid:
            return
        if (pods := consumer_pods(live)) != self._pods.get(ref.uid):
            self._pods[ref.uid] = pods
            self._snapshot({ref.uid})
        self._want(claim, live)

    def _want(self, claim: PreparedClaim, live: Mapping[str, Any] | None) -> None:
        if self.kube is None or claim.uid in self._refused:
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
                await self._write(ref, body)
                backoff = 0.0
            except _Refused as refused:
                await self._refuse(ref, str(refused))
            except ApiException as error:
                if error.status in _FINAL:
                    metrics.CLAIM_STATUS_REFUSED.labels(_REASONS[error.status]).inc()
                    log.warning("status of %s not written (%s): %s", ref, error.status, error_message(error))
                    continue
                backoff = self._retry_later(uid, ref, body, backoff, error)
            except (_Changed, OSError, TimeoutError) as error:  # no answer, or a newer claim to read: the API server may be restarting
                backoff = self._retry_later(uid, ref, body, backoff, error)
            if backoff:
                await asyncio.sleep(backoff)  # backoff before the next write, not a synchronisation

    async def _write(self, ref: ClaimRef, body: Obj) -> None:
        """The apply; where the allocation check refuses it, or it leaves entries an earlier merge
        patch wrote (a withdrawal: the apply owns none of them), a merge patch of what was read."""
        assert self.kube is not None
        try:
            applied = await self.kube.apply(body, subresource="status")
            if carries_exactly(applied, self.driver, entries_of(body)):
                return
        except ApiException as error:
            if not allocation_refused(error.status or 0, error_message(error)):
                raise
        live = await self.kube.get(CLAIM, ref.name, ref.namespace)
        if live is None or live["metadata"]["uid"] != ref.uid:
            return  # gone or re-created: nothing to write (the unprepare or the sweep follows)
        patch = status_merge_patch(live, self.driver, entries_of(body))
        try:
            await self.kube.patch(CLAIM, ref.name, patch, namespace=ref.namespace, subresource="status")
        except ApiException as error:
            if allocation_refused(error.status or 0, error_message(error)):
                raise _Refused(error_message(error)) from error
            if error.status == 409:  # written in between: read again, after the backoff
                raise _Changed("the claim changed while its status was written") from error
            raise

    async def _refuse(self, ref: ClaimRef, answer: str) -> None:
        """Said once per claim: the log, the metric and an Event on the claim."""
        if ref.uid in self._refused:
            return
        self._refused.add(ref.uid)
        self._pending.pop(ref.uid, None)
        metrics.CLAIM_STATUS_REFUSED.labels("allocation-immutable").inc()
        message = refusal_message(f"{ref.namespace}/{ref.name}")
        log.warning("%s (the API server: %s)", message, answer[-300:])
        involved = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "name": ref.name,
                    "namespace": ref.namespace, "uid": ref.uid}
        event = core_event(involved, "Warning", "StatusNotWritten", message, component=COMPONENT, host=self.node)
        event["metadata"]["namespace"] = ref.namespace  # a namespaced object's Events are in its namespace
        assert self.kube is not None
        try:
            await self.kube.create(event)
        except (ApiException, OSError, TimeoutError) as error:
            log.info("the Event on %s was not posted: %s", ref, error_message(error) or repr(error))

    def _retry_later(self, uid: str, ref: ClaimRef, body: Obj, backoff: float, error: BaseException) -> float:
        if uid not in self._pending:  # a newer wanted state queued meanwhile wins
            self._queue(ref, body)
        log.info("writing the status of %s failed (%s); retrying", ref, error_message(error) or repr(error))
        return min(MAX_BACKOFF, max(0.5, backoff * 2))

    # -- the info series (read by the metrics thread: an immutable snapshot, swapped whole) ----------
    def series(self) -> list[tuple[str, ...]]:
        """Every claim's series, by claim UID (for the metrics thread: reads one published mapping)."""
        return [s for _, claim_series in sorted(self._series.items()) for s in claim_series]

    def _series_of(self, uid: str) -> tuple[tuple[str, ...], ...]:
        return tuple(info_series(self._claims[uid], self._pods.get(uid, ()), self.published))

    def _snapshot(self, uids: set[str]) -> None:
        """The series of the claims ``uids`` made again (a new mapping: the published one never
        changes under the metrics thread)."""
        series = dict(self._series)
        for uid in uids:
            if uid in self._claims:
                series[uid] = self._series_of(uid)
            else:
                series.pop(uid, None)
        self._series = series

    def _snapshot_all(self) -> None:
        self._series = {uid: self._series_of(uid) for uid in self._claims}
