"""The scheduler's device allocation for one node, in Python: a port of ``Allocate``,
``allocateOne``, ``isSelectable``, ``allocateDevice`` and ``matchAttributeConstraint`` from
k8s.io/dynamic-resource-allocation/structured/internal/incubating/allocator_incubating.go (1.35),
the implementation the 1.35 scheduler picks with its default gates (DRAAdminAccess and
DRAPrioritizedList on).

Same search, same order: requests in order, a ``firstAvailable`` request tries its subrequests in
order, devices pool by pool in slice order, backtracking on a dead end; the first solution wins.
Same errors: a selector that fails to compile or run, a missing DeviceClass, ``allocationMode: All``
over an incomplete or invalid pool, or a constraint that an ``All`` request breaks stops the search
with :class:`AllocationError` (the scheduler then fails the pod's whole scheduling attempt, on every
node). Not ported (all alpha and off in 1.35): partitionable devices (counters), consumable
capacity, binding conditions, ``distinctAttribute``.

Upstream's quirk is kept, since the verdict must be the scheduler's (marked QUIRK): up to 1.35 the
``All`` branch recurses without the subrequest index (1.36 keeps it; ``all_subrequest_quirk``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpudra_operator.cel import SelectorCompileError, compile_selector, device_input
from gpudra_operator.cel.releases import OLDEST, CelRelease
from gpudra_operator.cel.selector import DeviceInput
from gpudra_operator.explain.inventory import Device, DeviceID, Obj, Pool

ALLOCATION_RESULTS_MAX_SIZE = 32  # resourceapi.AllocationResultsMaxSize


class AllocationError(Exception):
    """The allocator stopped with an error (not "no solution"). ``undetermined``: the error is this
    evaluator's limit (a run past the CEL cost limit, cel-cpp's loop budget), not the scheduler's
    answer, which is then unknown."""

    def __init__(self, message: str, *, undetermined: bool = False) -> None:
        super().__init__(message)
        self.undetermined = undetermined


class _MaxSizeExceeded(Exception):
    """incubating ``errAllocationResultMaxSizeExceeded``: more than 32 results for a claim."""


@dataclass(frozen=True)
class Request:
    """One request, or one subrequest of a ``firstAvailable`` request."""

    name: str  # the request's name
    subrequest: str | None
    class_name: str
    selectors: tuple[str, ...]
    all_devices: bool
    count: int
    admin_access: bool
    tolerations: tuple[Obj, ...]

    @property
    def result_name(self) -> str:
        """The name an allocation result carries: ``request`` or ``request/subrequest``."""
        return f"{self.name}/{self.subrequest}" if self.subrequest else self.name


def _request(name: str, sub: str | None, body: Obj) -> Request:
    return Request(
        name=name, subrequest=sub, class_name=str(body.get("deviceClassName") or ""),
        selectors=tuple(str((s.get("cel") or {}).get("expression", "")) for s in body.get("selectors") or []),
        all_devices=body.get("allocationMode") == "All", count=int(body.get("count") or 1),
        admin_access=bool(body.get("adminAccess")), tolerations=tuple(body.get("tolerations") or []))


def claim_requests(claim: Obj) -> list[list[Request]]:
    """Per request of ``claim``: ``[exactly]``, or its ``firstAvailable`` subrequests in order."""
    out: list[list[Request]] = []
    for entry in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []:
        if entry.get("firstAvailable"):
            out.append([_request(entry["name"], sub["name"], sub) for sub in entry["firstAvailable"]])
        else:
            out.append([_request(entry["name"], None, entry.get("exactly") or {})])
    return out


def claim_label(claim: Obj) -> str:
    meta = claim.get("metadata") or {}
    return f"{meta.get('namespace')}/{meta.get('name')}"


# --- selectors --------------------------------------------------------------------------------

class SelectorMemo:
    """Each selector evaluated once per device for one explain: the allocation on every node and
    the counting share the answers (selectors are pure functions of the device). ``release``: the
    cluster's, whose CEL the selectors are run with."""

    def __init__(self, release: CelRelease = OLDEST) -> None:
        self.release = release
        self._outcomes: dict[tuple[str, DeviceID], tuple[bool, str | None]] = {}
        self._inputs: dict[DeviceID, DeviceInput] = {}
        self._undetermined: set[tuple[str, DeviceID]] = set()

    def outcome(self, expression: str, device: Device) -> tuple[bool, str | None]:
        """(matches, error) of one selector on one device; a compile error is an error too."""
        key = (expression, device.id)
        if key not in self._outcomes:
            self._outcomes[key] = self._evaluate(expression, device)
        return self._outcomes[key]

    def undetermined(self, expression: str, device: Device) -> bool:
        """The outcome's error is this evaluator's limit (:attr:`SelectorResult.undetermined`)."""
        return (expression, device.id) in self._undetermined

    def _evaluate(self, expression: str, device: Device) -> tuple[bool, str | None]:
        if device.id not in self._inputs:
            self._inputs[device.id] = device_input(device.driver, device.spec)
        try:
            result = compile_selector(expression, self.release).evaluate(self._inputs[device.id])
        except SelectorCompileError as error:
            return False, f"CEL compile error: {error.message}"
        if result.undetermined:
            self._undetermined.add((expression, device.id))
            return False, f"cannot tell: {result.error}"
        return result.matched, (f"CEL runtime error: {result.error}" if result.error else None)


def selectors_match(memo: SelectorMemo, device: Device, selectors: Sequence[str], where: str) -> bool:
    """allocator_incubating.go ``selectorsMatch``: all of them, in order; an error stops allocation."""
    for index, expression in enumerate(selectors):
        matched, error = memo.outcome(expression, device)
        if error is not None:
            raise AllocationError(f"{where}: selector #{index}: {error}",
                                  undetermined=memo.undetermined(expression, device))
        if not matched:
            return False
    return True


# --- taints (k8s.io/dynamic-resource-allocation/resourceclaim ToleratesTaint) ------------------

def tolerates(toleration: Obj, taint: Obj) -> bool:
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("key") and toleration["key"] != taint.get("key"):
        return False
    operator = toleration.get("operator") or "Equal"
    if operator == "Exists":
        return True
    return operator == "Equal" and (toleration.get("value") or "") == (taint.get("value") or "")


def untolerated_taints(device: Device, request: Request) -> list[Obj]:
    """The device's NoSchedule and NoExecute taints the request does not tolerate
    (``taintPreventsAllocation``; other effects do not prevent allocation). A slice carries taints
    only where the DRADeviceTaints gate is on (the API server drops them otherwise)."""
    return [t for t in device.spec.get("taints") or [] if t.get("effect") in ("NoSchedule", "NoExecute")
            and not any(tolerates(x, t) for x in request.tolerations)]


# --- constraints ------------------------------------------------------------------------------

def lookup_attribute(device: Device, qualified: str) -> Obj | None:
    attributes = device.spec.get("attributes") or {}
    if qualified in attributes:
        return attributes[qualified]
    domain, sep, ident = qualified.partition("/")
    if not sep or domain != device.driver:
        return None
    return attributes.get(ident)


def _attribute_key(attribute: Obj) -> tuple[str, Any] | None:
    for kind in ("string", "int", "bool", "version"):
        if attribute.get(kind) is not None:
            return kind, attribute[kind]
    return None


@dataclass
class MatchAttribute:
    """allocator_stable.go ``matchAttributeConstraint``."""

    requests: frozenset[str]
    attribute: str
    value: tuple[str, Any] | None = None
    devices: int = 0

    def applies(self, request: Request) -> bool:
        if not self.requests:
            return True
        if request.subrequest is None:
            return request.name in self.requests
        return request.name in self.requests or request.result_name in self.requests

    def add(self, request: Request, device: Device) -> bool:
        if not self.applies(request):
            return True
        attribute = lookup_attribute(device, self.attribute)
        key = _attribute_key(attribute) if attribute is not None else None
        if key is None:
            return False
        if self.devices and key != self.value:
            return False
        if not self.devices:
            self.value = key
        self.devices += 1
        return True

    def remove(self, request: Request) -> None:
        if self.applies(request):
            self.devices -= 1


def claim_constraints(claim: Obj) -> list[MatchAttribute]:
    constraints = []
    for entry in ((claim.get("spec") or {}).get("devices") or {}).get("constraints") or []:
        if entry.get("matchAttribute"):
            constraints.append(MatchAttribute(frozenset(entry.get("requests") or []), entry["matchAttribute"]))
    return constraints


# --- the search -------------------------------------------------------------------------------

@dataclass
class _ClaimState:
    claim: Obj
    requests: list[list[Request]]
    constraints: list[MatchAttribute]
    result: list[tuple[str, DeviceID]] = field(default_factory=list)


class NodeAllocator:
    """Allocate ``claims`` (one pod's, in order) from ``pools`` (one node's), with ``in_use``
    held by other claims. :meth:`allocate` is the allocation per claim, None when there is none,
    or :class:`AllocationError`."""

    def __init__(self, claims: Sequence[Obj], classes: Mapping[str, Obj], pools: Sequence[Pool],
                 in_use: Mapping[DeviceID, str], memo: SelectorMemo | None = None, *,
                 all_subrequest_quirk: bool = True) -> None:
        self.memo = memo or SelectorMemo()
        self.all_subrequest_quirk = all_subrequest_quirk
        self.claims = [_ClaimState(c, claim_requests(c), claim_constraints(c)) for c in claims]
        self.classes = classes
        self.pools = pools
        self.in_use = in_use
        self.allocating: dict[DeviceID, set[int]] = {}
        self._selectable: dict[tuple[DeviceID, int, int, int], bool] = {}
        self._all: dict[tuple[int, int, int], list[Device]] = {}
        for claim_index, state in enumerate(self.claims):
            minimum = 0
            for request_index, alternatives in enumerate(state.requests):
                fewest: int | None = None
                for sub_index, request in enumerate(alternatives):
                    self._validate(state.claim, request)
                    needed = request.count
                    if request.all_devices:
                        devices = self._all_devices(claim_index, request_index, sub_index, request)
                        self._all[(claim_index, request_index, sub_index)] = devices
                        needed = len(devices)
                    fewest = needed if fewest is None else min(fewest, needed)
                minimum += fewest or 0
            if minimum > ALLOCATION_RESULTS_MAX_SIZE:
                raise AllocationError(f"claim {claim_label(state.claim)}: number of requested devices {minimum} "
                                      f"exceeds the claim limit of {ALLOCATION_RESULTS_MAX_SIZE}")
        # Allocate starts the search with a fresh match cache (allocator_incubating.go:253), so
        # what gathering the All requests' devices evaluated is evaluated again, errors included.
        self._selectable.clear()

    def _validate(self, claim: Obj, request: Request) -> None:
        for index, selector in enumerate(request.selectors):
            if not selector:
                raise AllocationError(f"claim {claim_label(claim)}, request {request.result_name}, selector "
                                      f"#{index}: CEL expression empty (unsupported selector type?)")
        if request.class_name not in self.classes:
            raise AllocationError(f"claim {claim_label(claim)}, request {request.result_name}: could not "
                                  f"retrieve device class {request.class_name}: not found")

    def _all_devices(self, ci: int, ri: int, si: int, request: Request) -> list[Device]:
        devices = []
        for pool in self.pools:
            if pool.incomplete:
                raise AllocationError(f"claim {claim_label(self.claims[ci].claim)}, request {request.result_name}: "
                                      f"asks for all devices, but resource pool {pool.driver}/{pool.name} is "
                                      "currently being updated")
            if pool.invalid:
                raise AllocationError(f"claim {claim_label(self.claims[ci].claim)}, request {request.result_name}: "
                                      f"asks for all devices, but resource pool {pool.driver}/{pool.name} is "
                                      "currently invalid")
            devices += [d for d in pool.devices() if self._is_selectable(ci, ri, si, request, d)]
        return devices

    def _is_selectable(self, ci: int, ri: int, si: int, request: Request, device: Device) -> bool:
        key = (device.id, ci, ri, si)
        if key not in self._selectable:
            device_class = self.classes[request.class_name]
            class_selectors = [str((s.get("cel") or {}).get("expression", ""))
                               for s in (device_class.get("spec") or {}).get("selectors") or []]
            class_name = (device_class.get("metadata") or {}).get("name")
            self._selectable[key] = (
                selectors_match(self.memo, device, class_selectors, f"class {class_name}")
                and selectors_match(self.memo, device, request.selectors, f"claim {claim_label(self.claims[ci].claim)}"))
        return self._selectable[key]

    def allocate(self) -> list[list[tuple[str, DeviceID]]] | None:
        try:
            done = self._one(0, 0, 0, 0, False)
        except _MaxSizeExceeded:
            raise AllocationError("allocation max size exceeded") from None
        return [state.result for state in self.claims] if done else None

    def _in_use(self, device: Device) -> bool:
        return device.id in self.in_use or device.id in self.allocating

    def _place(self, ci: int, request: Request, device: Device, must: bool) -> bool:
        """allocateDevice: availability, taints, constraints; on success the device is taken."""
        state = self.claims[ci]
        if request.admin_access and ci in self.allocating.get(device.id, set()):
            return False
        if not request.admin_access and self._in_use(device):
            return False
        if untolerated_taints(device, request):
            return False
        added: list[MatchAttribute] = []
        for constraint in state.constraints:
            if not constraint.add(request, device):
                if must:
                    raise AllocationError(
                        f"claim {claim_label(state.claim)}, request {request.result_name}: cannot add device "
                        f"{'/'.join(device.id)} because a claim constraint would not be satisfied")
                for done in added:
                    done.remove(request)
                return False
            added.append(constraint)
        self.allocating.setdefault(device.id, set()).add(ci)
        state.result.append((request.result_name, device.id))
        return True

    def _release(self, ci: int, request: Request, device: Device) -> None:
        state = self.claims[ci]
        for constraint in state.constraints:
            constraint.remove(request)
        holders = self.allocating[device.id]
        holders.discard(ci)
        if not holders:
            del self.allocating[device.id]
        state.result.pop()

    def _one(self, ci: int, ri: int, si: int, di: int, in_subrequest: bool) -> bool:
        if ci >= len(self.claims):
            return True
        state = self.claims[ci]
        if ri >= len(state.requests):
            try:
                return self._one(ci + 1, 0, 0, 0, False)
            except _MaxSizeExceeded:  # retrying this claim differently may still work
                return False
        alternatives = state.requests[ri]
        if not in_subrequest and alternatives[0].subrequest is not None:
            all_exceeded = True
            for index in range(len(alternatives)):
                try:
                    done = self._one(ci, ri, index, di, True)
                except _MaxSizeExceeded:
                    continue  # a later subrequest may need fewer devices
                all_exceeded = False
                if done:
                    return True
            if all_exceeded:
                raise _MaxSizeExceeded
            return False
        request = alternatives[si]
        if request.all_devices:
            devices = self._all[(ci, ri, si)]
            if not devices:
                return False  # "At least one device is required for 'All' allocation mode."
            needed = len(devices)
        else:
            needed = request.count
        if di >= needed:
            return self._one(ci, ri + 1, 0, 0, False)
        if len(state.result) + needed - di > ALLOCATION_RESULTS_MAX_SIZE:
            raise _MaxSizeExceeded
        if request.all_devices:
            device = devices[di]
            if not self._place(ci, request, device, True):
                return False
            # QUIRK (1.35 and before): upstream recurses with deviceIndices{claim, request, device+1}:
            # the subrequest index falls back to 0, so after the first device of an All subrequest
            # the rest is what the first subrequest still needs. 1.36 passes subRequestIndex on.
            next_si = 0 if self.all_subrequest_quirk else si
            return self._then(ci, request, device, lambda: self._one(ci, ri, next_si, di + 1, in_subrequest))
        if self._cannot_finish(ci, ri, si, request, needed - di):
            return False
        for pool in self.pools:
            if pool.incomplete or pool.invalid:
                continue
            for device in pool.devices():
                if request.admin_access and ci in self.allocating.get(device.id, set()):
                    continue
                if not request.admin_access and self._in_use(device):
                    continue
                if not self._is_selectable(ci, ri, si, request, device):
                    continue
                if not self._place(ci, request, device, False):
                    continue
                if self._then(ci, request, device, lambda: self._one(ci, ri, si, di + 1, in_subrequest)):
                    return True
        return False

    def _cannot_finish(self, ci: int, ri: int, si: int, request: Request, wanted: int) -> bool:
        """True when fewer than ``wanted`` devices could still be taken for this request: the match
        of every device not taken is known already (so the loop would evaluate nothing new and
        meet no error: errors stop the search the first time) and too few of them match.
        Upstream walks the whole subtree to find that out (every order of the free devices); the
        answer is the same, the time is not: 6 free of 8 needed on 2,000 nodes took minutes."""
        free = 0
        for pool in self.pools:
            if pool.incomplete or pool.invalid:
                continue
            for device in pool.devices():
                taken = (ci in self.allocating.get(device.id, set()) if request.admin_access
                         else self._in_use(device))
                if taken:  # skipped before its selectors, as the loop does
                    continue
                known = self._selectable.get((device.id, ci, ri, si))
                if known is None:
                    return False
                free += known
        return free < wanted

    def _then(self, ci: int, request: Request, device: Device, rest: Callable[[], bool]) -> bool:
        """The rest of the search with ``device`` placed; backtrack (release it) unless it found
        a solution, also when it stops with an exception."""
        done = False
        try:
            done = rest()
        finally:
            if not done:
                self._release(ci, request, device)
        return done
