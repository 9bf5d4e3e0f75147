"""Per-DeviceClass device counts (``status.deviceClasses[]``): how many published devices each class
of a GpuDraConfig matches, how many of those claims hold, how many are free, and on how many nodes.

Matching is the scheduler's: every CEL selector of the class must be true for the device, and a
selector that fails on a device (a missing attribute, say) does not match it
(k8s.io/dynamic-resource-allocation/structured, the allocator's selector check), evaluated by
:mod:`gpudra_operator.cel`. It is computed once per slice when the slice arrives (the watch of
:mod:`.devicecount`), and what is kept is per device only the set of classes it matches, never the
devices themselves; a change of the classes lists the driver's slices again. Claims come from one
watch of all ResourceClaims (their allocation results), so a reconcile reads nothing to count.

A device counts as allocated when a claim's allocation names it without adminAccess (admin access
monitors a device, it does not hold it). A device several claims may share
(``allowMultipleAllocations``) counts as allocated once one claim holds a share of it, though it may
take more: "free" means nobody holds any of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpudra_driver.kubeapi import Kube, Obj, resource_type
from gpudra_operator.cel.releases import OLDEST, CelRelease
from gpudra_operator.cel.selector import CompiledSelector, SelectorCompileError, compile_selector, device_input
from gpudra_operator.deviceclasses.celrefs import CelSyntaxError, all_model_references, cel_tokens
from gpudra_operator.listwatch import ListThenWatch

CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")

# (driver, pool, device): one published device
DeviceKey = tuple[str, str, str]


MAX_MEMO = 65536  # answers kept per class (distinct projections of devices)


@dataclass(frozen=True)
class ClassSelectors:
    """One DeviceClass as matching needs it: its selectors compiled; ``error`` when one does not
    compile (the class then matches nothing, as the API server would not have stored it).

    ``references``: every attribute and capacity the selectors read, as ``(where, domain, name)``,
    when that is all they can read of a device (each ``device.attributes``/``device.capacity`` is
    indexed by a literal domain and name); None otherwise. With them, the answer depends only on
    those values, so it is computed once per distinct set of values: a fleet of the same GPUs
    costs a few CEL runs, not one per device (each run is tens of microseconds)."""

    name: str
    selectors: tuple[CompiledSelector, ...] = ()
    error: str | None = None
    references: tuple[tuple[str, str, str], ...] | None = None
    _memo: dict[Any, bool] = field(default_factory=dict, compare=False, repr=False)

    def matches(self, driver: str, device: Mapping[str, Any]) -> bool:
        if self.error is not None:
            return False
        key = None if self.references is None else _projection(self.references, driver, device)
        if key is not None and key in self._memo:
            return self._memo[key]
        candidate = device_input(driver, device)
        answer = all(s.evaluate(candidate).matched for s in self.selectors)
        if key is not None:
            if len(self._memo) >= MAX_MEMO:
                self._memo.clear()
            self._memo[key] = answer
        return answer


def _projection(references: tuple[tuple[str, str, str], ...], driver: str, device: Mapping[str, Any]) -> Any:
    """The values of ``references`` in ``device`` (absent ones as None), hashable."""
    values: list[Any] = [bool(device.get("allowMultipleAllocations"))]
    for where, domain, name in references:
        entries = device.get(where) or {}
        entry = entries.get(f"{domain}/{name}")
        if entry is None and domain == driver:
            entry = entries.get(name)
        values.append(None if entry is None else tuple(sorted((k, str(v)) for k, v in entry.items())))
    return tuple(values)


def _references(expressions: list[str]) -> tuple[tuple[str, str, str], ...] | None:
    """What :class:`ClassSelectors` memoizes on, or None when a selector may read more of a device."""
    found: list[tuple[str, str, str]] = []
    for expression in expressions:
        try:
            tokens = cel_tokens(expression)
            refs = all_model_references(expression)
        except CelSyntaxError:
            return None
        uses = sum(1 for i in range(len(tokens) - 2) if tokens[i].kind == "ident" and tokens[i].text == "device"
                   and tokens[i + 1].text == "." and tokens[i + 2].text in ("attributes", "capacity"))
        if uses != len(refs):  # a map used whole, or indexed by a variable
            return None
        found += refs
    return tuple(sorted(set(found)))


def class_selectors(device_class: Mapping[str, Any], release: CelRelease = OLDEST) -> ClassSelectors:
    """The selectors of a DeviceClass object (as rendered or as stored), as ``release`` runs them."""
    name = device_class["metadata"]["name"]
    expressions = [e for s in ((device_class.get("spec") or {}).get("selectors") or [])
                   if (e := ((s or {}).get("cel") or {}).get("expression"))]
    try:
        return ClassSelectors(name, tuple(compile_selector(e, release) for e in expressions),
                              references=_references(expressions))
    except SelectorCompileError as error:
        return ClassSelectors(name, error=error.message)


@dataclass(frozen=True)
class SliceMatches:
    """What is kept of one ResourceSlice: its pool and node, per device the classes it matches, and
    how many of its devices the agent reports unhealthy."""

    pool: str
    node: str
    devices: Mapping[str, frozenset[str]]
    tainted: frozenset[str] = frozenset()  # devices unhealthy (:func:`is_unhealthy`)

    @property
    def unhealthy(self) -> int:
        return len(self.tainted)


UNHEALTHY_EFFECTS = ("NoSchedule", "NoExecute")


def is_unhealthy(driver: str, device: Mapping[str, Any]) -> bool:
    """The agent published the device with a taint of the driver's own that keeps pods off it
    (docs/health.md); informational taints (effect None) do not count."""
    return any(str(t.get("key", "")).startswith(f"{driver}/") and t.get("effect") in UNHEALTHY_EFFECTS
               for t in device.get("taints") or [])


def slice_matches(driver: str, slice_: Obj, classes: Iterable[ClassSelectors]) -> SliceMatches:
    spec = slice_.get("spec") or {}
    classes = list(classes)
    devices = [d for d in spec.get("devices") or [] if d.get("name")]
    return SliceMatches(
        pool=((spec.get("pool") or {}).get("name")) or "", node=spec.get("nodeName") or "",
        devices={d["name"]: frozenset(c.name for c in classes if c.matches(driver, d)) for d in devices},
        tainted=frozenset(d["name"] for d in devices if is_unhealthy(driver, d)))


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


def allocated_devices(claim: Obj) -> tuple[DeviceKey, ...]:
    """The devices a claim's allocation holds (adminAccess results hold nothing)."""
    results = ((((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results")) or []
    return tuple((r.get("driver") or "", r.get("pool") or "", r.get("device") or "")
                 for r in results if not r.get("adminAccess"))


@dataclass
class AllocatedDevices:
    """Every claim's allocated devices, from one list and then a watch of all ResourceClaims
    (:class:`~gpudra_operator.listwatch.ListThenWatch` feeds it)."""

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
