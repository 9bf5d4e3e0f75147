"""GroupCommit: calls that queue up while a round runs become one batch (group commit), in
arrival order; every caller gets its own items' results; a failing batch fails only its calls."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gpudra_driver.plugin.groupcommit import GroupCommit


class Recorder:
    """Handlers that record each batch; the first batch waits until released."""

    def __init__(self) -> None:
        self.batches: list[tuple[str, list[str]]] = []
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    def handler(self, kind: str, fail: bool = False):  # type: ignore[no-untyped-def]
        async def handle(items: list[str], deadline: float | None = None) -> dict[str, Any]:
            self.batches.append((kind, list(items)))
            self.entered.set()
            await asyncio.wait_for(self.release.wait(), 10)
            if fail:
                raise OSError(f"{kind}: disk gone")
            return {item: f"{kind}:{item}" for item in items}
        return handle


def same(item: str) -> str:
    return item


async def test_calls_queued_during_a_round_form_the_next_batch_in_order() -> None:
    rec = Recorder()
    rounds = GroupCommit({"prepare": rec.handler("prepare"), "unprepare": rec.handler("unprepare")})
    rounds.start()
    try:
        first = rounds.submit("prepare", ["a"], same)
        await asyncio.wait_for(rec.entered.wait(), 10)  # the round with "a" runs
        queued = [rounds.submit("prepare", ["b", "c"], same), rounds.submit("prepare", ["d"], same),
                  rounds.submit("unprepare", ["a"], same), rounds.submit("prepare", ["e"], same)]
        rec.release.set()
        results = await asyncio.gather(first, *queued)
    finally:
        await rounds.stop()
    assert rec.batches == [("prepare", ["a"]), ("prepare", ["b", "c", "d"]), ("unprepare", ["a"]),
                           ("prepare", ["e"])]
    assert results == [{"a": "prepare:a"}, {"b": "prepare:b", "c": "prepare:c"}, {"d": "prepare:d"},
                       {"a": "unprepare:a"}, {"e": "prepare:e"}]


async def test_a_failing_batch_fails_its_own_calls_only_and_the_rounds_go_on() -> None:
    rec = Recorder()
    rec.release.set()
    rounds = GroupCommit({"prepare": rec.handler("prepare"), "unprepare": rec.handler("unprepare", fail=True)})
    rounds.start()
    try:
        with pytest.raises(OSError, match="disk gone"):
            await rounds.submit("unprepare", ["a"], same)
        assert await rounds.submit("prepare", ["b"], same) == {"b": "prepare:b"}
        with pytest.raises(ValueError, match="unknown call kind"):
            rounds.submit("explode", ["c"], same)
    finally:
        await rounds.stop()


async def test_a_caller_that_gives_up_does_not_stop_its_batch_and_stop_drains_the_queue() -> None:
    rec = Recorder()
    rounds = GroupCommit({"prepare": rec.handler("prepare")})
    rounds.start()
    first = rounds.submit("prepare", ["a"], same)
    await asyncio.wait_for(rec.entered.wait(), 10)
    impatient = rounds.submit("prepare", ["b"], same)
    impatient.cancel()
    last = rounds.submit("prepare", ["c"], same)
    rec.release.set()
    await rounds.stop()  # returns once everything queued before it is done
    assert rec.batches == [("prepare", ["a"]), ("prepare", ["b", "c"])]
    assert first.result() == {"a": "prepare:a"} and last.result() == {"c": "prepare:c"} and impatient.cancelled()
    with pytest.raises(RuntimeError, match="not running"):
        rounds.submit("prepare", ["d"], same)


class Fatal(BaseException):
    """What ends the rounds' task (e.g. its cancellation at shutdown), as opposed to a batch's error."""


async def test_rounds_that_end_answer_what_they_took_and_refuse_the_rest() -> None:
    async def die(items: list[str], deadline: float | None = None) -> dict[str, Any]:
        raise Fatal("killed")

    rounds = GroupCommit({"prepare": die})
    rounds.start()
    taken = [rounds.submit("prepare", ["a"], same), rounds.submit("prepare", ["b"], same)]
    for call in taken:
        with pytest.raises(RuntimeError, match="group commit stopped"):
            await call
    with pytest.raises(RuntimeError, match="not running"):
        rounds.submit("prepare", ["c"], same)
    await rounds.stop()


async def test_a_round_waits_for_calls_that_are_coming_and_takes_them_along() -> None:
    rec = Recorder()
    rec.release.set()
    asked = asyncio.Event()
    pending = 1  # another call's claim GET is in flight

    def coming() -> int:
        asked.set()
        return pending

    rounds = GroupCommit({"prepare": rec.handler("prepare")}, coming=coming, gather_delay=60)
    rounds.start()
    try:
        first = rounds.submit("prepare", ["a"], same)
        await asyncio.wait_for(asked.wait(), 10)  # its round has looked: it waits (up to 60 s) for more
        assert not first.done()
        pending = 0
        second = rounds.submit("prepare", ["b"], same)
        assert await asyncio.wait_for(asyncio.gather(first, second), 10) == [{"a": "prepare:a"}, {"b": "prepare:b"}]
    finally:
        await rounds.stop()
    assert rec.batches == [("prepare", ["a", "b"])]  # one round, one commit


async def test_a_lone_call_never_waits_and_a_call_that_never_comes_delays_a_round_only_briefly() -> None:
    rec = Recorder()
    rec.release.set()
    coming = 0
    rounds = GroupCommit({"prepare": rec.handler("prepare")}, coming=lambda: coming, gather_delay=60)
    rounds.start()
    try:  # nothing coming: answered at once, not after the 60 s delay
        assert await asyncio.wait_for(rounds.submit("prepare", ["a"], same), 10) == {"a": "prepare:a"}
    finally:
        await rounds.stop()
    coming = 1  # a call that announces itself but never arrives (its GET hangs)
    rounds = GroupCommit({"prepare": rec.handler("prepare")}, coming=lambda: coming, gather_delay=0.05)
    rounds.start()
    try:
        assert await asyncio.wait_for(rounds.submit("prepare", ["b"], same), 10) == {"b": "prepare:b"}
    finally:
        await rounds.stop()


async def test_results_that_cannot_be_given_fail_their_calls_and_the_rounds_go_on() -> None:
    async def broken(items: list[str], deadline: float | None = None) -> Any:
        return None  # a bug: not a mapping of results

    rec = Recorder()
    rec.release.set()
    rounds = GroupCommit({"prepare": broken, "unprepare": rec.handler("unprepare")})
    rounds.start()
    try:
        with pytest.raises(TypeError):
            await asyncio.wait_for(rounds.submit("prepare", ["a"], same), 10)
        assert await asyncio.wait_for(rounds.submit("unprepare", ["a"], same), 10) == {"a": "unprepare:a"}
    finally:
        await rounds.stop()


async def test_rounds_cancelled_while_gathering_or_running_answer_every_call_taken_or_queued() -> None:
    asked = asyncio.Event()

    def coming() -> int:
        asked.set()
        return 1  # a call that never arrives: the round keeps gathering

    rec = Recorder()
    rounds = GroupCommit({"prepare": rec.handler("prepare")}, coming=coming, gather_delay=60)
    rounds.start()
    gathering = rounds.submit("prepare", ["a"], same)
    await asyncio.wait_for(asked.wait(), 10)
    assert rounds._task is not None
    rounds._task.cancel()  # the agent going down
    with pytest.raises(RuntimeError, match="group commit stopped"):
        await asyncio.wait_for(gathering, 10)
    await rounds.stop()

    rounds = GroupCommit({"prepare": rec.handler("prepare")})
    rounds.start()
    running = rounds.submit("prepare", ["b"], same)
    await asyncio.wait_for(rec.entered.wait(), 10)  # its round runs (and waits for the test)
    queued = rounds.submit("prepare", ["c"], same)
    assert rounds._task is not None
    rounds._task.cancel()
    for call in (running, queued):
        with pytest.raises(RuntimeError, match="group commit stopped"):
            await asyncio.wait_for(call, 10)
    with pytest.raises(RuntimeError, match="not running"):
        rounds.submit("prepare", ["d"], same)
    await rounds.stop()


async def test_ended_raises_when_the_rounds_end_unasked_and_returns_after_stop() -> None:
    rec = Recorder()
    rounds = GroupCommit({"prepare": rec.handler("prepare")})
    rounds.start()
    watching = asyncio.ensure_future(rounds.ended())
    done, _ = await asyncio.wait({watching}, timeout=0.2)  # an ended() that returned early would be done
    assert not done  # serving: the watcher waits
    assert rounds._task is not None
    rounds._task.cancel()  # ended by something other than stop()
    with pytest.raises(RuntimeError, match="group commit was cancelled"):
        await asyncio.wait_for(watching, 10)
    await rounds.stop()

    rounds = GroupCommit({"prepare": rec.handler("prepare")})
    rounds.start()
    watching = asyncio.ensure_future(rounds.ended())
    await rounds.stop()
    await asyncio.wait_for(watching, 10)  # the normal end: no error

    rounds = GroupCommit({"prepare": rec.handler("prepare")})
    rounds.start()
    watcher = asyncio.ensure_future(rounds.ended())
    await asyncio.sleep(0)
    watcher.cancel()  # cancelling the watcher leaves the rounds running
    with pytest.raises(asyncio.CancelledError):
        await watcher
    rec.release.set()
    assert await asyncio.wait_for(rounds.submit("prepare", ["a"], same), 10) == {"a": "prepare:a"}
    await rounds.stop()


async def test_a_batch_gets_the_earliest_deadline_of_its_calls() -> None:
    seen: list[float | None] = []

    async def handle(items: list[str], deadline: float | None = None) -> dict[str, Any]:
        seen.append(deadline)
        return {item: item for item in items}

    gate = asyncio.Event()

    async def first(items: list[str], deadline: float | None = None) -> dict[str, Any]:
        await asyncio.wait_for(gate.wait(), 10)  # the next calls queue up behind this round
        return await handle(items, deadline)

    rounds = GroupCommit({"first": first, "prepare": handle})
    rounds.start()
    try:
        running = rounds.submit("first", ["x"], same)
        queued = [rounds.submit("prepare", ["a"], same, deadline=30.0), rounds.submit("prepare", ["b"], same),
                  rounds.submit("prepare", ["c"], same, deadline=20.0)]
        gate.set()
        await asyncio.wait_for(asyncio.gather(running, *queued), 10)
        assert seen == [None, 20.0]  # one batch of a, b, c: the earliest deadline
    finally:
        await rounds.stop()


async def test_a_running_round_reports_how_long_it_has_run() -> None:
    """What the liveness check reads: the age of the round running now, 0 between rounds, also
    after a round that failed."""
    rec = Recorder()
    rounds = GroupCommit({"prepare": rec.handler("prepare", fail=True)})
    rounds.start()
    try:
        assert rounds.round_running_for() == 0
        call = rounds.submit("prepare", ["a"], same)
        await asyncio.wait_for(rec.entered.wait(), 10)
        first = rounds.round_running_for()
        assert first > 0 and rounds.round_running_for() >= first  # it grows while the round runs
        rec.release.set()
        with pytest.raises(OSError, match="disk gone"):
            await call
        assert rounds.round_running_for() == 0
    finally:
        await rounds.stop()
