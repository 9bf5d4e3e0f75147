"""Per-DeviceClass device counts (``status.deviceClasses[]``): how many published devices each class
of a GpuDraConfig matches, how many of those claims hold, how many are free, and on how many nodes.

Matching is the scheduler's: every CEL selector of the class must be true for the device; a
selector that fails on a device (a missing attribute, say) does not match it, and a class whose
selector does not compile matches nothing (k8s.io/dynamic-resource-allocation/structured, the
allocator's selector check). Every answer comes from that code itself, of the cluster's release:
the ``match`` op of gpudra-allocator (:mod:`.allocatorhelper`), one request for a batch of devices
and all the classes' selectors. It is computed once per slice when the slice arrives (the watch of
:mod:`.devicecount`), and what is kept is per device only the set of classes it matches, never the
devices themselves; a change of the classes matches the kept slices again. Claims come from one
watch of all ResourceClaims (their allocation results), so a reconcile reads nothing to count.

A device counts as allocated when a claim's allocation names it without adminAccess (admin access
monitors a device, it does not hold it). A device several claims may share
(``allowMultipleAllocations``) counts as allocated once one claim holds a share of it, though it may
take more: "free" means nobody holds any of it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpudra_core.devicehealthstate import published_health
from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_operator.allocatorhelper import AllocatorHelper, Compiled, Outcome
from gpudra_operator.deviceclasses.celrefs import device_projection, selector_references
from gpudra_core.listwatch import ListThenWatch

CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")
log = logging.getLogger("gpudra.operator")

# (driver, pool, device): one published device
DeviceKey = tuple[str, str, str]
# gpudra-allocator's ``match``: each expression on each (driver, device)
Match = Callable[[Sequence[str], Sequence[tuple[str, Obj]]], Awaitable[tuple[list[Compiled], list[list[Outcome]]]]]

MAX_MEMO = 65536  # answers kept per class (distinct projections of devices)
MATCH_TIMEOUT = 30.0  # seconds one match may take in the helper (thousands of devices take under one)
IDLE_CLOSE = 60.0  # seconds without a match before the helper exits (a slice change is mostly memo-answered)
CEL_FIELDS = ("name", "attributes", "capacity", "allowMultipleAllocations")  # what a selector may read


@dataclass
class ClassSelectors:
    """One DeviceClass as matching needs it: its selectors' expressions, and the release of the
    cluster (``minor``, from /version; None: it did not say) whose DRA CEL runs them. ``error``:
    set once the helper has said that a selector does not compile (the class then matches nothing,
    as the API server would not have stored it). Equal when the selectors and release are: a
    reconcile that renders the same classes keeps the matches, the memo and the error.

    ``references``: every attribute and capacity the selectors read, as ``(where, domain, name)``,
    when that is all they can read of a device (each ``device.attributes``/``device.capacity`` is
    indexed by a literal domain and name); None otherwise. With them, the answer depends only on
    those values, so it is asked once per distinct set of values: a fleet of the same GPUs costs a
    few devices in one helper request, not every device."""

    name: str
    expressions: tuple[str, ...] = ()
    minor: int | None = None
    references: tuple[tuple[str, str, str], ...] | None = None
    error: str | None = field(default=None, compare=False)
    _memo: dict[Any, bool] = field(default_factory=dict, compare=False, repr=False)

    def known(self, key: Any) -> bool | None:
        """The answer for a device whose projection is ``key``; None when the helper must be asked."""
        if self.error is not None:
            return False
        return None if key is None else self._memo.get(key)

    def remember(self, key: Any, answer: bool) -> None:
        if key is None:
            return
        if len(self._memo) >= MAX_MEMO:
            self._memo.clear()
        self._memo[key] = answer


def class_selectors(device_class: Mapping[str, Any], minor: int | None = None) -> ClassSelectors:
    """The selectors of a DeviceClass object (as rendered or as stored), for a cluster of
    Kubernetes 1.<minor> (pure: nothing is compiled until devices are matched)."""
    name = device_class["metadata"]["name"]
    expressions = tuple(e for s in ((device_class.get("spec") or {}).get("selectors") or [])
                        if (e := ((s or {}).get("cel") or {}).get("expression")))
    return ClassSelectors(name, expressions, minor, selector_references(expressions))


@dataclass
class _Plan:
    """What the memos answer of a batch of devices, and which devices the helper must be asked."""

    answers: list[dict[str, bool]]  # per device: class name -> matches, where known
    keys: list[list[Any]]  # per device, per class: its memo key (None: not memoizable)
    asked: dict[Any, list[int]]  # devices that share every projection -> their indexes; the first is asked


def _plan(driver: str, devices: Sequence[Mapping[str, Any]], classes: Sequence[ClassSelectors]) -> _Plan:
    plan = _Plan([], [], {})
    for i, device in enumerate(devices):
        projections: dict[tuple[tuple[str, str, str], ...], Any] = {}  # classes often read the same values
        keys: list[Any] = []
        for c in classes:
            if c.references is None:
                keys.append(None)
                continue
            key = projections.get(c.references)
            if key is None:
                key = projections[c.references] = device_projection(c.references, driver, device)
            keys.append(key)
        known: dict[str, bool] = {}
        missing = False
        for c, key in zip(classes, keys):
            answer = c.known(key)
            if answer is None:
                missing = True
            else:
                known[c.name] = answer
        plan.answers.append(known)
        plan.keys.append(keys)
        if missing:
            plan.asked.setdefault(tuple(keys) if None not in keys else ("device", i), []).append(i)
    return plan


def _cel_view(device: Mapping[str, Any]) -> Obj:
    """The part of a ResourceSlice device a selector can read (the rest need not travel)."""
    return {k: device[k] for k in CEL_FIELDS if k in device}


async def match_devices(match: Match, driver: str, devices: Sequence[Mapping[str, Any]],
                        classes: Sequence[ClassSelectors]) -> list[frozenset[str]]:
    """The names of the classes each device matches: what the memos know, the rest from one helper
    request, of one device per distinct projection against every class's selectors. A helper that
    fails raises (:class:`~gpudra_operator.allocatorhelper.AllocatorError` and the like)."""
    plan = _plan(driver, devices, classes)
    if plan.asked:
        live = [c for c in classes if c.error is None]
        expressions = list(dict.fromkeys(e for c in live for e in c.expressions))
        index = {e: i for i, e in enumerate(expressions)}
        groups = list(plan.asked.values())
        compiled, rows = await match(expressions, [(driver, _cel_view(devices[g[0]])) for g in groups])
        if len(compiled) != len(expressions) or len(rows) != len(groups):
            raise RuntimeError(f"gpudra-allocator answered {len(rows)} device(s) of {len(groups)}, "
                               f"{len(compiled)} expression(s) of {len(expressions)}")
        for c in live:  # a compile error is the release's verdict on the class: kept with it
            c.error = next((compiled[index[e]].error for e in c.expressions if compiled[index[e]].error), None)
        for group, row in zip(groups, rows):
            for c, key in zip(classes, plan.keys[group[0]]):
                answer = c.error is None and all(row[index[e]].matches for e in c.expressions)
                c.remember(key, answer)
                for i in group:
                    plan.answers[i][c.name] = answer
    return [frozenset(name for name, yes in answers.items() if yes) for answers in plan.answers]


@dataclass(frozen=True)
class SliceMatches:
    """What is kept of one ResourceSlice: its pool and node, per device the classes it matches, and
    how many of its devices the agent reports unhealthy."""

    pool: str
    node: str
    devices: Mapping[str, frozenset[str]]
    # devices unhealthy: published with a taint of the driver's own that keeps pods off them
    # (:func:`gpudra_core.devicehealthstate.published_health`; docs/health.md)
    tainted: frozenset[str] = frozenset()
    unmonitored: int = 0  # devices published as unmonitored (no NVML events)
    shareable: int = 0  # devices several claims may hold at once (allowMultipleAllocations)

    @property
    def unhealthy(self) -> int:
        return len(self.tainted)




def _devices(slice_: Obj) -> list[Mapping[str, Any]]:
    return [d for d in (slice_.get("spec") or {}).get("devices") or [] if d.get("name")]


def _kept(driver: str, slice_: Obj, devices: list[Mapping[str, Any]], matches: Iterable[frozenset[str]]) -> SliceMatches:
    spec = slice_.get("spec") or {}
    health = [published_health(d, driver) for d in devices]
    return SliceMatches(
        pool=((spec.get("pool") or {}).get("name")) or "", node=spec.get("nodeName") or "",
        devices={d["name"]: m for d, m in zip(devices, matches)},
        tainted=frozenset(d["name"] for d, h in zip(devices, health) if h == "unhealthy"),
        unmonitored=health.count("unmonitored"),
        shareable=sum(d.get("allowMultipleAllocations") is True for d in devices))


def unmatched_slice(driver: str, slice_: Obj) -> SliceMatches:
    """A slice kept before its devices are matched: counted in the driver's devices (and unhealthy
    ones), matching no class yet."""
    devices = _devices(slice_)
    return _kept(driver, slice_, devices, [frozenset()] * len(devices))


def known_matches(driver: str, slice_: Obj, classes: Sequence[ClassSelectors]) -> SliceMatches | None:
    """The slice as the memos alone answer it; None when the helper must be asked (pure)."""
    devices = _devices(slice_)
    plan = _plan(driver, devices, classes)
    if plan.asked:
        return None
    return _kept(driver, slice_, devices, [frozenset(n for n, yes in a.items() if yes) for a in plan.answers])


async def match_slices(match: Match, driver: str, slices: Sequence[Obj],
                       classes: Sequence[ClassSelectors]) -> list[SliceMatches]:
    """What is kept of each slice, every device of them matched in one helper request at most."""
    devices = [_devices(s) for s in slices]
    matches = iter(await match_devices(match, driver, [d for ds in devices for d in ds], classes))
    return [_kept(driver, s, ds, [next(matches) for _ in ds]) for s, ds in zip(slices, devices)]


class Matcher:
    """The gpudra-allocator that answers the class counts: one process, of the release the classes
    name (:attr:`ClassSelectors.minor`), started on first use (and again after a crash: the client
    restarts it); a release change (a cluster upgrade) replaces it; idle for :data:`IDLE_CLOSE`
    seconds, it exits until the next match. Every request has a deadline (``timeout``, the client
    kills a helper that misses it); a cancelled request kills it too (the client's rule)."""

    def __init__(self, timeout: float = MATCH_TIMEOUT, where: Path | None = None) -> None:
        self.timeout, self.where = timeout, where
        self._helper: AllocatorHelper | None = None
        self._minor: int | None = None
        self._swap = asyncio.Lock()

    def of(self, minor: int | None) -> Match:
        """The :data:`Match` of the release 1.<minor>."""
        return functools.partial(self.match, minor)

    async def _helper_of(self, minor: int | None) -> AllocatorHelper:
        async with self._swap:
            if self._helper is None or self._minor != minor:
                old, self._helper = self._helper, None
                if old is not None:
                    await old.close()
                self._helper, self._minor = AllocatorHelper(
                    minor, timeout=self.timeout, where=self.where, idle_close=IDLE_CLOSE), minor
                if self._helper.note:
                    log.warning("DeviceClass counts: %s", self._helper.note)
            return self._helper

    async def match(self, minor: int | None, expressions: Sequence[str],
                    devices: Sequence[tuple[str, Obj]]) -> tuple[list[Compiled], list[list[Outcome]]]:
        helper = await self._helper_of(minor)
        return await helper.match(expressions, devices)

    async def close(self) -> None:
        async with self._swap:
            helper, self._helper = self._helper, None
        if helper is not None:
            await helper.close()


@dataclass(frozen=True)
class ClassCount:
    name: str
    devices: int  # published devices the class matches
    allocated: int  # of those, held by a claim
    free: int  # neither held by a claim nor kept off by a health taint
    nodes_with_free: int

    def to_status(self) -> dict[str, Any]:
        return {"name": self.name, "devices": self.devices, "allocated": self.allocated, "free": self.free,
                "nodesWithFree": self.nodes_with_free}


def count(class_names: Iterable[str], driver: str, slices: Iterable[SliceMatches],
          allocated: Iterable[DeviceKey]) -> list[ClassCount]:
    """Each class's counts over ``slices`` (pure)."""
    held = set(allocated)
    names = list(class_names)
    matching = dict.fromkeys(names, 0)
    taken = dict.fromkeys(names, 0)
    nodes: dict[str, set[str]] = {n: set() for n in names}
    free = dict.fromkeys(names, 0)
    for s in slices:
        for device, classes in s.devices.items():
            busy = (driver, s.pool, device) in held
            usable = not busy and device not in s.tainted
            for name in classes:
                if name in matching:
                    matching[name] += 1
                    taken[name] += busy
                    if usable:
                        free[name] += 1
                        nodes[name].add(s.node or s.pool)
    return [ClassCount(n, matching[n], taken[n], free[n], len(nodes[n])) for n in names]


def class_status(applied: Sequence[str], counts: Sequence[ClassCount] | None,
                 old_status: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``status.deviceClasses[]``: each applied class with its counts; while they are not known
    yet, with the counts status held before (none for a class new to status) (pure)."""
    if counts is not None:
        return [c.to_status() for c in counts]
    before = {e["name"]: e for e in old_status.get("deviceClasses") or [] if isinstance(e, Mapping) and "name" in e}
    return [dict(before.get(name) or {"name": name}) for name in applied]


def allocated_devices(claim: Obj) -> tuple[DeviceKey, ...]:
    """The devices a claim's allocation holds (adminAccess results hold nothing)."""
    results = ((((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results")) or []
    return tuple((r.get("driver") or "", r.get("pool") or "", r.get("device") or "")
                 for r in results if not r.get("adminAccess"))


@dataclass
class AllocatedDevices:
    """Every claim's allocated devices, from one list and then a watch of all ResourceClaims
    (:class:`~gpudra_core.listwatch.ListThenWatch` feeds it)."""

    kube: Kube
    page_size: int = 500
    claims: dict[str, tuple[DeviceKey, ...]] = field(default_factory=dict)  # claim UID -> its devices
    synced: bool = False
    listed: asyncio.Event = field(default_factory=asyncio.Event)  # set once synced
    _devices: frozenset[DeviceKey] | None = None  # devices(), until a change

    def devices(self) -> frozenset[DeviceKey] | None:
        """None until the claims have been listed once; the same object until a claim's
        allocation changes (what the slice counts key their cached answer on)."""
        if not self.synced:
            return None
        if self._devices is None:
            self._devices = frozenset(d for held in self.claims.values() for d in held)
        return self._devices

    async def run(self) -> None:
        await ListThenWatch(self.kube, CLAIM, "ResourceClaims", page_size=self.page_size).run(self)

    def list_started(self) -> None:
        self.claims = {}
        self._devices = None

    async def list_page(self, items: list[Obj]) -> None:
        for obj in items:
            self.changed(obj)

    async def list_done(self) -> None:
        self.synced = True
        self.listed.set()

    def changed(self, obj: Obj) -> None:
        uid = obj["metadata"].get("uid") or ""
        held = allocated_devices(obj)
        if held != self.claims.get(uid, ()):
            self._devices = None
        if held:
            self.claims[uid] = held
        else:
            self.claims.pop(uid, None)

    def deleted(self, obj: Obj) -> None:
        if self.claims.pop(obj["metadata"].get("uid") or "", None) is not None:
            self._devices = None


class ClaimWatch:
    """The one :class:`AllocatedDevices` of an operator, started on first use."""

    def __init__(self, kube: Kube) -> None:
        self.state = AllocatedDevices(kube)
        self._task: asyncio.Task[None] | None = None

    def devices(self) -> frozenset[DeviceKey] | None:
        if self._task is None:
            self._task = asyncio.create_task(self.state.run(), name="resourceclaims")
        return self.state.devices()

    async def wait_listed(self, timeout: float) -> None:
        self.devices()  # started
        try:
            await asyncio.wait_for(self.state.listed.wait(), timeout)
        except TimeoutError:
            pass

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
