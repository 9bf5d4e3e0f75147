"""Group commit: the plugin's state calls, one round at a time, on the event loop.

The event loop hands a call over with :meth:`GroupCommit.submit` and awaits its future. One task
takes every call queued while the last round ran as the next round, runs consecutive calls of one
kind as one batch, and answers each batch's callers as soon as that batch is done: concurrent pod
starts share the commit's fsyncs instead of queueing behind one each.

Under concurrent calls a round may wait a little for more (``gather_delay``, only while
``coming()`` says other calls are about to be submitted, i.e. their claim GETs are in flight):
PostgreSQL's ``commit_delay``/``commit_siblings``. Fewer, larger rounds mean fewer checkpoint
writes and fsyncs per claim when many pods start at once; a lone call never waits.

The handlers are coroutines that do their page-cache work on the loop and await what waits on the
disk or on a peer (fsync, a contended node lock; see :mod:`.state`). They used to run on a state
thread of their own: every system call there was a GIL hand-off with the event loop, and under
16 concurrent callers each one took about 150 µs to get the GIL back (measured on the
development VM, see docs/kubelet-plugin.md)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

# kind -> the coroutine that handles a batch: items and the batch's deadline (the earliest of its
# calls', time.monotonic, or None) in, {claim UID: result} out
Handlers = Mapping[str, Callable[[list[Any], float | None], Awaitable[Mapping[str, Any]]]]
# (kind, items, the caller's future, the key of an item: its claim UID, the caller's deadline)
Call = tuple[str, list[Any], "asyncio.Future[dict[str, Any]]", Callable[[Any], str], float | None]


class GroupCommit:
    def __init__(self, handlers: Handlers, *, coming: Callable[[], int] = lambda: 0,
                 gather_delay: float = 0.0) -> None:
        """``coming``: how many calls are about to be submitted; ``gather_delay``: the longest a
        round waits for them."""
        self.handlers = handlers
        self.coming = coming
        self.gather_delay = gather_delay
        self._calls: asyncio.Queue[Call | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.round_started: float | None = None  # time.monotonic() of the round running now

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._serve(), name="plugin-group-commit")

    async def stop(self) -> None:
        """Finish what is queued, then end; later calls are refused."""
        self._stopping = True
        if self._task is None:
            return
        if not self._task.done():
            self._calls.put_nowait(None)
            await asyncio.shield(self._task)
        elif not self._task.cancelled():
            self._task.exception()  # it ended on its own, logged then: retrieved, not raised again

    async def ended(self) -> None:
        """Wait until the rounds end. After :meth:`stop` that is the normal end; otherwise raise
        what ended them: no later call could be answered, so the agent should stop."""
        if self._task is None:
            raise RuntimeError("the plugin's group commit was never started")
        try:
            await asyncio.shield(self._task)  # raises what the task raised
        except asyncio.CancelledError:
            if not self._task.cancelled():
                raise  # our own waiter was cancelled
            raise RuntimeError("the plugin's group commit was cancelled") from None
        if not self._stopping:
            raise RuntimeError("the plugin's group commit ended")

    def submit(self, kind: str, items: Sequence[Any], key: Callable[[Any], str],
               deadline: float | None = None) -> asyncio.Future[dict[str, Any]]:
        """Queue a call; its future gets the results of its own items. A caller that gives up
        (cancels the future) does not stop the batch its items are part of. ``deadline``
        (time.monotonic): when the caller stops waiting; its batch's handler gets the earliest."""
        if kind not in self.handlers:
            raise ValueError(f"unknown call kind {kind!r}")
        if self._stopping or self._task is None or self._task.done():  # never queue what nobody will read
            raise RuntimeError("the plugin's group commit is not running")
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._calls.put_nowait((kind, list(items), future, key, deadline))
        return future

    async def _serve(self) -> None:
        taken: list[Call | None] = []
        try:
            while True:
                taken = []
                await self._take_round(taken)
                calls = [call for call in taken if call is not None]
                await self._run(calls)
                if len(calls) < len(taken):
                    return
        except BaseException as error:  # cancelled (the agent going down) or worse: answer, then go
            log.critical("the plugin's group commit stopped: %r", error)
            self._stopping = True
            left = [call for call in taken if call is not None]
            while not self._calls.empty():
                call = self._calls.get_nowait()
                if call is not None:
                    left.append(call)
            _settle(left, RuntimeError(f"group commit stopped: {error!r}"))
            raise

    async def _take_round(self, round_: list[Call | None]) -> None:
        """Into ``round_`` (so that what was taken is known if the wait is cancelled): the next
        call, everything that queued up behind it while the last round ran, and what arrives
        within ``gather_delay`` while more calls are coming."""
        round_.append(await self._calls.get())
        deadline: float | None = None
        loop = asyncio.get_running_loop()
        while True:
            while not self._calls.empty():
                round_.append(self._calls.get_nowait())
            if round_[-1] is None or self.gather_delay <= 0 or self.coming() <= 0:
                return
            deadline = deadline or loop.time() + self.gather_delay
            if loop.time() >= deadline:
                return
            try:
                async with asyncio.timeout_at(deadline):
                    round_.append(await self._calls.get())
            except TimeoutError:
                return

    async def _run(self, calls: list[Call]) -> None:
        self.round_started = time.monotonic()
        try:
            await self._run_batches(calls)
        finally:
            self.round_started = None

    def round_running_for(self) -> float:
        """Seconds the round running now has taken so far; 0 when none runs (the liveness check:
        a round stuck on a hung disk or a lock that never comes answers no call again)."""
        started = self.round_started
        return 0.0 if started is None else time.monotonic() - started

    async def _run_batches(self, calls: list[Call]) -> None:
        for kind, group in itertools.groupby(calls, key=lambda call: call[0]):
            batch = list(group)
            try:
                deadline = min((d for *_, d in batch if d is not None), default=None)
                outcome: Mapping[str, Any] | Exception = await self.handlers[kind](
                    [item for _, items, _, _, _ in batch for item in items], deadline)
            except Exception as error:  # a bug or an unusable plugin dir: fail these calls loudly
                log.exception("%s failed", kind)
                outcome = error
            try:
                _settle(batch, outcome)
            except Exception as error:  # results the callers cannot be given (a bug): the error instead
                log.exception("answering %s failed", kind)
                _settle(batch, error)


def _settle(batch: list[Call], outcome: Mapping[str, Any] | Exception) -> None:
    """Give each call of a batch its own items' results (or the batch's error)."""
    for _, items, future, key, _ in batch:
        if future.done():  # its caller gave up
            continue
        if isinstance(outcome, Exception):
            future.set_exception(outcome)
        else:
            future.set_result({uid: outcome[uid] for uid in map(key, items) if uid in outcome})
