"""Whose turn it is to change the node's state: one call at a time in this agent instance (an
asyncio lock, first come first served), then one instance at a time on the node (the flock of
:mod:`.locking`: during a rolling update two instances serve side by side). Always taken in that
order, so two calls of one instance never contend for the flock, and both waits fit the kubelet's
budget for the call. Also what the liveness check asks: how long the call holding the node has
taken so far; and how a step under both locks runs on a thread (:func:`on_thread`)."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, TypeVar

from gpudra_driver.plugin.locking import LOCK_TIMEOUT, LockTimeout, node_lock, node_lock_async

log = logging.getLogger(__name__)
T = TypeVar("T")


class CallLocks:
    def __init__(self, path: Path, node: str, timeout: float = LOCK_TIMEOUT) -> None:
        """``path``: the node lock's file; ``timeout``: the longest a call waits for its turn and
        then for the node lock (a caller's deadline may shorten it)."""
        self.path = path
        self.node = node
        self.timeout = timeout
        self.busy_since: float | None = None  # time.monotonic() since the call holding the node lock began
        self._one_call = asyncio.Lock()

    @property
    def in_turn(self) -> bool:
        """Whether a call of this instance has its turn now (it may still wait for the node lock)."""
        return self._one_call.locked()

    def busy_for(self) -> float:
        """Seconds the call holding the node lock has taken so far; 0 when none does (the liveness
        check: a call stuck on a hung disk answers no call again)."""
        started = self.busy_since
        return 0.0 if started is None else time.monotonic() - started

    @asynccontextmanager
    async def one_at_a_time(self, deadline: float | None) -> AsyncIterator[float | None]:
        """This instance's calls one at a time (FIFO), waited for until ``deadline``
        (time.monotonic) at the latest: the kubelet's call budget. Yields the node lock's timeout:
        what is left of the budget, at most :attr:`timeout`."""
        timeout = self.timeout
        if deadline is not None:
            timeout = max(0.0, min(timeout, deadline - time.monotonic()))
        waited_until = time.monotonic() + timeout
        try:
            async with asyncio.timeout(timeout):
                await self._one_call.acquire()
        except TimeoutError:
            raise LockTimeout(f"the calls before this one on node {self.node} took over {timeout:.1f}s") from None
        try:
            yield max(0.0, waited_until - time.monotonic())
        finally:
            self._one_call.release()

    @asynccontextmanager
    async def node_locked(self, timeout: float | None) -> AsyncIterator[None]:
        """The node lock, for a call that has its turn (:meth:`one_at_a_time`), waited for at most
        ``timeout`` seconds (None: :attr:`timeout`)."""
        async with node_lock_async(self.path, self.timeout if timeout is None else timeout):
            self.busy_since = time.monotonic()
            try:
                yield
            finally:
                self.busy_since = None

    @contextmanager
    def node_locked_blocking(self) -> Iterator[None]:
        """The node lock for start-up, before any call can come (blocking: off the event loop)."""
        with node_lock(self.path, self.timeout):
            yield


async def on_thread(function: Callable[..., T], *args: Any) -> T:
    """``function(*args)`` on a thread, for a step under the locks. A thread cannot be stopped: when
    the call is cancelled (the kubelet gave up on it), however often, the locks stay held until the
    thread is done, then the cancellation goes on (``asyncio.to_thread`` would give them up at once,
    to a peer instance too, while the thread still writes). An executor future, not a task: nothing
    that cancels every task (a loop shutting down) cancels it."""
    work = asyncio.get_running_loop().run_in_executor(
        None, functools.partial(contextvars.copy_context().run, function, *args))
    cancelled: asyncio.CancelledError | None = None
    while not work.done():
        try:
            await asyncio.wait([work])
        except asyncio.CancelledError as error:
            cancelled = cancelled or error
    if cancelled is not None:
        if not work.cancelled() and (failure := work.exception()) is not None:  # nobody else will see it
            log.error("the locked step of a cancelled call failed: %r", failure)
        raise cancelled
    return work.result()
