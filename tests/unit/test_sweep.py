"""The checkpoint sweep's decision (pure) and its runner on fakes: only evidence releases a claim."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from plugin_fixtures import DRIVER, NODE, claim, devices, result

from gpudra_driver import metrics
from gpudra_driver.plugin.checkpoint import Checkpoint
from gpudra_driver.plugin.model import ClaimRef
from gpudra_driver.plugin.plan import plan_prepare
from gpudra_driver.plugin.sweep import HeldClaim, LeakSweeper, leak_reason

A = "0c1d2e3f-0000-4000-8000-00000000000a"
B = "0c1d2e3f-0000-4000-8000-00000000000b"


def prepared(uid: str, name: str, device: str) -> HeldClaim:
    return HeldClaim.of(plan_prepare(ClaimRef("ns", name, uid), claim(uid, name=name, results=[result(device)]),
                                     devices(), Checkpoint("b"), node=NODE, driver=DRIVER).claim)


def test_only_a_gone_recreated_or_deallocated_claim_is_leaked() -> None:
    mine = prepared(A, "a", "gpu-2")
    assert leak_reason(mine, claim(A, name="a", results=[result("gpu-2")]), driver=DRIVER, node=NODE) is None
    assert leak_reason(mine, None, driver=DRIVER, node=NODE) == "deleted"
    assert "re-created (now UID " + B in leak_reason(mine, claim(B, name="a", results=[result("gpu-2")]),
                                                      driver=DRIVER, node=NODE)  # type: ignore[operator]
    assert leak_reason(mine, claim(A, name="a", allocated=False), driver=DRIVER, node=NODE) == \
        "no longer allocated any of its devices on this node"
    assert leak_reason(mine, claim(A, name="a", results=[result("gpu-2", pool="other-node")]),
                       driver=DRIVER, node=NODE) is not None
    # another driver's results in the same claim change nothing for ours
    both = claim(A, name="a", results=[result("gpu-2"), result("x", driver="other.example.com")])
    assert leak_reason(mine, both, driver=DRIVER, node=NODE) is None


def test_the_sweep_releases_what_the_api_server_shows_leaked_and_keeps_the_rest() -> None:
    claims = {"a": prepared(A, "a", "gpu-2"), "b": prepared(B, "b", "gpu-3")}
    answers: dict[str, Any] = {"a": None, "b": RuntimeError("API server unreachable")}
    unprepared: list[list[str]] = []
    events: list[tuple[str, str, str]] = []

    async def get_claim(namespace: str, name: str) -> Mapping[str, Any] | None:
        answer = answers[name]
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def unprepare(refs: Sequence[ClaimRef]) -> Mapping[str, str | None]:
        unprepared.append([r.uid for r in refs])
        return {r.uid: None for r in refs}

    async def report(kind: str, reason: str, message: str) -> None:
        events.append((kind, reason, message))

    sweeper = LeakSweeper(prepared=lambda: list(claims.values()), get_claim=get_claim, unprepare=unprepare,
                          driver=DRIVER, node=NODE, report=report, rate=1000)
    before = metrics.LEAKED_CLAIMS_RELEASED._value.get()
    assert asyncio.run(sweeper.sweep_once()) == []  # a first look only makes it a suspect
    assert unprepared == [] and events == []
    assert asyncio.run(sweeper.sweep_once()) == [A]  # found leaked by two sweeps in a row
    assert unprepared == [[A]]  # b's GET failed: no evidence, kept
    (event,) = events
    assert event[:2] == ("Warning", "LeakedClaimReleased") and "deleted" in event[2] and "gpu-2" in event[2]
    assert metrics.LEAKED_CLAIMS_RELEASED._value.get() == before + 1
    # a suspect that is allocated again by the next look is kept (deallocated, then re-allocated here)
    answers["a"] = claim(A, name="a", results=[result("gpu-2")])
    answers["b"] = claim(B, name="b", allocated=False)
    assert asyncio.run(sweeper.sweep_once()) == []  # b a suspect now, a fine
    answers["b"] = claim(B, name="b", results=[result("gpu-3")])
    assert asyncio.run(sweeper.sweep_once()) == []  # b allocated again: never released
