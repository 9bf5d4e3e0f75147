"""Which asyncio event loop the node agent runs on.

uvloop (libuv) by default; the standard loop on request (``--event-loop asyncio``, or
``$GPUDRA_EVENT_LOOP=asyncio`` through ``spec.agent.extraEnv``). The agent's hot path, a kubelet gRPC
call that GETs its claims through aiohttp, spends most of its CPU in the event loop and socket I/O,
which uvloop does in C: a shorter pod start for ~1-2 MiB of resident memory per node
(bench/README.md has the measurements). The standard loop stays one flag away, for a platform where
uvloop has no wheel or misbehaves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
LOOPS = ("uvloop", "asyncio")
DEFAULT = "uvloop"


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
