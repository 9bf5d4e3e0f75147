"""One piece of work at a time per GpuDraConfig, within a deadline, and triggers coalesced.

A reconcile, a status refresh and the teardown of a config each read what they then write, so
they must not interleave; a lock held without end would keep the config from ever being
reconciled again. Triggers come in bursts (ten classes applied at once, a rollout's status
events): one waiting behind the running work acts on the newest state anyway, so more are dropped."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class ConfigLocks:
    """A lock per config; work done under it ends after ``held_at_most`` seconds (it is retried
    like a failed request)."""

    def __init__(self, held_at_most: float) -> None:
        self.held_at_most = held_at_most
        self._locks: dict[str, asyncio.Lock] = {}

    def lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    @contextlib.asynccontextmanager
    async def held(self, name: str) -> AsyncIterator[None]:
        """The config's lock, and the deadline of the work done under it (from once it is ours)."""
        async with self.lock(name), asyncio.timeout(self.held_at_most):
            yield


class Coalesced:
    """One kind of work on a config (a reconcile after a child event, a status refresh) run after
    the work running now: a trigger that finds one already waiting is dropped."""

    def __init__(self, locks: ConfigLocks) -> None:
        self.locks = locks
        self._waiting: set[str] = set()

    async def run(self, name: str, work: Callable[[], Awaitable[T]]) -> T | None:
        """``work()``'s answer under the config's lock; None when a run was already waiting."""
        if name in self._waiting:
            return None
        self._waiting.add(name)
        lock = self.locks.lock(name)
        try:
            await lock.acquire()
        finally:  # ours (or waiting cancelled): a trigger arriving from now on queues the next run
            self._waiting.discard(name)
        try:
            async with asyncio.timeout(self.locks.held_at_most):
                return await work()
        finally:
            lock.release()
