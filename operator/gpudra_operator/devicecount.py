"""How many devices each driver publishes (``status.devices``), and what each of its DeviceClasses
matches (``status.deviceClasses[]``), kept current by a watch of that driver's ResourceSlices
rather than a LIST per reconcile.

A LIST of every slice of a driver grows with the fleet (ten 500-slice pages at 5,000 nodes, each
slice carrying all its devices); a reconcile should cost the same on any fleet. So each driver
gets one list, paginated, then a watch, both filtered on the server (``spec.driver``), and only
a number and per device the classes it matches are kept. Until that first list is in, the count
is unknown (None) and the reconciler keeps the count it reported before: a new active replica
never reports 0 devices; once it is in, ``on_synced(driver)`` lets status catch up (later changes
wait for the next reconcile or status refresh, as a LIST per reconcile would).

The classes a device matches are gpudra-allocator's answers (:mod:`.classcounts`): one request per
list page, one per batch of changed slices that the memos cannot answer, none in a reconcile. The
watch never waits for the helper: a slice it cannot answer at once is kept *unmatched* (counted in
``status.devices``, matching nothing yet) and matched in the background; while any is, the class
counts are unknown, and status keeps the ones it holds. A helper that fails (not installed,
crashed, past its deadline) is a warning in the log, retried with backoff."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence, Set
from typing import Any

from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_operator.classcounts import (ClaimWatch, ClassCount, ClassSelectors, Matcher, SliceMatches, class_selectors,
                                         count, known_matches, match_slices, unmatched_slice)
from gpudra_operator.features import FeatureProbe
from gpudra_core.listwatch import ListThenWatch

SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
log = logging.getLogger("gpudra.operator")
RECLASSIFY_AFTER = 2.0  # seconds the classes must stay the same before the slices are matched again
BATCH = 100  # slices matched at a time in the background: 800 devices parsed again, not a list page's 4,000
RETRY_INITIAL, RETRY_MAX = 1.0, 60.0  # seconds before matching again after the helper failed
FIRST_LIST_WAIT = 2.0  # seconds a reconcile waits for a watch's first list before reporting without it


class DriverSlices:
    """Each slice of one driver, from a list and then a watch: its devices and the classes each
    matches (:mod:`.classcounts`; ``classes``, those of the driver's GpuDraConfig)."""

    def __init__(self, kube: Kube, driver: str, matcher: Matcher, page_size: int = 500,
                 on_synced: Callable[[str], Awaitable[None]] | None = None,
                 classes: tuple[ClassSelectors, ...] = ()) -> None:
        self.kube, self.driver, self.matcher, self.page_size = kube, driver, matcher, page_size
        self.on_synced = on_synced
        self.classes = classes
        self.slices: dict[str, SliceMatches] = {}  # slice name -> what is kept of it
        # slice name -> its devices as compact JSON: a change of the classes, or a slice the helper
        # could not answer when it came, is matched from it without listing the slices (a few
        # hundred bytes a device)
        self.raw: dict[str, bytes] = {}
        self.unmatched: set[str] = set()  # slices kept without their matches against ``classes``
        self.synced = False
        self.listed = asyncio.Event()  # set once synced, and matched against the classes asked for
        self._matching: asyncio.Task[None] | None = None  # the background matching of ``unmatched``
        self._listing: dict[str, SliceMatches] | None = None  # a list in progress
        self._listing_unmatched: set[str] = set()
        self._listing_classes: tuple[ClassSelectors, ...] = classes
        self._failures = 0  # helper failures in a row
        self._retry_at = 0.0  # monotonic time before which the helper is not asked again
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

    @property
    def unmonitored(self) -> int | None:
        return sum(s.unmonitored for s in self.slices.values()) if self.synced else None

    @property
    def shareable(self) -> int | None:
        return sum(s.shareable for s in self.slices.values()) if self.synced else None

    def class_counts(self, allocated: Set[tuple[str, str, str]]) -> list[ClassCount] | None:
        """Computed again only when something it depends on changed; None while a slice is
        unmatched. ``allocated`` is compared (ClaimWatch hands out the same object while the
        allocations stay the same: the identity makes that comparison free)."""
        if not self.listed.is_set() or self.unmatched:
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
            self.unmatched = set(self.slices)
            self.cancel()
            self._match_soon(RECLASSIFY_AFTER)

    def _match_soon(self, after: float = 0.0) -> None:
        if self._matching is None or self._matching.done():
            self._matching = asyncio.create_task(self._match_unmatched(after), name=f"classes of {self.driver}")

    async def _match_unmatched(self, after: float) -> None:
        # A debounce, not a synchronisation: the classes change with a spec edit, whose reconcile
        # (and the next edit's) goes first; the counts follow in a status refresh.
        await asyncio.sleep(after)
        while self.unmatched:
            await asyncio.sleep(max(0.0, self._retry_at - time.monotonic()))  # also lets the loop (the Lease) breathe
            if self._listing is not None:
                return  # a list in progress matches its own pages; its end calls again for what is left
            classes = self.classes
            batch = list(itertools.islice(self.unmatched, BATCH))
            names = [n for n in batch if n in self.raw and n in self.slices]
            self.unmatched.difference_update(set(batch) - set(names))  # gone meanwhile
            raws = [self.raw[n] for n in names]
            kept = await self._match([_slice(self.slices[n], raw) for n, raw in zip(names, raws)], classes)
            if kept is None or classes is not self.classes or self._listing is not None:
                continue  # failed (retried after the backoff), or asked for other classes meanwhile
            for name, raw, matches in zip(names, raws, kept):
                if self.raw.get(name) is raw:  # not changed (nor deleted) while asked
                    self.slices[name] = matches
                    self.unmatched.discard(name)
            self.generation += 1
        if self.synced and self._listing is None and not self.unmatched and not self.listed.is_set():
            self.listed.set()
            await self._refresh("matching the classes of")

    async def _match(self, slices: list[Obj], classes: tuple[ClassSelectors, ...]) -> list[SliceMatches] | None:
        """The slices matched against ``classes``; None when the helper fails (a warning: the
        class counts stay unknown, status keeps those it holds, and it is asked again after a
        backoff)."""
        try:
            kept = await match_slices(self.matcher.of(classes[0].minor if classes else None), self.driver,
                                      slices, classes)
        except Exception as error:  # noqa: BLE001 - any failure: the counts are advisory, the operator goes on
            self._failures += 1
            delay = min(RETRY_MAX, RETRY_INITIAL * 2 ** (self._failures - 1))
            self._retry_at = time.monotonic() + delay
            log.warning("matching the devices of driver %s against its DeviceClasses failed (%s); the class counts "
                        "in status stay as they were; trying again in %.0fs", self.driver, error, delay)
            return None
        if self._failures:
            log.info("matching the devices of driver %s against its DeviceClasses works again", self.driver)
            self._failures, self._retry_at = 0, 0.0
        return kept

    def cancel(self) -> list[asyncio.Task[None]]:
        """Cancel the matching in progress or pending (and the status refresh that would follow
        it); the tasks cancelled, to be awaited. The watch (:meth:`run`) is the caller's to stop."""
        task, self._matching = self._matching, None
        if task is None or task.done():
            return []
        task.cancel()
        return [task]

    async def run(self) -> None:
        await ListThenWatch(self.kube, SLICE, f"the ResourceSlices of driver {self.driver}",
                            field_selector=f"spec.driver={self.driver}", page_size=self.page_size).run(self)

    def changed(self, obj: Obj) -> None:
        """A slice from the watch: matched at once when the memos know every device (a fleet of
        the same GPUs), else kept unmatched and matched in the background."""
        name = obj["metadata"]["name"]
        self.raw[name] = _compact(obj)
        kept = known_matches(self.driver, obj, self.classes)
        if kept is None:
            self.slices[name] = unmatched_slice(self.driver, obj)
            self.unmatched.add(name)
            self._match_soon()
        else:
            self.slices[name] = kept
            self.unmatched.discard(name)
        self.generation += 1

    def deleted(self, obj: Obj) -> None:
        name = obj["metadata"]["name"]
        self.slices.pop(name, None)
        self.raw.pop(name, None)
        self.unmatched.discard(name)
        self.generation += 1

    # A list: every slice of the driver, into a fresh map that replaces the kept one at the end.
    def list_started(self) -> None:
        self._listing, self._listing_unmatched = {}, set()
        self._listing_classes = self.classes  # a change while listing matches everything again at the end
        self.raw = {}

    async def list_page(self, items: list[Obj]) -> None:
        """One helper request for the page (none when the memos know it all; none while the
        helper is backing off after a failure): what it cannot answer is kept unmatched and
        matched in the background after the list."""
        assert self._listing is not None
        classes = self._listing_classes
        for obj in items:
            self.raw[obj["metadata"]["name"]] = _compact(obj)
        kept = await self._match(items, classes) if time.monotonic() >= self._retry_at else None
        for i, obj in enumerate(items):
            name = obj["metadata"]["name"]
            matches = kept[i] if kept is not None else known_matches(self.driver, obj, classes)
            if matches is None:
                self._listing[name] = unmatched_slice(self.driver, obj)
                self._listing_unmatched.add(name)
            else:
                self._listing[name] = matches

    async def list_done(self) -> None:
        assert self._listing is not None
        first = not self.synced
        self.slices, self.synced, self._listing = self._listing, True, None
        self.unmatched = set(self.slices) if self.classes != self._listing_classes else self._listing_unmatched
        self._listing_unmatched = set()
        self.generation += 1
        if self.unmatched:  # asked for other classes meanwhile, or the helper failed: matched in the background
            self.listed.clear()
            self._match_soon()
            return
        self.listed.set()
        if first:
            await self._refresh("counting the devices of")

    async def _refresh(self, what: str) -> None:
        if self.on_synced is None:
            return
        try:
            await self.on_synced(self.driver)
        except Exception as error:  # status catches up on the next reconcile instead
            log.warning("status refresh after %s driver %s failed: %r", what, self.driver, error)


def _compact(obj: Obj) -> bytes:
    return json.dumps((obj.get("spec") or {}).get("devices") or [], separators=(",", ":")).encode()


def _slice(kept: SliceMatches, raw: bytes) -> Obj:
    """A kept slice as matching reads it again: its pool, node and devices (their taints too, so
    the unhealthy count is recomputed alike)."""
    return {"spec": {"pool": {"name": kept.pool}, "nodeName": kept.node, "devices": json.loads(raw)}}


class DeviceCounts:
    """One :class:`DriverSlices` per driver asked about, started on first use, and the one
    gpudra-allocator (:class:`~gpudra_operator.classcounts.Matcher`) they share."""

    def __init__(self, kube: Kube, page_size: int = 500,
                 on_synced: Callable[[str], Awaitable[None]] | None = None,
                 matcher: Matcher | None = None) -> None:
        self.kube, self.page_size, self.on_synced = kube, page_size, on_synced
        self.matcher = Matcher() if matcher is None else matcher
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

    def unmonitored(self, driver: str) -> int | None:
        """Devices the driver publishes as unmonitored (no NVML events); None until listed."""
        return self._slices(driver).unmonitored

    def shareable(self, driver: str) -> int | None:
        """Devices the driver publishes for several claims at once; None until listed."""
        return self._slices(driver).shareable

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
            slices = DriverSlices(self.kube, driver, self.matcher, self.page_size, self.on_synced, classes or ())
            self._drivers[driver] = (slices, asyncio.create_task(slices.run(), name=f"slices of {driver}"))
        return self._drivers[driver][0]

    def forget(self, driver: str) -> None:
        entry = self._drivers.pop(driver, None)
        if entry is not None:
            entry[0].cancel()
            entry[1].cancel()

    async def close(self) -> None:
        """Stop every watch, and every matching of classes still waiting out its debounce with
        the status refresh that would follow it, then the helper. Nothing here may write once the
        operator stops, nor hold up its stop: kopf waits for the tasks left running (up to 5 s)
        before the Lease is released, and a pending match would keep a SIGTERM's handover waiting
        for RECLASSIFY_AFTER."""
        entries = list(self._drivers.values())
        self._drivers.clear()
        tasks = [task for slices, run in entries for task in (run, *slices.cancel())]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.matcher.close()


class StatusCounts:
    """The counts a config's status reports (``devices``, ``unhealthyDevices``, each class's in
    ``deviceClasses[]``), from the operator's slice and claim watches. Without the watches (a
    reconcile run in-process), and until they know, the counts status already holds stand."""

    def __init__(self, device_counts: DeviceCounts | None, claims: ClaimWatch | None, features: FeatureProbe) -> None:
        self.device_counts = device_counts
        self.claims = claims  # the allocated devices, from one watch of all claims
        self.features = features  # the cluster's release, whose DRA CEL matches the classes

    async def classes(self, driver: str, device_classes: Sequence[Obj]) -> list[ClassCount] | None:
        """Each class's counts, from the slice and claim watches; None until both have listed once,
        and while a change of the classes is being matched. A first use waits for the first list a
        moment (one status write with the counts rather than two); past that, status keeps the
        counts it holds until they are in (a spec change converges without waiting)."""
        if self.device_counts is None or self.claims is None:
            return None
        minor = await self.features.server_minor()
        classes = tuple(class_selectors(c, minor) for c in device_classes)
        allocated = self.claims.devices()  # built from every allocated claim: once per read
        first = not self.device_counts.listed_once(driver) or allocated is None
        counts = self.device_counts.class_counts(driver, classes, allocated or set())
        if first:  # not when classes changed: their counts follow with the status refresh that ends it
            await asyncio.gather(self.device_counts.wait_listed(driver, FIRST_LIST_WAIT),
                                 self.claims.wait_listed(FIRST_LIST_WAIT))
            allocated = self.claims.devices()
            counts = self.device_counts.class_counts(driver, classes, allocated or set())
        return None if allocated is None else counts

    def devices(self, driver: str, old_status: Mapping[str, Any]) -> int:
        """Devices the driver publishes, from the watch of its slices; until that has listed them
        once (a replica that just became active), the count status already holds."""
        known = self.device_counts.devices(driver) if self.device_counts is not None else None
        return int(old_status.get("devices") or 0) if known is None else known

    def unhealthy(self, driver: str, old_status: Mapping[str, Any]) -> int:
        """Devices published with a taint that keeps pods off them (device health), as :meth:`devices`."""
        known = self.device_counts.unhealthy(driver) if self.device_counts is not None else None
        return int(old_status.get("unhealthyDevices") or 0) if known is None else known

    def unmonitored(self, driver: str, old_status: Mapping[str, Any]) -> int:
        """Devices published as unmonitored (no NVML events; docs/health.md), as :meth:`devices`."""
        known = self.device_counts.unmonitored(driver) if self.device_counts is not None else None
        return int(old_status.get("unmonitoredDevices") or 0) if known is None else known

    def shareable(self, driver: str, old_status: Mapping[str, Any]) -> int:
        """Devices published for several claims at once (consumable capacity), as :meth:`devices`."""
        known = self.device_counts.shareable(driver) if self.device_counts is not None else None
        return int(old_status.get("shareableDevices") or 0) if known is None else known
