"""stale_slices(): every GC rule and never-rule of docs/gc.md, the grace-period memory, node
selection, and the delete rate limiter."""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest
import virtualtime

from gpudra_operator.slicegc.apply import GcResult, delete_limiter, gc_ready
from gpudra_operator.slicegc.plan import (NODE_GONE, NODE_UNSELECTED, OWNER_UID_MISMATCH, SUPERSEDED_GENERATION,
                                         AgentPlacement, NodeInfo, SliceInfo, stale_slices)

DRIVER = "gpu.gpudra.io"
GRACE = 300.0


def slice_(name: str, node: str | None, *, generation: int = 1, owner: str | None = "uid-n1",
           driver: str = DRIVER, pool: str | None = None) -> SliceInfo:
    return SliceInfo(name=name, uid=f"uid-{name}", resource_version="7", driver=driver, pool=pool or node or "p",
                     generation=generation, node_name=node, node_owner_uid=owner)


N1 = NodeInfo("n1", "uid-n1", {"gpu": "true"})
NODES = {"n1": N1}
SELECT_GPU = AgentPlacement({"gpu": "true"})


def decide(slices, nodes=NODES, agents=frozenset(), placement=SELECT_GPU, now=0.0, memory=None):
    return stale_slices(DRIVER, slices, nodes, agents, placement, now=now, grace_period=GRACE, first_seen=memory)


def rules(verdicts) -> dict[str, str]:
    return {v.slice.name: v.rule for v in verdicts}


def test_from_object_reads_the_wire_shape() -> None:
    obj = {"metadata": {"name": "s", "uid": "u", "resourceVersion": "9",
                        "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "uid-n1"}]},
           "spec": {"driver": DRIVER, "nodeName": "n1", "pool": {"name": "n1", "generation": 3}}}
    assert SliceInfo.from_object(obj) == SliceInfo("s", "u", "9", DRIVER, "n1", 3, "n1", "uid-n1")
    del obj["metadata"]["ownerReferences"]
    assert SliceInfo.from_object(obj).node_owner_uid is None
    node = NodeInfo.from_object({"metadata": {"name": "n1", "uid": "uid-n1", "labels": {"a": "b"}}})
    assert (node.name, node.uid, dict(node.labels)) == ("n1", "uid-n1", {"a": "b"})


def test_a_healthy_node_keeps_its_slices() -> None:
    decision = decide([slice_("a", "n1")], agents={"n1"})
    assert decision.condemned == [] and decision.pending == [] and decision.first_seen == {}
    # Selected by the agent but no agent pod yet (starting, or crash-looping): not a GC rule.
    assert decide([slice_("a", "n1")]).condemned == []


def test_node_gone_is_condemned_at_once_with_or_without_owner() -> None:
    decision = decide([slice_("a", "gone", owner=None), slice_("b", "gone2", owner="uid-old")])
    assert rules(decision.condemned) == {"a": NODE_GONE, "b": NODE_GONE}
    assert "Node gone does not exist" in decision.condemned[0].reason


def test_owner_uid_of_an_older_node_is_condemned_at_once() -> None:
    decision = decide([slice_("a", "n1", owner="uid-previous-n1")])
    assert rules(decision.condemned) == {"a": OWNER_UID_MISMATCH}
    assert "uid-previous-n1" in decision.condemned[0].reason
    # No owner at all on a present node is not a mismatch.
    assert decide([slice_("a", "n1", owner=None)]).condemned == []


def test_superseded_generation_waits_for_the_grace_period() -> None:
    slices = [slice_("old", "n1", generation=1), slice_("new", "n1", generation=2)]
    first = decide(slices, agents={"n1"}, now=100.0)
    assert first.condemned == [] and rules(first.pending) == {"old": SUPERSEDED_GENERATION}
    assert first.first_seen == {"uid-old": (SUPERSEDED_GENERATION, 100.0)}
    almost = decide(slices, agents={"n1"}, now=100.0 + GRACE - 1, memory=first.first_seen)
    assert almost.condemned == [] and almost.first_seen == first.first_seen
    due = decide(slices, agents={"n1"}, now=100.0 + GRACE, memory=almost.first_seen)
    assert rules(due.condemned) == {"old": SUPERSEDED_GENERATION} and due.condemned[0].since == 100.0


def test_generations_compare_within_a_pool_only() -> None:
    slices = [slice_("a", "n1", generation=1, pool="n1"), slice_("b", "n1", generation=5, pool="other")]
    assert decide(slices, agents={"n1"}, now=GRACE * 10, memory={}).pending == []


def test_unselected_node_without_agent_waits_for_the_grace_period() -> None:
    node = NodeInfo("n1", "uid-n1", {"gpu": "false"})
    first = decide([slice_("a", "n1")], nodes={"n1": node}, now=0.0)
    assert rules(first.pending) == {"a": NODE_UNSELECTED} and first.condemned == []
    due = decide([slice_("a", "n1")], nodes={"n1": node}, now=GRACE, memory=first.first_seen)
    assert rules(due.condemned) == {"a": NODE_UNSELECTED}


def test_grace_clock_restarts_when_a_slice_stops_being_stale_or_changes_rule() -> None:
    unselected = {"n1": NodeInfo("n1", "uid-n1", {})}
    first = decide([slice_("a", "n1")], nodes=unselected, now=0.0)
    healthy = decide([slice_("a", "n1")], now=10.0, memory=first.first_seen)  # selected again
    assert healthy.first_seen == {}
    again = decide([slice_("a", "n1")], nodes=unselected, now=GRACE + 20, memory=healthy.first_seen)
    assert again.condemned == [] and again.first_seen == {"uid-a": (NODE_UNSELECTED, GRACE + 20)}
    # The same slice under a different grace rule starts a new clock.
    other_rule = {"uid-a": (SUPERSEDED_GENERATION, 0.0)}
    assert decide([slice_("a", "n1")], nodes=unselected, now=GRACE * 2, memory=other_rule).condemned == []


def test_never_the_current_generation_on_a_node_with_an_agent_pod() -> None:
    unselected = {"n1": NodeInfo("n1", "uid-n1", {})}
    memory = {"uid-a": (NODE_UNSELECTED, 0.0)}
    # Not selected, owner UID stale, grace long over: an agent pod still runs there, so it stays.
    for s in (slice_("a", "n1"), slice_("a", "n1", owner="uid-old")):
        decision = decide([s], nodes=unselected, agents={"n1"}, now=GRACE * 10, memory=memory)
        assert decision.condemned == [] and decision.pending == []
    # An older generation on that node is still superseded.
    old = decide([slice_("old", "n1", generation=1), slice_("a", "n1", generation=2)], nodes=unselected,
                 agents={"n1"}, now=0.0)
    assert rules(old.pending) == {"old": SUPERSEDED_GENERATION}


def test_never_another_drivers_slices_nor_slices_without_a_node_name() -> None:
    foreign = slice_("x", "gone", driver="other.example.com", owner=None)
    unbound = slice_("y", None, owner=None)
    decision = decide([foreign, unbound], now=GRACE * 10)
    assert decision.condemned == [] and decision.pending == []
    # A foreign slice with a higher generation in a same-named pool does not supersede ours.
    ours = slice_("a", "n1", generation=1)
    assert decide([ours, slice_("z", "n1", generation=9, driver="other.example.com")], agents={"n1"}).pending == []


@pytest.mark.parametrize("affinity,labels,name,selected", [
    ({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "b"]}]}]}}}, {"zone": "a"}, "n", True),
    ({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}}, {"zone": "c"}, "n", False),
    ({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
        {"matchExpressions": [{"key": "gpus", "operator": "Gt", "values": ["3"]}]}]}}}, {"gpus": "8"}, "n", True),
    ({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpus", "operator": "Lt", "values": ["3"]}]}]}}}, {"gpus": "8"}, "n", False),
    ({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "skip", "operator": "DoesNotExist"},
                              {"key": "zone", "operator": "NotIn", "values": ["x"]}]}]}}}, {}, "n", True),
    ({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]}}}, {}, "n", False),
    ({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n"]}]}]}}}, {}, "n", True),
    ({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["n"]}]}]}}}, {}, "n", False),
    ({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{}]}}}, {}, "n", False),
    ({"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}, {}, "n", True),
    (None, {}, "n", True),
])
def test_agent_placement_follows_node_affinity(affinity, labels, name, selected) -> None:
    assert AgentPlacement({}, affinity).selects(NodeInfo(name, "u", labels)) is selected


def test_agent_placement_node_selector_must_match_every_label() -> None:
    placement = AgentPlacement({"gpu": "true", "pool": "a"})
    assert placement.selects(NodeInfo("n", "u", {"gpu": "true", "pool": "a", "x": "y"}))
    assert not placement.selects(NodeInfo("n", "u", {"gpu": "true"}))


def test_gc_ready_only_for_a_reconciled_config_without_conflict() -> None:
    meta = {"name": "c", "generation": 2}
    ok = {"metadata": meta, "status": {"observedGeneration": 2, "conditions": [
        {"type": "Degraded", "status": "False", "reason": "AsExpected"}]}}
    assert gc_ready(ok) is None
    assert "not reconciled" in gc_ready({"metadata": meta, "status": {"observedGeneration": 1}})
    assert "not reconciled" in gc_ready({"metadata": meta})
    conflict = {"metadata": meta, "status": {"observedGeneration": 2, "conditions": [
        {"type": "Degraded", "status": "True", "reason": "Conflict"}]}}
    assert "conflict" in gc_ready(conflict)
    assert "deleted" in gc_ready({"metadata": {**meta, "deletionTimestamp": "2026-01-01T00:00:00Z"},
                                  "status": ok["status"]})


def test_result_status_has_every_count() -> None:
    from datetime import datetime, timezone

    decision = decide([slice_("a", "gone", owner=None)])
    result = GcResult("c", DRIVER, True, datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc),
                      condemned=decision.condemned)
    assert result.status() == {"lastRun": "2026-01-02T03:04:05Z", "found": 1, "deleted": 0, "errors": 0,
                               "pending": 0, "skipped": 0, "dryRun": True}
    assert result.by_rule(decision.condemned) == f"{NODE_GONE} 1"


def test_delete_limiter_spaces_deletes_at_the_rate_after_the_burst() -> None:
    async def take(n: int, limiter: AbstractAsyncContextManager[Any], tasks: int = 1) -> float:
        """Seconds (of the virtual clock) ``tasks`` concurrent deleters need for ``n`` deletes."""
        loop = asyncio.get_running_loop()
        started = loop.time()

        async def deleter(count: int) -> None:
            for _ in range(count):
                async with limiter:
                    pass

        await asyncio.gather(*(deleter(n // tasks) for _ in range(tasks)))
        return loop.time() - started

    no_wait = pytest.approx(0.0, abs=1e-6)  # a wait for one delete would be 0.02 s

    async def scenario() -> None:
        limiter = delete_limiter(50.0, 10)
        assert await take(10, limiter) == no_wait  # the burst is free
        assert await take(50, limiter) == pytest.approx(1.0)  # then 50 per second
        assert await take(48, limiter, tasks=8) == pytest.approx(0.96)  # whoever asks
        await asyncio.sleep(60)
        assert await take(10, limiter) == no_wait  # an idle while refills the burst, not more
        assert await take(1, limiter) == pytest.approx(0.02)
        unlimited = delete_limiter(0, 1)
        assert await take(1000, unlimited, tasks=8) == no_wait

    virtualtime.run(scenario())


def test_a_failed_list_decides_nothing_and_reports_one_error() -> None:
    from kubernetes_asyncio.client.exceptions import ApiException

    from gpudra_operator.slicegc.apply import SliceCollector

    class ForbiddenPods:
        def __init__(self) -> None:
            self.patches: list[dict] = []
            self.deletes = 0

        async def list(self, rtype, namespace=None, **_):
            if rtype.kind == "Pod":
                raise ApiException(status=403, reason="Forbidden")
            if rtype.kind == "ResourceSlice":
                yield {"metadata": {"name": "s", "uid": "u", "resourceVersion": "1"},
                       "spec": {"driver": DRIVER, "nodeName": "gone", "pool": {"name": "gone", "generation": 1}}}

        async def delete(self, *args, **kwargs):
            self.deletes += 1
            return True

        async def patch(self, rtype, name, patch, **_):
            self.patches.append(patch)
            return {}

    class Events:
        def __init__(self) -> None:
            self.posted: list[tuple[str, str]] = []

        async def post(self, body, type_, reason, message):
            self.posted.append((type_, reason))

    kube, events = ForbiddenPods(), Events()
    body = {"metadata": {"name": "c", "generation": 1}, "spec": {"driverName": DRIVER},
            "status": {"observedGeneration": 1}}
    result = asyncio.run(SliceCollector(kube, events).run_pass(body))  # type: ignore[arg-type]
    assert result is not None and result.condemned == [] and kube.deletes == 0
    assert "Forbidden" in result.errors[0]
    gc = kube.patches[0]["status"]["gc"]
    assert (gc["found"], gc["deleted"], gc["errors"]) == (0, 0, 1)
    assert events.posted == [("Warning", "SliceGCFailed")]


def gc_body(last_run: str | None, interval: str = "10m") -> dict[str, Any]:
    return {"metadata": {"name": "c", "generation": 1},
            "spec": {"driverName": DRIVER, "resourceSliceGC": {"interval": interval}},
            "status": {"observedGeneration": 1, **({"gc": {"lastRun": last_run}} if last_run else {})}}


def rfc3339(seconds: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def test_a_last_run_in_the_future_delays_the_gc_by_one_interval_at_most() -> None:
    """status.gc.lastRun written by a clock that was ahead (or by hand) must not stop the GC until
    that time comes: it counts as a pass just now, and the next one follows an interval later."""
    from gpudra_operator.slicegc.apply import SliceCollector

    now = [1000.0]
    collector = SliceCollector(None, None, clock=lambda: now[0])  # type: ignore[arg-type]
    future = rfc3339(__import__("time").time() + 365 * 86400)
    assert 0 < collector.seconds_until_due(gc_body(future)) <= 600
    now[0] += 600
    assert collector.seconds_until_due(gc_body(future)) <= 0


@pytest.mark.parametrize("wall_step", [+3600.0, -3600.0])
def test_the_gc_schedule_counts_on_the_monotonic_clock(wall_step: float) -> None:
    """Read once, lastRun becomes a pass some seconds ago on the monotonic clock; a later step of
    the wall clock neither runs the GC early nor holds it back."""
    from gpudra_operator.slicegc.apply import SliceCollector

    mono, wall = [1000.0], [1_796_000_000.0]
    collector = SliceCollector(None, None, clock=lambda: mono[0], wall_clock=lambda: wall[0])  # type: ignore[arg-type]
    body = gc_body(rfc3339(wall[0] - 100))  # restarted 100 s after the last pass
    assert collector.seconds_until_due(body) == pytest.approx(500)
    wall[0] += wall_step
    mono[0] += 10
    assert collector.seconds_until_due(body) == pytest.approx(490)
    mono[0] += 490
    assert collector.seconds_until_due(body) <= 0


def test_without_a_last_run_the_first_pass_is_due_at_once() -> None:
    from gpudra_operator.slicegc.apply import SliceCollector

    collector = SliceCollector(None, None)  # type: ignore[arg-type]
    assert collector.seconds_until_due(gc_body(None)) <= 0
    assert collector.seconds_until_due(gc_body("not a time")) <= 0
