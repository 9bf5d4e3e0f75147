"""The operator's per-config locks and trigger coalescing (gpudra_operator.configlocks), and which
nodes' agents report NVIDIA's device plugin (gpudra_operator.pluginconflicts.conflicting_nodes)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gpudra_core.agentcontract import DEVICE_PLUGIN_CONFLICT, DEVICE_PLUGIN_RESOLVED
from gpudra_operator.configlocks import Coalesced, ConfigLocks
from gpudra_operator.pluginconflicts import conflicting_nodes


def event(node: str, reason: str, when: str) -> dict[str, Any]:
    return {"reason": reason, "involvedObject": {"kind": "Node", "name": node}, "lastTimestamp": when,
            "metadata": {"creationTimestamp": when}}


def test_a_node_conflicts_while_its_latest_event_says_so() -> None:
    events = [event("a", DEVICE_PLUGIN_CONFLICT, "2026-01-01T00:00:00Z"),
              event("a", DEVICE_PLUGIN_RESOLVED, "2026-01-01T00:05:00Z"),
              event("b", DEVICE_PLUGIN_RESOLVED, "2026-01-01T00:00:00Z"),
              event("b", DEVICE_PLUGIN_CONFLICT, "2026-01-01T00:05:00Z"),
              event("c", DEVICE_PLUGIN_CONFLICT, "2026-01-01T00:01:00Z"),
              event("d", "GpuDiscoveryFailed", "2026-01-01T00:09:00Z")]
    assert conflicting_nodes(events) == ["b", "c"]
    assert conflicting_nodes(reversed(events)) == ["b", "c"]  # order of the list does not matter


async def test_triggers_that_find_one_waiting_are_dropped_and_the_next_one_runs() -> None:
    locks = ConfigLocks(held_at_most=5)
    coalesced = Coalesced(locks)
    ran: list[str] = []
    release = asyncio.Event()

    async def work(tag: str) -> str:
        ran.append(tag)
        await release.wait()
        return tag

    async with locks.held("gpu"):  # a reconcile running now
        first = asyncio.create_task(coalesced.run("gpu", lambda: work("first")))
        await asyncio.sleep(0)
        assert await coalesced.run("gpu", lambda: work("dropped")) is None  # one is waiting already
        other = asyncio.create_task(coalesced.run("other", lambda: work("other")))  # another config: its own lock
        await asyncio.sleep(0)
        assert ran == ["other"]
    await asyncio.sleep(0)
    release.set()
    assert await first == "first" and await other == "other"
    assert ran == ["other", "first"]
    # Once it runs, a new trigger waits for it instead of being dropped.
    assert await coalesced.run("gpu", lambda: work("next")) == "next"


async def test_work_under_the_lock_ends_at_its_deadline() -> None:
    locks = ConfigLocks(held_at_most=0.05)
    with pytest.raises(TimeoutError):
        await Coalesced(locks).run("gpu", lambda: asyncio.Event().wait())
    assert not locks.lock("gpu").locked()
