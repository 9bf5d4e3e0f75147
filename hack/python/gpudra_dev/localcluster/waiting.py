"""Wait on a condition with a deadline: the only way tests and the demo synchronise."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class ConditionTimeout(AssertionError):
    """The condition did not hold before the deadline; carries the last value seen."""


async def wait_for(probe: Callable[[], Awaitable[T | None]], *, timeout: float, what: str,
                   interval: float = 0.05) -> T:
    """Call ``probe`` until it returns a truthy value, and return that value.

    ``interval`` is a polling period, not a delay that the result depends on: the deadline is
    what bounds the wait, and the message names what never happened."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = await probe()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise ConditionTimeout(f"timed out after {timeout:.1f}s waiting for {what}; last seen: {last!r}")
        await asyncio.sleep(interval)
