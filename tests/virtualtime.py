"""An asyncio event loop on a virtual clock, for tests of rate limits and backoff: when every task
waits on a timer, the clock jumps to the next one, so waiting seconds takes microseconds and the
seconds a test measures with ``loop.time()`` are exact to a few nanoseconds."""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
# What each pass of the loop costs on the virtual clock. Not zero: code that schedules a wake-up
# for a float-rounding moment later (a leaky bucket's next drop) must see time move, as it would.
TICK = 1e-9


class _JumpingSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:  # no timer at all: only real I/O (or another thread) can wake the loop
            events = super().select(None)
        else:
            events = super().select(0)
            if not events:
                self.now += timeout  # nothing ready: the loop would sleep until its next timer
        self.now += TICK
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._jumping = _JumpingSelector()
        super().__init__(self._jumping)

    def time(self) -> float:
        return self._jumping.now


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on a :class:`VirtualTimeLoop`."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coroutine)
    finally:
        loop.close()
