"""The leader election's own pieces (the Lease protocol against a real API server is in
tests/integration/test_operator_ha.py): the timing rules that make fencing safe, the fence
that ends a holder's term, and the standby's watch of the Lease."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone

import pytest
import virtualtime

from gpudra_operator.leaderelection import Fence, LeaseElector, Observed, Timing, lease_spec, may_take


def test_the_defaults_fence_a_holder_before_a_standby_may_take_over() -> None:
    timing = Timing()
    # The holder stops renew_deadline after its last renewal began; a standby waits lease_duration
    # after it saw that renewal. The gap is what a request in flight and clock rates may use.
    assert timing.lease_duration - timing.renew_deadline >= 2
    # A crash is taken over within the lease duration, so a change converges within the 15 s.
    assert timing.lease_duration <= 10


@pytest.mark.parametrize("lease, renew, retry", [(7, 7, 2), (10, 2, 2), (10, 7, 0.5), (10.5, 7, 2)])
def test_timings_that_cannot_fence_are_refused(lease: float, renew: float, retry: float) -> None:
    with pytest.raises(ValueError, match="lease duration|whole seconds"):
        Timing(lease, renew, retry)


def test_the_fence_fires_once_the_last_extension_has_run_out() -> None:
    fired = threading.Event()
    fence = Fence(on_expiry=fired.set)
    start = time.monotonic()
    fence.start(start + 0.2)
    fence.extend(start + 0.4)
    fence.extend(start + 0.3)  # never shortens the term
    assert fired.wait(timeout=5)
    assert time.monotonic() - start >= 0.4


def test_a_stopped_fence_never_fires() -> None:
    fired = threading.Event()
    fence = Fence(on_expiry=fired.set)
    fence.start(time.monotonic() + 0.3)
    fence.stop()
    assert not fired.wait(timeout=0.6)


def test_a_fence_whose_term_is_over_fires_at_once() -> None:
    fired = threading.Event()
    Fence(on_expiry=fired.set).start(time.monotonic() - 1)
    assert fired.wait(timeout=1)


def _seen(holder: str | None, duration: float | None = 10) -> Observed:
    return Observed(holder, "2026-12-06T00:00:00.000000Z", "2026-12-06T00:00:00.000000Z", 0, "42", duration)


def test_a_standby_takes_the_lease_only_once_it_has_not_changed_for_the_lease_duration() -> None:
    # The time is what this replica measured on its monotonic clock since it saw the Lease change;
    # nothing written in the Lease (renewTime: another node's wall clock) enters the decision.
    assert not may_take(_seen("a"), "b", unchanged_for=9.99, lease_duration=10)
    assert may_take(_seen("a"), "b", unchanged_for=10.0, lease_duration=10)
    assert may_take(_seen(None), "b", unchanged_for=0, lease_duration=10)  # released
    assert may_take(_seen("b"), "b", unchanged_for=0, lease_duration=10)  # a renewal
    # The holder's own term (the Lease's leaseDurationSeconds) counts, as client-go reads it.
    assert not may_take(_seen("a", duration=15), "b", unchanged_for=12, lease_duration=10)


def test_a_takeover_counts_a_transition_and_a_renewal_keeps_the_acquire_time() -> None:
    now = datetime(2026, 12, 6, 1, 2, 3, 0, timezone.utc)  # zero microseconds still carry ".000000"
    taken = lease_spec({"holderIdentity": "a", "acquireTime": "x", "leaseTransitions": 2}, "b", 10, now)
    assert taken == {"holderIdentity": "b", "leaseDurationSeconds": 10, "acquireTime": "2026-12-06T01:02:03.000000Z",
                     "renewTime": "2026-12-06T01:02:03.000000Z", "leaseTransitions": 3}
    renewed = lease_spec(taken, "b", 10, now.replace(second=5))
    assert (renewed["acquireTime"], renewed["renewTime"], renewed["leaseTransitions"]) == (
        "2026-12-06T01:02:03.000000Z", "2026-12-06T01:02:05.000000Z", 3)
    assert lease_spec({}, "a", 10, now)["leaseTransitions"] == 0  # created


class _ClosingWatches:
    """A Kube whose Lease watch the server ends at once, every time: without an event, or with
    an error. Each start is recorded on the loop's (virtual) clock."""

    def __init__(self, failing: bool) -> None:
        self.failing = failing
        self.starts: list[float] = []

    async def watch(self, *_: object, **__: object) -> AsyncIterator[tuple[str, dict[str, object]]]:
        self.starts.append(asyncio.get_running_loop().time())
        if len(self.starts) > 100:  # a tight loop of starts: hold it here (the test's assertion tells)
            await asyncio.Event().wait()
        await asyncio.sleep(0)  # a real watch does I/O: the loop runs between two of them
        if self.failing:
            raise OSError("connection reset by peer")
        return
        yield  # an async generator that ends without an event


@pytest.mark.parametrize("failing", [False, True], ids=["closed", "failed"])
def test_a_lease_watch_the_server_keeps_ending_is_started_at_most_once_per_retry_period(failing: bool) -> None:
    kube = _ClosingWatches(failing)

    async def scenario() -> None:
        timing = Timing()
        elector = LeaseElector(kube, "ns", "me", timing, clock=asyncio.get_running_loop().time)
        watching = asyncio.create_task(elector._watch_lease())
        await asyncio.sleep(10 * timing.retry_period)
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching

    virtualtime.run(scenario())
    assert kube.starts[0] == pytest.approx(0, abs=1e-6)  # the first watch starts at once
    assert len(kube.starts) <= 11, f"{len(kube.starts)} watches in {10 * Timing().retry_period:g} s"
    assert min(b - a for a, b in zip(kube.starts, kube.starts[1:])) >= Timing().retry_period - 1e-6


def test_a_lease_watch_that_ran_its_course_is_followed_at_once() -> None:
    """The normal path: the server ends each watch at its timeout (minutes); the next starts then."""

    class Long(_ClosingWatches):
        async def watch(self, *_: object, **__: object) -> AsyncIterator[tuple[str, dict[str, object]]]:
            self.starts.append(asyncio.get_running_loop().time())
            await asyncio.sleep(300)
            return
            yield

    kube = Long(failing=False)

    async def scenario() -> None:
        elector = LeaseElector(kube, "ns", "me", clock=asyncio.get_running_loop().time)
        watching = asyncio.create_task(elector._watch_lease())
        await asyncio.sleep(650)
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching

    virtualtime.run(scenario())
    assert kube.starts == pytest.approx([0, 300, 600], abs=1e-3)


def test_two_replicas_on_one_nodes_host_network_hold_the_lease_under_different_names() -> None:
    from gpudra_operator.operator_cmd import holder_identity

    # On the host network both containers see the node's host name, and each is PID 1.
    one = holder_identity({"POD_NAME": "gpudra-operator-7d9-abcde"}, "gpu-node-1", 1)
    two = holder_identity({"POD_NAME": "gpudra-operator-7d9-fghij"}, "gpu-node-1", 1)
    assert one != two and one == "gpudra-operator-7d9-abcde/1"
    # A container restarted in its pod takes its Lease back at once: the same name again.
    assert holder_identity({"POD_NAME": "gpudra-operator-7d9-abcde"}, "gpu-node-1", 1) == one
    assert holder_identity({}, "pod-hostname", 7) == "pod-hostname/7"
    assert holder_identity({"POD_ID": "given", "POD_NAME": "p"}, "h", 1) == "given"
