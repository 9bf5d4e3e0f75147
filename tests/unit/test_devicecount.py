"""What the operator leaves running when it stops (devicecount.py, reconcile.py): nothing. kopf
waits up to 5 s for the tasks left after its cleanup before `gpudra operator` releases the Lease,
so a pending debounce would hold up a SIGTERM's handover, then fail on the closed client."""

from __future__ import annotations

import asyncio
from typing import Any

from gpudra_operator.classcounts import class_selectors
from gpudra_operator.devicecount import DeviceCounts, DriverSlices
from gpudra_operator.events import EventRecorder
from gpudra_operator.reconcile import Reconciler

DRIVER = "gpu.gpudra.io"


def classes(memory: str) -> tuple[Any, ...]:
    return (class_selectors({"metadata": {"name": "big"}, "spec": {"selectors": [{"cel": {
        "expression": f'device.capacity["{DRIVER}"].memory.compareTo(quantity("{memory}")) >= 0'}}]}}),)


async def test_close_drops_a_pending_match_of_changed_classes_and_its_status_refresh() -> None:
    refreshed: list[str] = []

    async def on_synced(driver: str) -> None:
        refreshed.append(driver)

    counts = DeviceCounts(None, on_synced=on_synced)  # type: ignore[arg-type]  # no request is made
    slices = DriverSlices(None, DRIVER, on_synced=on_synced, classes=classes("64Gi"))  # type: ignore[arg-type]
    slices.list_started()
    await slices.list_done()  # listed once: status refreshed
    assert refreshed == [DRIVER] and slices.listed.is_set()
    watch = asyncio.create_task(asyncio.Event().wait(), name="stands for the watch")
    counts._drivers[DRIVER] = (slices, watch)

    counts.class_counts(DRIVER, classes("80Gi"), set())  # a spec edit: matched again after the debounce
    pending = slices._reclassifying
    assert pending is not None and not pending.done()
    await counts.close()
    assert pending.cancelled() and watch.cancelled()
    await asyncio.sleep(0)
    assert refreshed == [DRIVER]  # no refresh after the close


async def test_forget_drops_a_pending_match_too() -> None:
    counts = DeviceCounts(None)  # type: ignore[arg-type]
    slices = DriverSlices(None, DRIVER, classes=classes("64Gi"))  # type: ignore[arg-type]
    slices.list_started()
    await slices.list_done()
    watch = asyncio.create_task(asyncio.Event().wait())
    counts._drivers[DRIVER] = (slices, watch)
    slices.want(classes("80Gi"))
    pending = slices._reclassifying
    assert pending is not None
    counts.forget(DRIVER)
    await asyncio.gather(pending, watch, return_exceptions=True)
    assert pending.cancelled() and watch.cancelled()


async def test_reconciler_close_cancels_the_child_events_being_judged() -> None:
    reconciler = Reconciler(None, EventRecorder(None))  # type: ignore[arg-type]
    async with reconciler.lock("a"):  # a reconcile running: the child event waits for it
        reconciler.on_child_event_soon("a", "MODIFIED", {"apiVersion": "apps/v1", "kind": "DaemonSet",
                                                          "metadata": {"name": "x", "namespace": "n"}})
        tasks = set(reconciler._child_tasks)
        assert len(tasks) == 1
        await asyncio.sleep(0)
        await reconciler.close()
    assert all(t.cancelled() for t in tasks) and not reconciler._child_tasks
