"""The queue of prepare calls: those that arrive while another call holds the node are done as one
batch by the first of them to get its turn, so a burst of pods costs one checkpoint write per phase
rather than one per call. Each caller still gets only its own claims' answers, and a failure of the
node (not of a claim) is the error of each of its claims not answered yet.

A batch about to start also takes the calls that have arrived but are still reading their claims
(their GETs in flight), waiting for them at most :data:`GATHER_LIMIT`: PostgreSQL's group commit
with ``commit_siblings``, where a commit waits only when other transactions are open. Nothing waits
for calls that have not arrived, so a lone call (and one call's many claims) never waits; under a
burst each batch writes the checkpoint once for more claims (bench/README.md)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from gpudra_driver.plugin.allocation import ReadClaim
from gpudra_driver.plugin.calllocks import CallLocks
from gpudra_driver.plugin.checkpoint import CheckpointError
from gpudra_driver.plugin.locking import LockTimeout
from gpudra_driver.plugin.model import ClaimRef, PrepareResult

log = logging.getLogger(__name__)
# The longest a batch waits for calls that are reading their claims: about one claim GET on a
# loaded node, a fraction of a pod start, and far below the kubelet's budget for the call.
GATHER_LIMIT = 0.005

# Prepare a batch's claims (the node lock still to take, within the timeout given), each answer
# into the dict given. Raises what fails the node rather than a claim: OSError, CheckpointError.
PrepareBatch = Callable[[Sequence[tuple[ClaimRef, ReadClaim]], float | None, dict[str, PrepareResult]],
                        Awaitable[None]]


class PrepareQueue:
    def __init__(self, locks: CallLocks, prepare_batch: PrepareBatch, gather_limit: float = GATHER_LIMIT) -> None:
        self.locks = locks
        self.prepare_batch = prepare_batch
        self.gather_limit = gather_limit
        self.reading = 0  # prepare calls reading their claims now: they queue up next
        self._queued: list[_QueuedPrepare] = []  # prepare calls waiting for their turn
        self._arrivals = asyncio.Event()  # set when a call stops reading its claims

    @property
    def waiting(self) -> int:
        """How many prepare calls wait for their turn, not taken into a batch yet."""
        return len(self._queued)

    @contextmanager
    def reading_claims(self) -> Iterator[None]:
        """Around a prepare call's claim GETs, before it queues up (:meth:`prepare`)."""
        self.reading += 1
        try:
            yield
        finally:
            self.reading -= 1
            self._arrivals.set()

    async def prepare(self, claims: list[tuple[ClaimRef, ReadClaim]],
                      deadline: float | None) -> dict[str, PrepareResult]:
        """Each of ``claims``' answers, done in this call's batch or an earlier caller's."""
        call = _QueuedPrepare(claims, deadline)
        self._queued.append(call)
        try:
            async with self.locks.one_at_a_time(deadline) as lock_timeout:
                if call.results is None:  # not done in an earlier call's batch (nor in one cancelled)
                    await self._gather(deadline)
                    batch = [call, *(queued for queued in self._queued if queued is not call)]
                    self._queued = []
                    await self._prepare(batch, lock_timeout)
        except LockTimeout as error:
            call.fail(error, self.locks.node)
        finally:
            if call in self._queued:
                self._queued.remove(call)
        return call.results or {}

    async def _gather(self, deadline: float | None) -> None:
        """While calls are reading their claims, wait for them to queue up (a call that stops
        reading queues up before this one runs again), for at most :attr:`gather_limit`."""
        until = time.monotonic() + self.gather_limit
        if deadline is not None:
            until = min(until, deadline)
        while self.reading > 0 and (left := until - time.monotonic()) > 0:
            self._arrivals.clear()
            try:
                async with asyncio.timeout(left):
                    await self._arrivals.wait()
            except TimeoutError:
                return

    async def _prepare(self, batch: list[_QueuedPrepare], lock_timeout: float | None) -> None:
        deadlines = [call.deadline for call in batch if call.deadline is not None]
        if deadlines:  # the earliest caller's budget
            lock_timeout = max(0.0, min(lock_timeout or self.locks.timeout, min(deadlines) - time.monotonic()))
        results: dict[str, PrepareResult] = {}
        claims = [item for call in batch for item in call.claims]
        try:
            await self.prepare_batch(claims, lock_timeout, results)
        except asyncio.CancelledError:  # the leader's caller gave up: the others, not answered, queue again
            self._queued[:0] = [call for call in batch[1:] if call.results is None]
            raise
        except (OSError, CheckpointError) as error:  # LockTimeout is an OSError too
            log.error("prepare on node %s failed: %s", self.locks.node, error)
            for call in batch:
                call.fail(error, self.locks.node, results)
            return
        for call in batch:
            call.results = {ref.uid: results[ref.uid] for ref, _ in call.claims}


@dataclass(eq=False)  # identity: two calls with the same claims are still two callers
class _QueuedPrepare:
    claims: list[tuple[ClaimRef, ReadClaim]]
    deadline: float | None
    results: dict[str, PrepareResult] | None = None  # set once done, by whichever call ran its batch

    def fail(self, error: Exception, node: str, answered: Mapping[str, PrepareResult] | None = None) -> None:
        """Each claim not answered yet gets the node's ``error``."""
        results = dict(self.results or {})
        for ref, _ in self.claims:
            results.setdefault(ref.uid, (answered or {}).get(ref.uid) or PrepareResult(
                error=f"{ref}: preparing on node {node} failed: {error}"))
        self.results = results
