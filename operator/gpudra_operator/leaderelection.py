"""One active operator among its replicas: a coordination.k8s.io Lease (docs/ha.md).

The Lease protocol (read the Lease, create it, or replace it under its resourceVersion once the
holder's term has run out) is kubernetes-asyncio's ``leaderelection`` module. What it lacks for
fencing is added here:

* The holder acts only until ``renew_deadline`` after the start of its last successful renewal,
  measured on its own monotonic clock; a watchdog thread (:class:`Fence`) ends the process there.
  A standby takes the Lease only ``lease_duration`` after it last saw the Lease change, on its own
  clock. With ``renew_deadline < lease_duration`` the old holder is gone before a new one starts,
  whatever the clocks read: client-go's scheme (k8s.io/client-go tools/leaderelection).
* Every attempt is bounded by a timeout: the module's requests have none, so behind a partition a
  renewal would hang past the deadline while the operator kept writing.
* A graceful stop releases the Lease (client-go's ``ReleaseOnCancel``; the module has none,
  tomplus/kubernetes_asyncio#411), so a standby takes over at once rather than at expiry.
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

import aiohttp
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.leaderelection.electionconfig import Config
from kubernetes_asyncio.leaderelection.leaderelection import LeaderElection
from kubernetes_asyncio.leaderelection.resourcelock.leaselock import LeaseLock

from gpudra_driver.kubeapi import Kube, ResourceType, error_message

from . import metrics

LEASE = ResourceType("coordination.k8s.io/v1", "Lease", "leases", True)
LEASE_NAME = "gpudra-operator"
LOST_LEASE_EXIT = 3  # the exit status of a holder fenced off (its container restarts as a standby)
NETWORK_ERRORS = (ApiException, OSError, asyncio.TimeoutError, aiohttp.ClientError)
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


async def _never() -> None:  # the module's Config wants callbacks; run_elected calls the work itself
    raise AssertionError("unused")


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


class LeaseElector(LeaderElection):
    """kubernetes-asyncio's elector on a Lease, with bounded attempts, a term for the fence, a
    watch to wake a standby, and release."""

    def __init__(self, kube: Kube, namespace: str, identity: str, timing: Timing = Timing(),
                 name: str = LEASE_NAME, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(Config(LeaseLock(name, namespace, identity, kube.api), int(timing.lease_duration),
                                timing.renew_deadline, timing.retry_period, _never, _never))
        self.kube, self.namespace, self.name, self.identity, self.timing = kube, namespace, name, identity, timing
        self.clock = clock
        self.valid_until = -math.inf  # the end of this replica's term as holder (monotonic)
        self._changed = asyncio.Event()

    @property
    def lock(self) -> LeaseLock:
        lock = self.election_config.lock
        assert isinstance(lock, LeaseLock)
        return lock

    @property
    def holder(self) -> str | None:
        """The holder as last seen (None: none, or not read yet)."""
        return self.observed_record.holder_identity if self.observed_record else None

    @property
    def leading(self) -> bool:
        return self.clock() < self.valid_until

    async def try_acquire_or_renew(self) -> bool:
        started = self.clock()
        # A holder's attempt is worthless past its term; a standby's is bounded like a renewal.
        budget = self.valid_until - started if self.leading else self.timing.renew_deadline
        try:
            async with asyncio.timeout(max(budget, 0.05)):
                ok = await super().try_acquire_or_renew()
        except NETWORK_ERRORS as error:
            log.debug("Lease %s/%s: attempt failed: %r", self.namespace, self.name, error)
            return False
        if ok:
            self.valid_until = started + self.timing.renew_deadline
        return ok

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
        """Seconds to the end of the holder's term as this replica observed it (the module keeps
        that moment in wall-clock milliseconds), at most the retry period."""
        expires = self.observed_time_milliseconds / 1000 + self.timing.lease_duration - time.time()
        return min(max(expires, 0.0), self.timing.retry_period) + 0.01

    async def _watch_lease(self) -> None:
        failing = False
        while True:
            try:
                async for _ in self.kube.watch(LEASE, self.namespace, field_selector=f"metadata.name={self.name}",
                                               timeout_seconds=300):
                    self._changed.set()
                    failing = False
            except asyncio.CancelledError:
                raise
            except Exception as error:  # a broken watch only costs speed: the retry period still applies
                (log.debug if failing else log.warning)("watching Lease %s/%s failed: %s", self.namespace, self.name,
                                                        error_message(error) if isinstance(error, ApiException)
                                                        else repr(error))
                failing = True
                await asyncio.sleep(self.timing.retry_period)

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
                api = client.CoordinationV1Api(self.kube.api)
                lease = await api.read_namespaced_lease(self.name, self.namespace)
                if lease.spec is None or lease.spec.holder_identity != self.identity:
                    return False
                now = datetime.now(timezone.utc)
                lease.spec = client.V1LeaseSpec(lease_duration_seconds=1, acquire_time=now, renew_time=now,
                                                lease_transitions=lease.spec.lease_transitions)
                await api.replace_namespaced_lease(self.name, self.namespace, lease)
        except NETWORK_ERRORS as error:
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
