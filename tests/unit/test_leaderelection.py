"""The leader election's own pieces (the Lease protocol against a real API server is in
tests/integration/test_operator_ha.py): the timing rules that make fencing safe, and the fence
that ends a holder's term."""

from __future__ import annotations

import threading
import time

import pytest

from gpudra_operator.leaderelection import Fence, Timing


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
