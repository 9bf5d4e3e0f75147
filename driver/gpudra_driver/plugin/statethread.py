"""The one thread that runs :class:`~gpudra_driver.plugin.state.DeviceState`'s blocking calls.

The event loop hands a call over with :meth:`StateThread.submit` and awaits its future; the
thread takes every call queued while it was busy as one round (group commit: concurrent pod
starts share the commit's fsync), runs consecutive calls of one kind as one batch, and answers
each batch's callers as soon as that batch is done.

Under concurrent calls a round may wait a little for more (``gather_delay``, only while
``coming()`` says other calls are about to be submitted, i.e. their claim GETs are in flight):
PostgreSQL's ``commit_delay``/``commit_siblings``. Fewer, larger rounds mean fewer checkpoint
writes and fsyncs per claim when many pods start at once; a lone call never waits.

A plain thread with a queue, not ``run_in_executor``: a prepare crosses threads twice (hand-over,
answer), and the executor's future chaining costs twice the CPU of a queue put plus
``call_soon_threadsafe`` (~160 µs against ~70 µs per round trip here), on the kubelet's critical
path."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

# kind -> the blocking call that handles a batch: items in, {claim UID: result} out
Handlers = Mapping[str, Callable[[list[Any]], Mapping[str, Any]]]
# (kind, items, the caller's future, the key of an item: its claim UID)
Call = tuple[str, list[Any], "asyncio.Future[dict[str, Any]]", Callable[[Any], str]]


class StateThread:
    def __init__(self, handlers: Handlers, name: str = "gpudra-plugin-state", *,
                 coming: Callable[[], int] = lambda: 0, gather_delay: float = 0.0) -> None:
        """``coming``: how many calls are about to be submitted (read from this thread, so a plain
        counter the event loop keeps); ``gather_delay``: the longest a round waits for them."""
        self.handlers = handlers
        self.coming = coming
        self.gather_delay = gather_delay
        self._calls: queue.SimpleQueue[Call | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    async def stop(self) -> None:
        """Finish what is queued, then end the thread; later calls are refused."""
        self._stopping = True
        if self._thread.is_alive():
            self._calls.put(None)
            await asyncio.to_thread(self._thread.join)

    def submit(self, kind: str, items: Sequence[Any], key: Callable[[Any], str]) -> asyncio.Future[dict[str, Any]]:
        """Queue a call; its future gets the results of its own items. A caller that gives up
        (cancels the future) does not stop the batch its items are part of."""
        if kind not in self.handlers:
            raise ValueError(f"unknown call kind {kind!r}")
        if self._stopping or not self._thread.is_alive():  # never queue what nobody will read
            raise RuntimeError("the plugin's state thread is not running")
        assert self._loop is not None
        future: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        self._calls.put((kind, list(items), future, key))
        return future

    def _serve(self) -> None:
        while True:
            round_ = self._take_round()
            calls = [call for call in round_ if call is not None]
            self._run(calls)
            if len(calls) < len(round_):
                return

    def _take_round(self) -> list[Call | None]:
        """The next call, everything that queued up behind it while the last round was on disk,
        and what arrives within ``gather_delay`` while more calls are coming."""
        round_ = [self._calls.get()]
        deadline: float | None = None
        while True:
            try:
                round_.append(self._calls.get_nowait())
                continue
            except queue.Empty:
                pass
            if round_[-1] is None or self.gather_delay <= 0 or self.coming() <= 0:
                return round_
            now = time.monotonic()
            deadline = deadline or now + self.gather_delay
            if now >= deadline:
                return round_
            try:
                round_.append(self._calls.get(timeout=deadline - now))
            except queue.Empty:
                return round_

    def _run(self, calls: list[Call]) -> None:
        assert self._loop is not None
        for kind, group in itertools.groupby(calls, key=lambda call: call[0]):
            batch = list(group)
            try:
                outcome: Mapping[str, Any] | Exception = self.handlers[kind](
                    [item for _, items, _, _ in batch for item in items])
            except Exception as error:  # a bug or an unusable plugin dir: fail these calls loudly
                log.exception("%s failed", kind)
                outcome = error
            except BaseException as error:  # the thread ends: answer every call it took, then go
                log.critical("the plugin's state thread stopped: %r", error)
                self._stopping = True
                self._loop.call_soon_threadsafe(_settle, calls, RuntimeError(f"state thread stopped: {error!r}"))
                raise
            self._loop.call_soon_threadsafe(_settle, batch, outcome)


def _settle(batch: list[Call], outcome: Mapping[str, Any] | Exception) -> None:
    """On the event loop: give each call of a batch its own items' results (or the batch's error)."""
    for _, items, future, key in batch:
        if future.done():  # its caller gave up
            continue
        if isinstance(outcome, Exception):
            future.set_exception(outcome)
        else:
            future.set_result({uid: outcome[uid] for uid in map(key, items) if uid in outcome})
