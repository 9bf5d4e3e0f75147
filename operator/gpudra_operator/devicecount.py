"""How many devices each driver publishes (``status.devices``), kept current by a watch of that
driver's ResourceSlices rather than a LIST per reconcile.

A LIST of every slice of a driver grows with the fleet (ten 500-slice pages at 5,000 nodes, each
slice carrying all its devices); a reconcile should cost the same on any fleet. So each driver
gets one list, paginated, then a watch, both filtered on the server (``spec.driver``), and only
a number per slice is kept. Until that first list is in, the count is unknown (None) and the
reconciler keeps the count it reported before: a new active replica never reports 0 devices; once
it is in, ``on_synced(driver)`` lets status catch up (later changes wait for the next reconcile or
status refresh, as a LIST per reconcile would)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Set
from typing import Any

from gpudra_driver.kubeapi import Kube, Obj, resource_type
from gpudra_operator.classcounts import ClassCount, ClassSelectors, SliceMatches, count, slice_matches
from gpudra_operator.listwatch import ListThenWatch

SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
log = logging.getLogger("gpudra.operator")
RECLASSIFY_AFTER = 2.0  # seconds the classes must stay the same before the slices are matched again


class DriverSlices:
    """Each slice of one driver, from a list and then a watch: its devices and the classes each
    matches (:mod:`.classcounts`; ``classes``, those of the driver's GpuDraConfig)."""

    def __init__(self, kube: Kube, driver: str, page_size: int = 500,
                 on_synced: Callable[[str], Awaitable[None]] | None = None,
                 classes: tuple[ClassSelectors, ...] = ()) -> None:
        self.kube, self.driver, self.page_size = kube, driver, page_size
        self.on_synced = on_synced
        self.classes = classes
        self.slices: dict[str, SliceMatches] = {}  # slice name -> what is kept of it
        # slice name -> its devices as compact JSON: a change of the classes matches them again
        # without listing the slices (a few hundred bytes a device)
        self.raw: dict[str, bytes] = {}
        self.synced = False
        self.listed = asyncio.Event()  # set once synced, and matched against the classes asked for
        self._reclassifying: asyncio.Task[None] | None = None
        self._listing: dict[str, SliceMatches] = {}  # a list in progress
        self._listing_classes: tuple[ClassSelectors, ...] = classes
        # Counting walks every device (about 50 ms at 5,000 nodes x 8 GPUs): each status write would
        # pay it. The answer is kept until the slices, their matches or the allocations change.
        self.generation = 0  # bumped on every change of what is kept
        self._counted: tuple[Any, list[ClassCount]] | None = None

    @property
    def total(self) -> int | None:
        return sum(len(s.devices) for s in self.slices.values()) if self.synced else None

    @property
    def unhealthy(self) -> int | None:
        return sum(s.unhealthy for s in self.slices.values()) if self.synced else None

    def class_counts(self, allocated: Set[tuple[str, str, str]]) -> list[ClassCount] | None:
        """Computed again only when something it depends on changed. ``allocated`` is compared
        (ClaimWatch hands out the same object while the allocations stay the same: the identity
        makes that comparison free)."""
        if not self.listed.is_set():
            return None
        names = tuple(c.name for c in self.classes)
        key = (self.generation, names, allocated)
        if self._counted is None or self._counted[0] != key:
            self._counted = (key, count(names, self.driver, self.slices.values(), allocated))
        return self._counted[1]

    def want(self, classes: tuple[ClassSelectors, ...]) -> None:
        """Match against ``classes`` from now on; the slices kept are matched again in the
        background (counts unknown meanwhile), never listed again."""
        if classes == self.classes:
            return
        self.classes = classes
        if self.synced:
            self.listed.clear()
            if self._reclassifying is not None:
                self._reclassifying.cancel()
            self._reclassifying = asyncio.create_task(self._reclassify(RECLASSIFY_AFTER),
                                                      name=f"classes of {self.driver}")

    async def _reclassify(self, after: float = 0.0) -> None:
        # A debounce, not a synchronisation: the classes change with a spec edit, whose reconcile
        # (and the next edit's) goes first; the counts follow in a status refresh.
        await asyncio.sleep(after)
        classes = self.classes
        for i, name in enumerate(list(self.raw)):
            raw = self.raw.get(name)
            if raw is not None:
                self.slices[name] = _matches(self.driver, self.slices[name], raw, classes)
                self.generation += 1
            if i % 20 == 19:
                await asyncio.sleep(0)  # CEL on devices: let the loop (the Lease) breathe
        self.listed.set()
        if self.on_synced is not None:
            try:
                await self.on_synced(self.driver)
            except Exception as error:
                log.warning("status refresh after matching the classes of driver %s failed: %r", self.driver, error)

    def cancel(self) -> list[asyncio.Task[None]]:
        """Cancel the matching of classes in progress or pending (and the status refresh that
        would follow it); the tasks cancelled, to be awaited. The watch (:meth:`run`) is the
        caller's to stop."""
        task, self._reclassifying = self._reclassifying, None
        if task is None or task.done():
            return []
        task.cancel()
        return [task]

    def _keep(self, slices: dict[str, SliceMatches], obj: Obj, classes: tuple[ClassSelectors, ...]) -> None:
        name = obj["metadata"]["name"]
        devices = (obj.get("spec") or {}).get("devices") or []
        self.raw[name] = json.dumps(devices, separators=(",", ":")).encode()
        slices[name] = slice_matches(self.driver, obj, classes)

    async def run(self) -> None:
        await ListThenWatch(self.kube, SLICE, f"the ResourceSlices of driver {self.driver}",
                            field_selector=f"spec.driver={self.driver}", page_size=self.page_size).run(self)

    def changed(self, obj: Obj) -> None:
        self._keep(self.slices, obj, self.classes)
        self.generation += 1

    def deleted(self, obj: Obj) -> None:
        self.slices.pop(obj["metadata"]["name"], None)
        self.raw.pop(obj["metadata"]["name"], None)
        self.generation += 1

    # A list: every slice of the driver, into a fresh map that replaces the kept one at the end.
    def list_started(self) -> None:
        self._listing = {}
        self._listing_classes = self.classes  # a change while listing matches everything again at the end
        self.raw = {}

    async def list_page(self, items: list[Obj]) -> None:
        for i, obj in enumerate(items):
            self._keep(self._listing, obj, self._listing_classes)
            if self.classes and i % 20 == 19:
                await asyncio.sleep(0)  # CEL on every device: let the loop (the Lease) breathe

    async def list_done(self) -> None:
        first, self.slices, self.synced = not self.synced, self._listing, True
        self.generation += 1
        self._listing = {}
        if self.classes != self._listing_classes:  # asked for other classes meanwhile
            self._reclassifying = asyncio.create_task(self._reclassify(), name=f"classes of {self.driver}")
        else:
            self.listed.set()
        if first and self.on_synced is not None:
            try:
                await self.on_synced(self.driver)
            except Exception as error:  # status catches up on the next reconcile instead
                log.warning("status refresh after counting the devices of driver %s failed: %r", self.driver, error)


class DeviceCounts:
    """One :class:`DriverSlices` per driver asked about, started on first use."""

    def __init__(self, kube: Kube, page_size: int = 500,
                 on_synced: Callable[[str], Awaitable[None]] | None = None) -> None:
        self.kube, self.page_size, self.on_synced = kube, page_size, on_synced
        self._drivers: dict[str, tuple[DriverSlices, asyncio.Task[None]]] = {}

    def devices(self, driver: str) -> int | None:
        """Devices the driver publishes now; None until its slices have been listed once."""
        return self._slices(driver).total

    def class_counts(self, driver: str, classes: tuple[ClassSelectors, ...],
                     allocated: Set[tuple[str, str, str]]) -> list[ClassCount] | None:
        """Each class's counts; None until the slices have been listed and matched against these
        classes (a change of the classes matches the kept slices again, without a list)."""
        slices = self._slices(driver, classes)
        slices.want(classes)
        return slices.class_counts(allocated)

    def unhealthy(self, driver: str) -> int | None:
        """Devices the driver publishes with a taint that keeps pods off them; None until listed."""
        return self._slices(driver).unhealthy

    def listed_once(self, driver: str) -> bool:
        """The driver's slices have been listed (whatever classes they were matched against)."""
        return driver in self._drivers and self._drivers[driver][0].synced

    async def wait_listed(self, driver: str, timeout: float) -> None:
        """Until the driver's slices have been listed (with the classes last asked for), at most
        ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self._slices(driver).listed.wait(), timeout)
        except TimeoutError:
            pass

    def _slices(self, driver: str, classes: tuple[ClassSelectors, ...] | None = None) -> DriverSlices:
        if driver not in self._drivers:
            slices = DriverSlices(self.kube, driver, self.page_size, self.on_synced, classes or ())
            self._drivers[driver] = (slices, asyncio.create_task(slices.run(), name=f"slices of {driver}"))
        return self._drivers[driver][0]

    def forget(self, driver: str) -> None:
        entry = self._drivers.pop(driver, None)
        if entry is not None:
            entry[0].cancel()
            entry[1].cancel()

    async def close(self) -> None:
        """Stop every watch, and every matching of classes still waiting out its debounce with
        the status refresh that would follow it. Nothing here may write once the operator stops,
        nor hold up its stop: kopf waits for the tasks left running (up to 5 s) before the
        Lease is released, and a pending match would keep a SIGTERM's handover waiting for
        RECLASSIFY_AFTER."""
        entries = list(self._drivers.values())
        self._drivers.clear()
        tasks = [task for slices, run in entries for task in (run, *slices.cancel())]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _matches(driver: str, kept: SliceMatches, raw: bytes, classes: tuple[ClassSelectors, ...]) -> SliceMatches:
    # the raw devices carry their taints too: the unhealthy count is recomputed alike
    return slice_matches(driver, {"spec": {"pool": {"name": kept.pool}, "nodeName": kept.node,
                                           "devices": json.loads(raw)}}, classes)
