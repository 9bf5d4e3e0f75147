"""The publisher's retries, on a virtual clock: exponential backoff from 0.2 s doubling to 30 s, a
success resets it, a conflict replans without counting as an error, cancellation ends the loops."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
import virtualtime
from kubernetes_asyncio.client.exceptions import ApiException
from prometheus_client import REGISTRY

from gpudra_core.devicemodel import AttrValue, Device
from gpudra_driver import retrying as retrying_module
from gpudra_driver.publishing.apply import SlicePublisher

DRIVER = "gpu.gpudra.io"
NODE = "node-a"
DEVICES = [Device("gpu-0", {"type": AttrValue.of_string("gpu")}, {"memory": 80 * 2**30})]


class FlakyKube:
    """Fails the calls it is told to (``lists``, ``applies``: exceptions to raise, in order);
    every watch fails at once (``watch_error``) or ends."""

    def __init__(self, lists: list[Exception] | None = None, applies: list[Exception] | None = None,
                 watch_error: Exception | None = None) -> None:
        self.lists, self.applies, self.watch_error = list(lists or []), list(applies or []), watch_error
        self.applied: list[float] = []  # loop time of each successful apply

    async def request(self, method: str, path: str, **_: Any) -> dict[str, Any]:
        if self.lists:
            raise self.lists.pop(0)
        return {"items": [], "metadata": {"resourceVersion": "1"}}

    async def watch(self, *_: Any, **__: Any) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        if self.watch_error is not None:
            raise self.watch_error
        await asyncio.sleep(300)  # the watch's own timeout, then a relist
        return
        yield  # an async generator

    async def get(self, *_: Any, **__: Any) -> dict[str, Any]:
        return {"metadata": {"name": NODE, "uid": "uid-node"}}

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        if self.applies:
            raise self.applies.pop(0)
        self.applied.append(asyncio.get_running_loop().time())
        return {**obj, "metadata": {**obj["metadata"], "uid": "u", "resourceVersion": "2"}}


@pytest.fixture(autouse=True)
def no_jitter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exact waits to compare with; test_waits_are_jittered_downwards checks the jitter."""
    monkeypatch.setattr(retrying_module, "jitter", lambda: 0.0)


def publish_errors() -> float:
    return REGISTRY.get_sample_value("gpudra_agent_publish_errors_total") or 0.0


def delays(caplog: pytest.LogCaptureFixture, what: str) -> list[float]:
    return [float(m.group(1)) for r in caplog.records
            if r.getMessage().startswith(what) and (m := re.search(r" in ([\d.]+)s$", r.getMessage()))]


async def run_for(seconds: float, publisher: SlicePublisher) -> None:
    task = asyncio.ensure_future(publisher.run())
    await asyncio.sleep(seconds)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_an_unreachable_api_server_is_listed_again_with_exponential_backoff(caplog) -> None:
    caplog.set_level(logging.INFO, "gpudra_driver.publishing.apply")
    kube = FlakyKube(lists=[OSError("connection refused")] * 10, watch_error=ConnectionResetError("cut"))
    publisher = SlicePublisher(kube, DRIVER, NODE)  # type: ignore[arg-type]

    virtualtime.run(run_for(111.9, publisher))
    assert delays(caplog, "listing ResourceSlices failed") == [0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 30.0, 30.0]
    # Listed at 111.0 s; from then each watch fails at once, and its relist succeeds (backoff reset).
    assert delays(caplog, "watching ResourceSlices failed") == [0.2] * 5
    assert publisher.synced.is_set()


def test_failed_writes_back_off_conflicts_replan_and_a_success_resets(caplog) -> None:
    caplog.set_level(logging.INFO, "gpudra_driver.publishing.apply")
    conflict = ApiException(status=409, reason="Conflict")
    kube = FlakyKube(applies=[conflict, OSError("reset"), OSError("reset"), OSError("reset")])
    publisher = SlicePublisher(kube, DRIVER, NODE)  # type: ignore[arg-type]
    errors_before = publish_errors()

    async def scenario() -> None:
        publisher.set_devices(DEVICES)
        task = asyncio.ensure_future(publisher.run())
        await asyncio.sleep(5)
        assert kube.applied == [pytest.approx(0.2 + 0.4 + 0.8 + 1.6, abs=1e-6)]
        kube.applies = [OSError("reset")]
        publisher.set_devices(DEVICES * 0)  # a change: the next write fails once, after 0.2 s again
        await asyncio.sleep(5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    virtualtime.run(scenario())
    assert delays(caplog, "ResourceSlice write conflicted") == [0.2]
    assert delays(caplog, "publishing ResourceSlices failed") == [0.4, 0.8, 1.6, 0.2]
    assert publish_errors() - errors_before == 4  # conflicts are not errors
    assert len(kube.applied) == 2 and publisher.published.is_set()


def test_waits_are_jittered_downwards_so_a_fleet_comes_back_spread_out(
        caplog, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, "gpudra_driver.publishing.apply")
    draws = iter([0.0, 0.5, 0.999, 0.25] * 3)
    monkeypatch.setattr(retrying_module, "jitter", lambda: next(draws))
    kube = FlakyKube(lists=[OSError("connection refused")] * 4, watch_error=ConnectionResetError("cut"))
    publisher = SlicePublisher(kube, DRIVER, NODE)  # type: ignore[arg-type]
    virtualtime.run(run_for(3.0, publisher))
    # 0.2, 0.4, 0.8, 1.6 shortened by 0 %, 10 %, ~20 %, 5 %: never longer, never below 80 %
    assert delays(caplog, "listing ResourceSlices failed") == [0.2, 0.36, 0.64, 1.52]

