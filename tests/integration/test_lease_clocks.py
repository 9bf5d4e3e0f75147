"""The Lease's terms run on each replica's monotonic clock, never on the wall clock (docs/ha.md):
two electors in process against the real API server, the standby's wall clock stepped
(``time.time`` patched; the machine's clock is left alone) and its monotonic clock moved by hand.
A step forward must not let it take a live Lease; a step back must not keep it from taking a
Lease whose holder is gone."""

from __future__ import annotations

import time

import pytest

from gpudra_core.kubeapi import Kube
from gpudra_operator.leaderelection import LEASE, LeaseElector, Timing

TIMING = Timing()  # lease duration 10 s, renew deadline 7 s, retry period 2 s


class Clocks:
    """The standby's two clocks: a monotonic one moved by hand, and the wall clock's offset."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monotonic = 0.0
        self.wall_offset = 0.0
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + self.wall_offset)

    def step_wall(self, seconds: float) -> None:
        self.wall_offset += seconds

    def elapse(self, seconds: float) -> None:
        self.monotonic += seconds
        self.wall_offset += seconds


async def electors(kube: Kube, namespace: str, clocks: Clocks) -> tuple[LeaseElector, LeaseElector]:
    holder = LeaseElector(kube, namespace, "holder", TIMING)
    standby = LeaseElector(kube, namespace, "standby", TIMING, clock=lambda: clocks.monotonic)
    assert await holder.try_acquire_or_renew()
    assert not await standby.try_acquire_or_renew()  # it has seen the holder's renewal: the term starts
    return holder, standby


async def holder_of(kube: Kube, namespace: str) -> str | None:
    lease = await kube.get(LEASE, "gpudra-operator", namespace)
    return ((lease or {}).get("spec") or {}).get("holderIdentity")


async def test_a_forward_step_of_the_wall_clock_does_not_let_a_standby_take_a_live_lease(
        kube: Kube, namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    clocks = Clocks(monkeypatch)
    _, standby = await electors(kube, namespace, clocks)
    clocks.step_wall(8)  # NTP corrects the standby's clock by 8 s
    clocks.elapse(TIMING.retry_period + 0.5)  # the holder's next renewal is a little late, well within its term
    assert not await standby.try_acquire_or_renew()
    assert await holder_of(kube, namespace) == "holder"
    # Only a Lease unchanged for the lease duration, as the standby measured it, is taken.
    clocks.elapse(TIMING.lease_duration - TIMING.retry_period - 0.5)
    assert await standby.try_acquire_or_renew()
    assert await holder_of(kube, namespace) == "standby"


async def test_a_backward_step_of_the_wall_clock_does_not_keep_a_standby_from_a_lost_lease(
        kube: Kube, namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    clocks = Clocks(monkeypatch)
    _, standby = await electors(kube, namespace, clocks)
    clocks.step_wall(-3600)  # the standby's clock goes back an hour
    clocks.elapse(TIMING.lease_duration - 0.5)
    assert not await standby.try_acquire_or_renew()  # the holder may still be renewing
    clocks.elapse(0.5)  # the holder has not renewed for the lease duration: it is gone
    assert await standby.try_acquire_or_renew()
    assert await holder_of(kube, namespace) == "standby"
