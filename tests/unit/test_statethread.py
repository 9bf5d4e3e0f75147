"""StateThread: calls that queue up while a batch runs become one batch (group commit), in
arrival order; every caller gets its own items' results; a failing batch fails only its calls."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from gpudra_driver.plugin.statethread import StateThread


class Recorder:
    """Handlers that record each batch; the first batch waits until released."""

    def __init__(self) -> None:
        self.batches: list[tuple[str, list[str]]] = []
        self.entered = threading.Event()
        self.release = threading.Event()

    def handler(self, kind: str, fail: bool = False):  # type: ignore[no-untyped-def]
        def handle(items: list[str]) -> dict[str, Any]:
            self.batches.append((kind, list(items)))
            self.entered.set()
            assert self.release.wait(10), "the test never released the first batch"
            if fail:
                raise OSError(f"{kind}: disk gone")
            return {item: f"{kind}:{item}" for item in items}
        return handle


def same(item: str) -> str:
    return item


async def test_calls_queued_during_a_batch_form_the_next_batch_in_order() -> None:
    rec = Recorder()
    thread = StateThread({"prepare": rec.handler("prepare"), "unprepare": rec.handler("unprepare")})
    thread.start()
    try:
        first = thread.submit("prepare", ["a"], same)
        assert await asyncio.to_thread(rec.entered.wait, 10)  # the thread is busy with "a"
        queued = [thread.submit("prepare", ["b", "c"], same), thread.submit("prepare", ["d"], same),
                  thread.submit("unprepare", ["a"], same), thread.submit("prepare", ["e"], same)]
        rec.release.set()
        results = await asyncio.gather(first, *queued)
    finally:
        await thread.stop()
    assert rec.batches == [("prepare", ["a"]), ("prepare", ["b", "c", "d"]), ("unprepare", ["a"]),
                           ("prepare", ["e"])]
    assert results == [{"a": "prepare:a"}, {"b": "prepare:b", "c": "prepare:c"}, {"d": "prepare:d"},
                       {"a": "unprepare:a"}, {"e": "prepare:e"}]


async def test_a_failing_batch_fails_its_own_calls_only_and_the_thread_goes_on() -> None:
    rec = Recorder()
    rec.release.set()
    thread = StateThread({"prepare": rec.handler("prepare"), "unprepare": rec.handler("unprepare", fail=True)})
    thread.start()
    try:
        with pytest.raises(OSError, match="disk gone"):
            await thread.submit("unprepare", ["a"], same)
        assert await thread.submit("prepare", ["b"], same) == {"b": "prepare:b"}
        with pytest.raises(ValueError, match="unknown call kind"):
            thread.submit("explode", ["c"], same)
    finally:
        await thread.stop()


async def test_a_caller_that_gives_up_does_not_stop_its_batch_and_stop_drains_the_queue() -> None:
    rec = Recorder()
    thread = StateThread({"prepare": rec.handler("prepare")})
    thread.start()
    first = thread.submit("prepare", ["a"], same)
    assert await asyncio.to_thread(rec.entered.wait, 10)
    impatient = thread.submit("prepare", ["b"], same)
    impatient.cancel()
    last = thread.submit("prepare", ["c"], same)
    rec.release.set()
    await thread.stop()  # returns once everything queued before it is done
    assert rec.batches == [("prepare", ["a"]), ("prepare", ["b", "c"])]
    assert first.result() == {"a": "prepare:a"} and last.result() == {"c": "prepare:c"} and impatient.cancelled()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the point of it
async def test_a_thread_that_dies_answers_what_it_took_and_refuses_the_rest() -> None:
    def die(items: list[str]) -> dict[str, Any]:
        raise SystemExit("killed")

    thread = StateThread({"prepare": die})
    thread.start()
    with pytest.raises(RuntimeError, match="state thread stopped"):
        await thread.submit("prepare", ["a"], same)
    await thread.stop()
    with pytest.raises(RuntimeError, match="not running"):
        thread.submit("prepare", ["b"], same)


async def test_a_round_waits_for_calls_that_are_coming_and_takes_them_along() -> None:
    rec = Recorder()
    rec.release.set()
    coming = 1  # another call's claim GET is in flight
    thread = StateThread({"prepare": rec.handler("prepare")}, coming=lambda: coming, gather_delay=60)
    thread.start()
    try:
        first = thread.submit("prepare", ["a"], same)  # its round waits (up to 60 s) for the coming call
        coming = 0
        second = thread.submit("prepare", ["b"], same)
        assert await asyncio.wait_for(asyncio.gather(first, second), 10) == [{"a": "prepare:a"}, {"b": "prepare:b"}]
    finally:
        await thread.stop()
    assert rec.batches == [("prepare", ["a", "b"])]  # one round, one commit


async def test_a_lone_call_never_waits_and_a_call_that_never_comes_delays_a_round_only_briefly() -> None:
    rec = Recorder()
    rec.release.set()
    coming = 0
    thread = StateThread({"prepare": rec.handler("prepare")}, coming=lambda: coming, gather_delay=60)
    thread.start()
    try:  # nothing coming: answered at once, not after the 60 s delay
        assert await asyncio.wait_for(thread.submit("prepare", ["a"], same), 10) == {"a": "prepare:a"}
    finally:
        await thread.stop()
    coming = 1  # a call that announces itself but never arrives (its GET hangs)
    thread = StateThread({"prepare": rec.handler("prepare")}, coming=lambda: coming, gather_delay=0.05)
    thread.start()
    try:
        assert await asyncio.wait_for(thread.submit("prepare", ["b"], same), 10) == {"b": "prepare:b"}
    finally:
        await thread.stop()
