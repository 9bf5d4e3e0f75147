"""Which asyncio event loop the node agent runs on.

The standard loop by default; uvloop (libuv) on request (``--event-loop uvloop``, or
``$GPUDRA_EVENT_LOOP=uvloop`` through ``spec.agent.extraEnv``). The agent's hot path, a kubelet gRPC
call that GETs its claims through aiohttp, runs its I/O through the event loop, which uvloop does in
C; measured side by side, the agent on uvloop prepares no faster (bench/README.md), and it costs
resident memory on every node: hence opt-in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
LOOPS = ("uvloop", "asyncio")
DEFAULT = "asyncio"


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    if name == "asyncio":
        return asyncio.new_event_loop
    raise ValueError(f"unknown event loop {name!r} (one of: {', '.join(LOOPS)})")


def run(main: Coroutine[Any, Any, T], loop: str = DEFAULT) -> T:
    """``asyncio.run(main)`` on the named loop (``asyncio.run`` takes no loop factory before 3.12)."""
    with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
        return runner.run(main)
