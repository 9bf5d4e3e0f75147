"""The operator's per-config locks and trigger coalescing (gpudra_operator.configlocks), and which
nodes' agents report NVIDIA's device plugin or MIG problems (gpudra_operator.agentreports)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gpudra_core.agentcontract import DEVICE_PLUGIN_CONFLICT, DEVICE_PLUGIN_RESOLVED
from gpudra_operator.configlocks import Coalesced, ConfigLocks
from gpudra_operator.agentreports import AgentReports, nodes_with


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
    assert list(nodes_with(events, DEVICE_PLUGIN_CONFLICT, DEVICE_PLUGIN_RESOLVED)) == ["b", "c"]
    # the order of the list does not matter
    assert list(nodes_with(reversed(events), DEVICE_PLUGIN_CONFLICT, DEVICE_PLUGIN_RESOLVED)) == ["b", "c"]


def test_mig_reports_become_degraded_problems_naming_the_nodes_and_what_to_do() -> None:
    from gpudra_core.agentcontract import DYNAMIC_MIG_UNSUPPORTED, MIG_NOT_READY, MIG_READY
    from gpudra_operator.conditions import summarize

    def said(node: str, reason: str, when: str, message: str) -> dict[str, Any]:
        return {**event(node, reason, when), "message": message}

    events = [said("a", MIG_NOT_READY, "2026-01-01T00:00:00Z", "1 GPU(s) do not match: GPU 0 MIG mode disabled"),
              said("a", MIG_READY, "2026-01-01T00:05:00Z", "every GPU matches"),
              said("b", MIG_NOT_READY, "2026-01-01T00:06:00Z", "1 GPU(s) do not match: GPU 1 " + "x" * 2000),
              said("c", DYNAMIC_MIG_UNSUPPORTED, "2026-01-01T00:01:00Z", "dynamic MIG is not used: dropped")]
    reports = AgentReports.of(events)
    assert list(reports.mig_not_ready) == ["b"] and list(reports.dynamic_mig_unsupported) == ["c"]
    unsupported, not_ready = reports.mig_problems()
    assert unsupported.reason == "DynamicMigUnsupported"
    assert unsupported.message.startswith("1 node(s) (c) publish static MIG instead of dynamic")
    assert unsupported.message.endswith("c: dynamic MIG is not used: dropped")
    assert not_ready.reason == "MigNotReady" and "b: 1 GPU(s) do not match: GPU 1 x" in not_ready.message
    assert len(not_ready.message) < 800  # one node's words are quoted, bounded
    ready, _, _, degraded = summarize(daemonset=None, node_problems=reports.mig_problems())
    assert (degraded.status, degraded.reason) == ("True", "DynamicMigUnsupported")
    assert (ready.status, ready.reason) == ("False", "DynamicMigUnsupported")
    assert not_ready.message in degraded.message
    assert AgentReports.of(events[:2]).mig_problems() == []  # a's latest is the all-clear


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
