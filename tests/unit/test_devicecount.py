"""The watch-fed counts of a driver's slices (devicecount.py), fed here as ListThenWatch feeds them,
the classes matched by the real gpudra-allocator; and what the operator leaves running when it
stops (devicecount.py, childevents.py): nothing. kopf waits up to 5 s for the tasks left after its
cleanup before `gpudra operator` releases the Lease, so a pending debounce would hold up a
SIGTERM's handover, then fail on the closed client."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from gpudra_core.kubeapi import Kube
from gpudra_operator.childevents import ChildEvents
from gpudra_operator.classcounts import ClassCount, ClassSelectors, Matcher, class_selectors
from gpudra_operator.devicecount import DeviceCounts, DriverSlices
from gpudra_operator.events import EventRecorder
from gpudra_dev.localcluster.waiting import wait_for
from gpudra_operator.reconcile import Reconciler
from gpudra_operator.statusrefresh import StatusRefresh

DRIVER = "gpu.gpudra.io"


def classes(memory: str) -> tuple[ClassSelectors, ...]:
    return (class_selectors({"metadata": {"name": "big"}, "spec": {"selectors": [{"cel": {
        "expression": f'device.capacity["{DRIVER}"].memory.compareTo(quantity("{memory}")) >= 0'}}]}}),)


def slice_(name: str, *memories: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"driver": DRIVER, "nodeName": name, "pool": {"name": name}, "devices": [
        {"name": f"gpu-{i}", "capacity": {"memory": {"value": m}}} for i, m in enumerate(memories)]}}


async def test_slices_are_matched_per_page_then_from_the_memo_or_in_the_background() -> None:
    refreshed: list[str] = []

    async def on_synced(driver: str) -> None:
        refreshed.append(driver)

    matcher = Matcher()
    slices = DriverSlices(None, DRIVER, matcher, on_synced=on_synced, classes=classes("64Gi"))  # type: ignore[arg-type]
    try:
        slices.list_started()
        await slices.list_page([slice_("n1", "80Gi", "40Gi"), slice_("n2", "80Gi")])
        await slices.list_done()
        assert refreshed == [DRIVER] and slices.total == 3
        assert slices.class_counts(set()) == [ClassCount("big", 2, 0, 2, 2)]

        slices.changed(slice_("n3", "40Gi", "80Gi"))  # values the memo knows: matched at once
        assert slices.class_counts(set()) == [ClassCount("big", 3, 0, 3, 3)]
        slices.changed(slice_("n4", "96Gi"))  # new values: the helper is asked, in the background
        assert slices.total == 6 and slices.class_counts(set()) is None  # unknown meanwhile, not undercounted
        await wait_for(lambda: _is(slices.class_counts(set()), [ClassCount("big", 4, 0, 4, 4)]), timeout=10,
                       what="n4 matched")
        slices.deleted(slice_("n1"))
        assert slices.class_counts(set()) == [ClassCount("big", 3, 0, 3, 3)] and slices.total == 4

        slices.want(classes("90Gi"))  # a spec edit: the kept slices matched again, after the debounce
        assert slices.class_counts(set()) is None
        await wait_for(lambda: _is(slices.class_counts(set()), [ClassCount("big", 1, 0, 1, 1)]), timeout=10,
                       what="the new classes matched")
        assert refreshed == [DRIVER, DRIVER]  # and status refreshed
    finally:
        await asyncio.gather(*slices.cancel(), return_exceptions=True)
        await matcher.close()


async def _is(got: Any, wanted: Any) -> bool:
    return bool(got == wanted)


async def forever() -> None:
    await asyncio.Event().wait()


async def test_without_the_helper_devices_are_counted_and_class_counts_unknown_until_it_works(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    matcher = Matcher(where=tmp_path)  # an empty directory: gpudra-allocator not installed
    slices = DriverSlices(None, DRIVER, matcher, classes=classes("64Gi"))  # type: ignore[arg-type]
    try:
        with caplog.at_level(logging.WARNING, "gpudra.operator"):
            slices.list_started()
            await slices.list_page([slice_("n1", "80Gi", "40Gi")])
            await slices.list_page([slice_("n2", "80Gi")])  # not asked again while backing off
            await slices.list_done()
        assert slices.total == 3 and slices.class_counts(set()) is None  # status keeps the counts it holds
        [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert f"matching the devices of driver {DRIVER} against its DeviceClasses failed" in warning
        assert "gpudra-allocator (Kubernetes' own DRA allocator" in warning and "is not installed" in warning

        matcher.where = None  # installed now: the next try (after the backoff) counts
        await wait_for(lambda: _is(slices.class_counts(set()), [ClassCount("big", 2, 0, 2, 2)]), timeout=10,
                       what="the counts once the helper works")
    finally:
        await asyncio.gather(*slices.cancel(), return_exceptions=True)
        await matcher.close()


async def test_close_drops_a_pending_match_of_changed_classes_and_its_status_refresh() -> None:
    refreshed: list[str] = []

    async def on_synced(driver: str) -> None:
        refreshed.append(driver)

    counts = DeviceCounts(None, on_synced=on_synced)  # type: ignore[arg-type]  # no request is made
    slices = DriverSlices(None, DRIVER, counts.matcher, on_synced=on_synced,  # type: ignore[arg-type]
                          classes=classes("64Gi"))
    slices.list_started()
    await slices.list_page([slice_("n1", "80Gi")])
    await slices.list_done()  # listed once: status refreshed
    assert refreshed == [DRIVER] and slices.listed.is_set()
    watch = asyncio.create_task(forever(), name="stands for the watch")
    counts._drivers[DRIVER] = (slices, watch)

    counts.class_counts(DRIVER, classes("80Gi"), set())  # a spec edit: matched again after the debounce
    pending = slices._matching
    assert pending is not None and not pending.done()
    await counts.close()
    assert pending.cancelled() and watch.cancelled()
    await asyncio.sleep(0)
    assert refreshed == [DRIVER]  # no refresh after the close


async def test_forget_drops_a_pending_match_too() -> None:
    counts = DeviceCounts(None)  # type: ignore[arg-type]
    slices = DriverSlices(None, DRIVER, counts.matcher, classes=classes("64Gi"))  # type: ignore[arg-type]
    slices.list_started()
    await slices.list_done()
    watch = asyncio.create_task(forever())
    counts._drivers[DRIVER] = (slices, watch)
    slices.want(classes("80Gi"))
    pending = slices._matching
    assert pending is not None
    counts.forget(DRIVER)
    await asyncio.gather(pending, watch, return_exceptions=True)
    assert pending.cancelled() and watch.cancelled()
    await counts.close()


async def test_closing_cancels_the_child_events_being_judged() -> None:
    kube = Kube(None, "gpudra-operator")  # type: ignore[arg-type]  # never asked: nothing gets that far
    reconciler = Reconciler(kube, EventRecorder(kube))
    child_events = ChildEvents(reconciler, StatusRefresh(reconciler))
    async with reconciler.locks.lock("a"):  # a reconcile running: the child event waits for it
        child_events.on_event_soon("a", "MODIFIED", {"apiVersion": "apps/v1", "kind": "DaemonSet",
                                                     "metadata": {"name": "x", "namespace": "n"}})
        tasks = set(child_events.in_flight)
        assert len(tasks) == 1
        await asyncio.sleep(0)
        await child_events.close()
    assert all(t.cancelled() for t in tasks) and not child_events.in_flight
