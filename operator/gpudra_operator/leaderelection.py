"""One active operator among its replicas: a coordination.k8s.io Lease (docs/ha.md).

The protocol is client-go's (k8s.io/client-go tools/leaderelection/leaderelection.go,
``tryAcquireOrRenew``): read the Lease; create it if missing; replace it under the resourceVersion
read (so that of two candidates only one succeeds) when :func:`may_take` allows. It is not
kubernetes-asyncio's ``leaderelection`` module, which measures the holder's term on the wall clock
(``time.time()``: a step of the clock forward by a few seconds lets a standby take a live Lease),
and whose requests have no timeout, no release (tomplus/kubernetes_asyncio#411) and no watch.
What fencing needs is here:

* The holder acts only until ``renew_deadline`` after the start of its last successful renewal,
  measured on its own monotonic clock; a watchdog thread (:class:`Fence`) ends the process there.
  A standby takes the Lease only ``lease_duration`` after it last saw the Lease change (client-go's
  ``observedTime``), on its own monotonic clock. With ``renew_deadline < lease_duration`` the old
  holder is gone before a new one starts, whatever the clocks read: only their rates matter.
* Every attempt is bounded by the time left in the term (each request also by the API deadlines,
  kubeapi.Deadlines), so behind a partition a renewal cannot hang past the renew deadline while
  the operator keeps writing.
* A graceful stop releases the Lease (client-go's ``ReleaseOnCancel``), so a standby takes over at
  once rather than at expiry.
* A standby watches the Lease: it tries again the moment the Lease is released, and exactly when
  the holder's term runs out, rather than on a polling period.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timezone

from kubernetes_asyncio.client.exceptions import ApiException

from gpudra_core.kubeapi import (API_ERRORS, Kube, Obj, drop_idle_connections, error_message, is_status,
                                   resource_type, rfc3339)

from . import metrics

LEASE = resource_type("coordination.k8s.io/v1", "Lease")
LEASE_NAME = "gpudra-operator"
LOST_LEASE_EXIT = 3  # the exit status of a holder fenced off (its container restarts as a standby)
log = logging.getLogger("gpudra.operator.election")


@dataclass(frozen=True)
class Timing:
    """client-go's three durations, in seconds. The defaults put a standby in charge within
    ``lease_duration`` of a crash; the holder stops ``lease_duration - renew_deadline`` before that."""

    lease_duration: float = 10.0
    renew_deadline: float = 7.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        # The module's Config refuses these too, later and less clearly (client-go's rules).
        if not self.lease_duration > self.renew_deadline > 1.2 * self.retry_period >= 1.2:
            raise ValueError(f"leader election needs lease duration > renew deadline > 1.2 x retry period, and a "
                             f"retry period of at least 1s; got {self.lease_duration:g}s, "
                             f"{self.renew_deadline:g}s, {self.retry_period:g}s")
        if self.lease_duration != int(self.lease_duration):  # Lease.spec.leaseDurationSeconds is an integer
            raise ValueError(f"the lease duration is whole seconds; got {self.lease_duration:g}s")


@dataclass(frozen=True)
class Observed:
    """What a replica saw of the Lease, as far as the holder's term goes (client-go's
    ``observedRecord``). Any difference from the previous sight (a renewal, a new holder, a
    release, any write) restarts the term on the observer's clock."""

    holder: str | None
    renew_time: str | None
    acquire_time: str | None
    transitions: int | None
    resource_version: str | None
    lease_duration: float | None  # seconds (spec.leaseDurationSeconds)

    @classmethod
    def of(cls, lease: Obj) -> Observed:
        spec = lease.get("spec") or {}
        return cls(spec.get("holderIdentity") or None, spec.get("renewTime"), spec.get("acquireTime"),
                   spec.get("leaseTransitions"), (lease.get("metadata") or {}).get("resourceVersion"),
                   spec.get("leaseDurationSeconds"))


def may_take(observed: Observed, identity: str, unchanged_for: float, lease_duration: float) -> bool:
    """Whether ``identity`` may write the Lease (client-go's rule): it holds it (a renewal), nobody
    does (released), or the Lease has not changed for the holder's lease duration as this replica
    measured it (``unchanged_for``: monotonic seconds since it last saw a change). No time written
    in the Lease is compared with this replica's clock: another node's clock says nothing here."""
    if not observed.holder or observed.holder == identity:
        return True
    return unchanged_for >= (observed.lease_duration or lease_duration)


def lease_spec(current: Obj, identity: str, lease_duration: float, now: datetime) -> Obj:
    """The spec this replica writes: itself as holder, renewed ``now``; acquired ``now`` and one
    more transition unless it held the Lease already."""
    renewal = current.get("holderIdentity") == identity
    stamp = rfc3339(now, microseconds=True)  # renewTime and acquireTime are MicroTimes
    return {**current, "holderIdentity": identity, "leaseDurationSeconds": int(lease_duration),
            "renewTime": stamp, "acquireTime": current.get("acquireTime") if renewal else stamp,
            "leaseTransitions": (current.get("leaseTransitions") or 0) + (0 if renewal or not current else 1)}


def namespace_in_cluster(path: str = "/var/run/secrets/kubernetes.io/serviceaccount/namespace") -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


class Fence:
    """Ends the process once the holder's term may be over (``valid_until`` on the monotonic
    clock). A thread, not a task: a busy event loop must not delay it, and the loop's own
    writes stop with the process."""

    def __init__(self, on_expiry: Callable[[], None] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.valid_until = -math.inf
        self.clock = clock
        self.on_expiry = on_expiry or lost_lease_exit
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="lease-fence", daemon=True)

    def start(self, valid_until: float) -> None:
        self.valid_until = valid_until
        self._thread.start()

    def extend(self, valid_until: float) -> None:
        self.valid_until = max(self.valid_until, valid_until)

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()

    def _watch(self) -> None:
        while not self._stopped.is_set():
            remaining = self.valid_until - self.clock()
            if remaining <= 0:
                self.on_expiry()
                return
            self._stopped.wait(remaining)


def lost_lease_exit() -> None:
    """The fence: no write may follow, so no graceful shutdown either (kopf would finish its
    handlers first)."""
    log.critical("the operator Lease could not be renewed in time; exiting now so that no write "
                 "follows (exit status %d; the container restarts as a standby)", LOST_LEASE_EXIT)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(LOST_LEASE_EXIT)


class LeaseElector:
    """Candidate for the Lease: bounded attempts, a term for the fence, a watch to wake a standby,
    and release."""

    def __init__(self, kube: Kube, namespace: str, identity: str, timing: Timing = Timing(),
                 name: str = LEASE_NAME, clock: Callable[[], float] = time.monotonic) -> None:
        self.kube, self.namespace, self.name, self.identity, self.timing = kube, namespace, name, identity, timing
        self.clock = clock
        self.valid_until = -math.inf  # the end of this replica's term as holder (monotonic)
        self.observed: Observed | None = None  # the Lease as last read or written
        self.observed_at = -math.inf  # when ``observed`` last changed (monotonic)
        self._changed = asyncio.Event()

    @property
    def holder(self) -> str | None:
        """The holder as last seen (None: none, or not read yet)."""
        return self.observed.holder if self.observed else None

    @property
    def leading(self) -> bool:
        return self.clock() < self.valid_until

    async def try_acquire_or_renew(self) -> bool:
        started = self.clock()
        # A holder's attempt is worthless past its term; a standby's is bounded like a renewal.
        budget = self.valid_until - started if self.leading else self.timing.renew_deadline
        try:
            async with asyncio.timeout(max(budget, 0.05)):
                ok = await self._acquire_or_renew()
        except API_ERRORS as error:
            log.debug("Lease %s/%s: attempt failed: %r", self.namespace, self.name, error)
            if isinstance(error, TimeoutError):  # cut by the term, not by a request deadline
                drop_idle_connections(self.kube.api)
            return False
        if ok:
            self.valid_until = started + self.timing.renew_deadline
        return ok

    def _observe(self, lease: Obj) -> None:
        observed = Observed.of(lease)
        if observed != self.observed:
            self.observed, self.observed_at = observed, self.clock()

    async def _acquire_or_renew(self) -> bool:
        """One read and, where :func:`may_take` allows, one write. A conflict (409: another
        candidate wrote first) or a create that lost the race (409) is a failed attempt."""
        lease = await self.kube.get(LEASE, self.name, self.namespace)
        now = datetime.now(timezone.utc)  # only what the Lease shows people; never compared
        try:
            if lease is None:
                created = await self.kube.create({
                    "apiVersion": LEASE.api_version, "kind": LEASE.kind,
                    "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": lease_spec({}, self.identity, self.timing.lease_duration, now)})
                self._observe(created)
                return True
            self._observe(lease)
            assert self.observed is not None
            if not may_take(self.observed, self.identity, self.clock() - self.observed_at,
                            self.timing.lease_duration):
                return False
            written = {**lease, "spec": lease_spec(lease.get("spec") or {}, self.identity,
                                                   self.timing.lease_duration, now)}
            self._observe(await self.kube.request("PUT", LEASE.path(self.namespace, self.name), body=written))
            return True
        except ApiException as error:
            if is_status(error, 409):
                log.debug("Lease %s/%s: another candidate wrote first", self.namespace, self.name)
                return False
            raise

    async def acquire_or_stop(self, stop: asyncio.Event) -> bool:
        """Try until this replica holds the Lease (True) or ``stop`` is set (False). Between
        tries, wait for a change of the Lease (a watch), the end of the holder's term, or the
        retry period, whichever comes first."""
        watching = asyncio.create_task(self._watch_lease(), name="lease watch")
        stopping = asyncio.create_task(stop.wait(), name="stop")
        logged: str | None = None
        try:
            while not stop.is_set():
                self._changed.clear()
                if await self.try_acquire_or_renew():
                    log.info("became the active operator: holding Lease %s/%s as %s", self.namespace,
                             self.name, self.identity)
                    return True
                if self.holder != logged:
                    logged = self.holder
                    log.info("standby: Lease %s/%s is held by %s", self.namespace, self.name, logged)
                changed = asyncio.create_task(self._changed.wait())
                await asyncio.wait({changed, stopping}, timeout=self._until_next_try(),
                                   return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
            return False
        finally:
            for task in (watching, stopping):
                task.cancel()

    def _until_next_try(self) -> float:
        """Seconds to the end of the holder's term as this replica observed it, at most the retry
        period."""
        duration = (self.observed.lease_duration if self.observed else None) or self.timing.lease_duration
        expires = self.observed_at + duration - self.clock()
        return min(max(expires, 0.0), self.timing.retry_period) + 0.01

    async def _watch_lease(self) -> None:
        """Wake the standby on every event of the Lease. A watch starts at most once per retry
        period (monotonic clock): one the server ends at once, with an error or without (a proxy
        that closes it, an API server shutting down), is started again a retry period after the
        last start, not in a tight loop of requests; one that ran its course (the deadlines' watch
        timeout) is followed at once."""
        failing = False
        started = -math.inf
        while True:
            await asyncio.sleep(max(started + self.timing.retry_period - self.clock(), 0.0))
            started = self.clock()
            try:
                async for _ in self.kube.watch(LEASE, self.namespace, field_selector=f"metadata.name={self.name}"):
                    self._changed.set()
                    failing = False
            except asyncio.CancelledError:
                raise
            except Exception as error:  # a broken watch only costs speed: the retry period still applies
                (log.debug if failing else log.warning)("watching Lease %s/%s failed: %s", self.namespace, self.name,
                                                        error_message(error) if isinstance(error, ApiException)
                                                        else repr(error))
                failing = True

    async def keep_renewing(self, fence: Fence) -> None:
        """Renew every retry period while leading and move the fence with each renewal. Another
        holder seen in the Lease (it was taken over) fences at once."""
        while True:
            await asyncio.sleep(self.timing.retry_period)
            if await self.try_acquire_or_renew():
                fence.extend(self.valid_until)
            elif self.holder not in (None, self.identity):
                log.error("Lease %s/%s is now held by %s", self.namespace, self.name, self.holder)
                fence.valid_until = -math.inf
                fence.on_expiry()
                return

    async def release(self) -> bool:
        """Hand the Lease back (holder cleared, a one-second term), so a standby need not wait
        for it to expire. Only once this replica's work has stopped; True when released."""
        try:
            async with asyncio.timeout(self.timing.retry_period):
                lease = await self.kube.get(LEASE, self.name, self.namespace)
                spec = (lease or {}).get("spec") or {}
                if lease is None or spec.get("holderIdentity") != self.identity:
                    return False
                now = rfc3339(datetime.now(timezone.utc), microseconds=True)
                released = {"leaseDurationSeconds": 1, "acquireTime": now, "renewTime": now,
                            **({"leaseTransitions": spec["leaseTransitions"]} if "leaseTransitions" in spec else {})}
                await self.kube.request("PUT", LEASE.path(self.namespace, self.name), body={**lease, "spec": released})
        except API_ERRORS as error:
            log.warning("could not release Lease %s/%s (a standby takes over when it expires): %r",
                        self.namespace, self.name, error)
            return False
        self.valid_until = -math.inf
        log.info("released Lease %s/%s", self.namespace, self.name)
        return True


async def run_elected(elector: LeaseElector, lead: Callable[[], Awaitable[None]], stop: asyncio.Event,
                      fence: Fence | None = None) -> bool:
    """Stand by until this replica holds the Lease, then run ``lead()`` (the operator) under
    the fence while renewing; release the Lease once ``lead()`` has returned. False when
    ``stop`` came first (nothing was led)."""
    metrics.set_leader(elector.name, False)
    if not await elector.acquire_or_stop(stop):
        return False
    fence = fence or Fence()
    fence.start(elector.valid_until)
    metrics.set_leader(elector.name, True)
    renewing = asyncio.create_task(elector.keep_renewing(fence), name="lease renewal")
    try:
        await lead()
    finally:
        renewing.cancel()
        try:
            await renewing
        except asyncio.CancelledError:
            pass
        await elector.release()
        fence.stop()
        metrics.set_leader(elector.name, False)
    return True
