"""Why a claim (or a pod's claims) can or cannot be allocated: a pure function of API objects and
of what Kubernetes' own allocator answered about them.

The verdict (where the pending claims fit, or the error that stops the scheduler) is the answer of
the allocator of the cluster's release, run by gpudra-allocator (k8s.io/dynamic-resource-allocation
structured), and so is every selector's outcome on every device; nothing here decides either. This
module explains them: it counts, per request and node, how many published devices pass the class
selectors, then the request's, how many of those carry taints the request does not tolerate, are
held whole by other claims, or lack room (a shared device's capacity, a partitionable device's
counters), and what is left against what the request needs. Those counts, the first selector that
rejects a sample device (with the device's actual values), the room left on shared devices, who
holds the counter sets a request is short of (:mod:`.countersets`) and one line of conclusion say
why.

Two steps, so that the imperative shell asks the allocator once (gpudra_operator.explain):
:func:`scene` reads what to ask from the objects, :func:`explain` turns the answers into a
:class:`Verdict`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from gpudra_core.quantity import quantity_value
from gpudra_operator.allocatorhelper import NodeOutcome, Outcome
from gpudra_operator.deviceclasses.celrefs import CelSyntaxError, all_model_references
from gpudra_operator.explain.claims import Request, allocation, claim_label, claim_requests, untolerated_taints
from gpudra_operator.explain.countersets import CounterSetUse, counter_set_use
from gpudra_operator.explain.inventory import (
    CounterSets,
    Device,
    DeviceID,
    Holdings,
    Obj,
    Pool,
    PoolID,
    SliceIndex,
    counters_left,
    gather_pools,
    holdings,
    node_selector_matches,
    pod_fits_node,
    with_taint_rules,
)
from gpudra_operator.explain.room import Room, capacity_rooms, counter_rooms

ADMIN_ACCESS_LABEL = "resource.kubernetes.io/admin-access"
MAX_ROOMS = 50  # per request in the verdict: the devices short of room first
MAX_COUNTER_SETS = 8  # counter sets a request found short, per request in the verdict
COUNTER_SETS_IN_LINE = 2  # of those, named in the conclusion
HOLDERS_IN_LINE = 4  # claims named per counter set in the conclusion
BINDING_GATES = ("DRADeviceBindingConditions", "DRAResourceClaimDeviceStatus")


@dataclass
class Rejection:
    """The first selector that turns a sample device down, and what that device has."""

    selector: str  # "class gpu.example.com #0" or "request #1"
    expression: str
    device: str
    values: dict[str, str]  # each attribute/capacity the selector reads -> the device's value
    error: str | None = None


@dataclass
class NodeCounts:
    """One request on one node."""

    node: str
    published: int = 0
    class_match: int = 0
    request_match: int = 0
    untolerated: int = 0
    in_use: int = 0  # held whole by other claims
    no_room: int = 0  # capacity or counters left short, or a feature the device needs is off
    free: int = 0
    needed: int = 0
    errors: int = 0
    holders: dict[str, int] = field(default_factory=dict)  # claim -> devices it holds whole among the matches


@dataclass
class RequestReport:
    name: str
    class_name: str
    class_exists: bool
    mode: str  # "ExactCount" or "All"
    count: int
    admin_access: bool
    capacity: dict[str, str] = field(default_factory=dict)  # what it asks of each capacity
    nodes: list[NodeCounts] = field(default_factory=list)
    rejection: Rejection | None = None
    largest: str | None = None  # the best value among class-matching devices, for the rejecting selector
    rooms: list[Room] = field(default_factory=list)  # shared capacity and counters met, short of room first
    counter_sets: list[CounterSetUse] = field(default_factory=list)  # those short of counters, nearest first
    more_counter_sets: int = 0


@dataclass
class ClaimReport:
    name: str
    allocated: list[str] | None  # "driver/pool/device" when already allocated
    allocated_node: str | None
    requests: list[RequestReport] = field(default_factory=list)
    constraints: list[str] = field(default_factory=list)


@dataclass
class ExtendedReport:
    """The claim kube-scheduler builds for the pod's extended resources that DeviceClasses map to
    DRA devices (KEP-5004), as explain replays it: it is allocated with the pod's claims."""

    claim: str  # how the report names it: "<namespace>/<pod>-extended-resources"
    resources: dict[str, int]  # resource -> amount the pod asks
    classes: dict[str, str]  # resource -> the DeviceClass that maps it
    requests: list[Obj]  # its DeviceRequests on the nodes most of the candidates share
    mappings: list[Obj]  # which container's resource each request serves (ContainerExtendedResourceRequest)
    device_plugin_nodes: list[str] = field(default_factory=list)  # device plugins serve them all there
    unfit: dict[str, str] = field(default_factory=dict)  # node -> why the pod cannot go there at all


@dataclass
class Verdict:
    target: str  # "pod ns/name" or "claim ns/name"
    satisfiable: bool
    nodes: list[str]  # where the pending claims can be allocated
    error: str | None  # the allocator's error: the scheduler fails the pod on every node
    conclusion: str
    claims: list[ClaimReport]
    notes: list[str] = field(default_factory=list)
    allocator: str = ""  # whose allocator answered: "Kubernetes 1.36.3"
    feature_gates: dict[str, bool] = field(default_factory=dict)  # set over the release's defaults
    extended: ExtendedReport | None = None  # the claim the scheduler builds for extended resources


# --- values a selector reads, for the report ---------------------------------------------------

def _attribute_text(attribute: Obj) -> str:
    for kind in ("string", "int", "bool", "version"):
        if attribute.get(kind) is not None:
            value = attribute[kind]
            return str(value).lower() if kind == "bool" else str(value)
    return "?"


def _read(device: Device, where: str, domain: str, name: str) -> tuple[str, Obj | None]:
    entries = device.spec.get(where) or {}
    entry = entries.get(f"{domain}/{name}") or (entries.get(name) if domain == device.driver else None)
    return name if domain == device.driver else f"{domain}/{name}", entry


def referenced_values(expression: str, device: Device) -> dict[str, str]:
    """Each attribute or capacity ``expression`` reads, with ``device``'s value (or "(none)")."""
    try:
        references = all_model_references(expression)
    except CelSyntaxError:
        return {}
    values: dict[str, str] = {}
    for where, domain, name in references:
        label, entry = _read(device, where, domain, name)
        if entry is None:
            values[label] = "(none)"
        else:
            values[label] = str(entry.get("value")) if where == "capacity" else _attribute_text(entry)
    return values


def _version_key(text: str) -> tuple[int, ...] | None:
    """A semantic version's order: major, minor, patch, then a release above its pre-releases."""
    core, _, _build = str(text).partition("+")
    core, dash, _pre = core.partition("-")
    parts = core.split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    return (*(int(p) for p in parts), 0 if dash else 1)


def _order_key(where: str, entry: Obj) -> Any:
    if where == "capacity":
        amount = quantity_value(entry.get("value"))
        return None if amount is None else (0, amount)
    if entry.get("int") is not None:
        return (0, Decimal(entry["int"]))
    if entry.get("version") is not None:
        version = _version_key(entry["version"])
        return None if version is None else (1, version)
    return None


def largest_value(expression: str, devices: Sequence[Device]) -> str | None:
    """"<value> on <device>" for the largest value of the first numeric attribute or capacity
    ``expression`` reads, among ``devices``."""
    try:
        references = all_model_references(expression)
    except CelSyntaxError:
        return None
    for where, domain, name in references:
        best: tuple[Any, str, Device] | None = None
        for device in devices:
            _, entry = _read(device, where, domain, name)
            if entry is None:
                continue
            key = _order_key(where, entry)
            if key is not None and (best is None or key > best[0]):
                best = (key, str(entry.get("value")) if where == "capacity" else _attribute_text(entry), device)
        if best is not None:
            return f"{best[1]} on {best[2].label}"
    return None


# --- what to ask the allocator ----------------------------------------------------------------

@dataclass
class Scene:
    """The claims and the cluster as the allocator is asked about them."""

    target: str
    driver: str
    claims: list[Obj]  # the claims to explain (trimmed to the driver's requests), in order
    pending: list[Obj]  # those not allocated yet: what the allocator allocates
    pod: Obj | None
    classes: Mapping[str, Obj]
    slices: list[Obj]  # as read: the allocator applies the taint rules itself
    taint_rules: list[Obj]  # DeviceTaintRules
    nodes: list[Obj]  # every node considered
    candidates: list[Obj]  # those the pod may use: the allocator is asked about each
    holders: list[Obj]  # allocated claims holding the driver's devices (others' and the claims' own)
    namespace: Obj | None
    gates: Mapping[str, bool]  # the scheduler's DRA feature gates in effect
    pools_by_node: dict[str, list[Pool]]  # of the candidates
    devices: list[Device]  # every device on a candidate node, once: each selector is asked on each
    expressions: list[str]  # every selector of the requests and their classes, once
    held: Holdings = field(default_factory=Holdings)
    counters: dict[PoolID, CounterSets] = field(default_factory=dict)
    newest: Mapping[PoolID, list[Obj]] = field(default_factory=dict)  # per pool, its newest generation's slices


def _class_selectors(device_class: Obj | None) -> list[str]:
    return [str((s.get("cel") or {}).get("expression", ""))
            for s in ((device_class or {}).get("spec") or {}).get("selectors") or []]


def _uid(claim: Obj) -> Any:
    return (claim.get("metadata") or {}).get("uid")


def scene(target: str, claims: Sequence[Obj], *, pod: Obj | None, classes: Mapping[str, Obj],
          slices: Sequence[Obj], nodes: Sequence[Obj], other_claims: Sequence[Obj], namespace: Obj | None,
          driver: str, gates: Mapping[str, bool], taint_rules: Sequence[Obj] = ()) -> Scene:
    """What to ask the allocator about ``claims`` (one claim, or a pod's claims in order).

    ``slices``: the driver's ResourceSlices; ``nodes``: the cluster's Nodes (sorted by name);
    ``other_claims``: every readable claim (their allocations hold devices); ``namespace``: the
    claims' Namespace, or None when it could not be read; ``gates``: the scheduler's DRA feature
    gates in effect (the helper's ``features``); ``taint_rules``: the DeviceTaintRules."""
    own = {_uid(c) for c in claims}
    allocated = [c for c in claims if allocation(c) is not None]
    holders = [c for c in [*(c for c in other_claims if _uid(c) not in own), *allocated]
               if any(r.get("driver") == driver for r in ((allocation(c) or {}).get("devices") or {}).get("results") or [])]
    # Nodes the pod may use: its own node selection, and the nodes its allocated claims are on.
    candidates = [n for n in nodes if pod_fits_node(pod, n)
                  and all((allocation(c) or {}).get("nodeSelector") is None
                          or node_selector_matches((allocation(c) or {})["nodeSelector"], n) for c in allocated)]
    # The devices as the scheduler sees them, for the counts: with the rules' taints where it heeds them.
    seen = (with_taint_rules(slices, taint_rules)
            if taint_rules and gates.get("DRADeviceTaints") and gates.get("DRADeviceTaintRules") else slices)
    index = SliceIndex(seen)
    partitionable = bool(gates.get("DRAPartitionableDevices"))
    pools_by_node = {n["metadata"]["name"]: gather_pools(index, n, partitionable=partitionable) for n in candidates}
    devices: dict[DeviceID, Device] = {}
    for pools in pools_by_node.values():
        for pool in pools:
            if not pool.incomplete and not pool.invalid:
                for device in pool.devices():
                    devices.setdefault(device.id, device)
    expressions: dict[str, None] = {}
    for claim in claims:
        for alternatives in claim_requests(claim):
            for request in alternatives:
                for expression in [*_class_selectors(classes.get(request.class_name)), *request.selectors]:
                    expressions.setdefault(expression, None)
    held = holdings(holders, consumable=bool(gates.get("DRAConsumableCapacity")))
    return Scene(target=target, driver=driver, claims=list(claims), pending=[c for c in claims if allocation(c) is None],
                 pod=pod, classes=classes, slices=list(slices), taint_rules=list(taint_rules), nodes=list(nodes),
                 candidates=candidates,
                 holders=holders, namespace=namespace, gates=dict(gates), pools_by_node=pools_by_node,
                 devices=list(devices.values()), expressions=list(expressions), held=held,
                 counters=counters_left(index, held) if partitionable else {}, newest=index.newest)


@dataclass(frozen=True)
class Answers:
    """What Kubernetes' allocator (gpudra-allocator) answered about a :class:`Scene`."""

    release: str  # the allocator's Kubernetes release, "1.37.2"
    nodes: Sequence[NodeOutcome]  # ``allocate`` of the pending claims, per candidate node in order
    selectors: Mapping[tuple[str, DeviceID], Outcome]  # ``match``: (expression, device) -> outcome
    feature_gates: Mapping[str, bool] = field(default_factory=dict)  # set over the release's defaults
    note: str | None = None  # the helper's: the cluster's release is not the allocator's


# --- per-request counting ----------------------------------------------------------------------

def _first_failure(outcomes: Mapping[tuple[str, DeviceID], Outcome], device: Device,
                   selectors: Sequence[tuple[str, str]]) -> tuple[str, str, str | None] | None:
    """(label, expression, error) of the first selector ``device`` does not pass, or None."""
    for label, expression in selectors:
        outcome = outcomes.get((expression, device.id))
        if outcome is None:
            return label, expression, "not evaluated by the allocator"
        if outcome.error is not None or not outcome.matches:
            return label, expression, outcome.error
    return None


def _room_for(request: Request, device: Device, node: str, held: Holdings, counters: Mapping[PoolID, CounterSets],
              gates: Mapping[str, bool]) -> list[Room]:
    """The capacity and counters ``device`` offers ``request``, as the allocator weighs them
    (allocateDevice): counters unless a share of the device already charged them, then the
    capacity where the request asks some or other claims hold shares."""
    rooms: list[Room] = []
    shared = bool(gates.get("DRAConsumableCapacity")) and bool(device.spec.get("allowMultipleAllocations"))
    if gates.get("DRAPartitionableDevices") and not (shared and device.id in held.shares):
        rooms += counter_rooms(node, device, counters.get((device.driver, device.pool)))
    if gates.get("DRAConsumableCapacity") and (request.capacity or device.id in held.shares):
        rooms += capacity_rooms(node, device, request.capacity, held)
    return rooms


def _feature_off(device: Device, gates: Mapping[str, bool]) -> str | None:
    """Why the scheduler cannot allocate ``device`` at all with its gates, or None."""
    if device.spec.get("bindingConditions") and not all(gates.get(g) for g in BINDING_GATES):
        return "has binding conditions, which the scheduler allocates only with " + " and ".join(BINDING_GATES) + " on"
    if device.spec.get("consumesCounters") and not gates.get("DRAPartitionableDevices"):
        return "consumes counters, which the scheduler allocates only with DRAPartitionableDevices on"
    return None


def count_request(request: Request, device_class: Obj | None, node: str, devices: Sequence[Device],
                  outcomes: Mapping[tuple[str, DeviceID], Outcome], held: Holdings,
                  counters: Mapping[PoolID, CounterSets], gates: Mapping[str, bool]
                  ) -> tuple[NodeCounts, list[tuple[str, str, Device, str | None]], list[Device], list[Room]]:
    """The funnel for ``request`` on one node, every rejection met (label, expression, device,
    error), the class-matching devices, and the room met on shared or partitionable devices."""
    counts = NodeCounts(node=node, published=len(devices))
    class_name = ((device_class or {}).get("metadata") or {}).get("name", request.class_name)
    class_selectors = [(f"class {class_name} #{i}", e) for i, e in enumerate(_class_selectors(device_class))]
    request_selectors = [(f"request {request.result_name} #{i}", e) for i, e in enumerate(request.selectors)]
    rejections: list[tuple[str, str, Device, str | None]] = []
    class_matching: list[Device] = []
    rooms: list[Room] = []
    for device in devices:
        failure = _first_failure(outcomes, device, class_selectors) if device_class is not None else ("class", "", None)
        if failure is None:
            counts.class_match += 1
            class_matching.append(device)
            failure = _first_failure(outcomes, device, request_selectors)
        if failure is not None:
            label, expression, error = failure
            counts.errors += error is not None
            if expression:
                rejections.append((label, expression, device, error))
            continue
        counts.request_match += 1
        off = _feature_off(device, gates)
        if off is not None:
            counts.no_room += 1
            rooms.append(Room(node, device.label, "feature", "", False, reason=off))
        elif gates.get("DRADeviceTaints") and untolerated_taints(device, request):
            counts.untolerated += 1
        elif device.id in held.whole and not request.admin_access:
            counts.in_use += 1
            holder = held.whole[device.id]
            counts.holders[holder] = counts.holders.get(holder, 0) + 1
        else:
            met = _room_for(request, device, node, held, counters, gates)
            short = [r for r in met if not r.fits]
            if short:
                counts.no_room += 1
                rooms += short
            else:
                counts.free += 1
                rooms += [r for r in met if r.holders or r.kind == "counter" or request.capacity]
    counts.needed = counts.request_match if request.all_devices else request.count
    return counts, rejections, class_matching, rooms


# --- the verdict -------------------------------------------------------------------------------

def _allocated_node(result: Obj, nodes: Sequence[Obj]) -> str | None:
    selector = result.get("nodeSelector")
    if selector is None:
        return None
    fitting = [n["metadata"]["name"] for n in nodes if node_selector_matches(selector, n)]
    return fitting[0] if len(fitting) == 1 else None


def _result_text(result: Obj) -> str:
    text = f"{result['driver']}/{result['pool']}/{result['device']}"
    consumed = result.get("consumedCapacity") or {}
    if result.get("shareID") and consumed:
        text += " (a share: " + ", ".join(f"{k} {v}" for k, v in sorted(consumed.items())) + ")"
    return text


def _binding_note(outcomes: Sequence[NodeOutcome]) -> str | None:
    """Where the allocation would carry binding conditions: the scheduler then waits for them."""
    waits = []
    for outcome in outcomes:
        for result in outcome.results or []:
            for device in (result.get("devices") or {}).get("results") or []:
                if device.get("bindingConditions"):
                    waits.append(f"{outcome.name}: {device['pool']}/{device['device']} "
                                 f"({', '.join(device['bindingConditions'])})")
    if not waits:
        return None
    more = f" and {len(waits) - 3} more" if len(waits) > 3 else ""
    return ("the allocation waits for its devices' binding conditions before the pod is bound (the scheduler "
            f"waits in PreBind, and tries again if one fails or time runs out): {'; '.join(waits[:3])}{more}")


def explain(scene: Scene, answers: Answers) -> Verdict:
    """The verdict: the allocator's answers about ``scene``, with the counts that explain them."""
    fitting: list[str] = []
    error: str | None = None
    if scene.pending:
        for outcome in answers.nodes:
            if outcome.error is not None:
                error = error or f"on node {outcome.name}: {outcome.error}"
            elif outcome.results is not None:
                fitting.append(outcome.name)
    else:
        fitting = sorted({n for c in scene.claims if (n := _allocated_node(allocation(c) or {}, scene.nodes))})
    # Nothing left to allocate: allocated it is (devices without a node selector fit any node), if
    # the pod may run where its claims are (the candidates meet both its node selection and theirs).
    satisfiable = (error is None and bool(fitting)) if scene.pending else (scene.pod is None or bool(scene.candidates))

    reports: list[ClaimReport] = []
    for claim in scene.claims:
        allocated = allocation(claim)
        results = ((allocated or {}).get("devices") or {}).get("results") or []
        report = ClaimReport(
            name=claim_label(claim),
            allocated=[_result_text(r) for r in results] if allocated else None,
            allocated_node=_allocated_node(allocated, scene.nodes) if allocated else None,
            constraints=[f"matchAttribute {c['matchAttribute']} over {', '.join(c.get('requests') or ['all requests'])}"
                         for c in ((claim.get("spec") or {}).get("devices") or {}).get("constraints") or []
                         if c.get("matchAttribute")])
        if allocated is None:
            for alternatives in claim_requests(claim):
                for request in alternatives:
                    report.requests.append(_request_report(request, scene, answers.selectors))
        reports.append(report)

    notes: list[str] = []
    if answers.note:
        notes.append(answers.note)
    if scene.namespace is not None:
        labels = (scene.namespace.get("metadata") or {}).get("labels") or {}
        wants_admin = [r.name for c in reports for r in c.requests if r.admin_access]
        if wants_admin and labels.get(ADMIN_ACCESS_LABEL) != "true":
            notes.append(f"request(s) {', '.join(wants_admin)} ask for adminAccess, but namespace "
                         f"{scene.namespace['metadata']['name']} lacks the label {ADMIN_ACCESS_LABEL}=true")
    if scene.pod is not None and len(scene.candidates) < len(scene.nodes):
        notes.append(f"the pod's node selection leaves {len(scene.candidates)} of {len(scene.nodes)} nodes")
    if satisfiable and (binding := _binding_note([o for o in answers.nodes if o.name in fitting])):
        notes.append(binding)

    verdict = Verdict(target=scene.target, satisfiable=satisfiable, nodes=fitting, error=error, conclusion="",
                      claims=reports, notes=notes, allocator=f"Kubernetes {answers.release}",
                      feature_gates=dict(answers.feature_gates))
    verdict.conclusion = conclude(verdict, scene.driver, candidates=len(scene.candidates))
    return verdict


def _request_report(request: Request, scene: Scene, outcomes: Mapping[tuple[str, DeviceID], Outcome]) -> RequestReport:
    device_class = scene.classes.get(request.class_name)
    report = RequestReport(name=request.result_name, class_name=request.class_name,
                           class_exists=device_class is not None,
                           mode="All" if request.all_devices else "ExactCount", count=request.count,
                           admin_access=request.admin_access, capacity=dict(request.capacity))
    class_matching: list[Device] = []
    for node in scene.candidates:
        name = node["metadata"]["name"]
        devices = [d for pool in scene.pools_by_node[name] if not pool.incomplete and not pool.invalid
                   for d in pool.devices()]
        counts, rejections, matching, rooms = count_request(request, device_class, name, devices, outcomes,
                                                            scene.held, scene.counters, scene.gates)
        report.nodes.append(counts)
        report.rooms += rooms
        class_matching += matching
        if report.rejection is None and rejections:
            # Prefer a rejection by the request's own selectors (the class ones reject other kinds of devices).
            chosen = next((r for r in rejections if r[0].startswith("request")), None)
            if chosen is None and counts.class_match == 0:
                chosen = rejections[0]
            if chosen is not None:
                label, expression, device, error = chosen
                report.rejection = Rejection(label, expression, device.label,
                                             referenced_values(expression, device), error)
    if report.rejection is not None:
        report.largest = largest_value(report.rejection.expression, class_matching)
    free_nodes = {n.node: n.free for n in report.nodes}
    # Short of room first, on the nodes with the most free devices: the nearest misses lead.
    report.rooms.sort(key=lambda r: (r.fits, -free_nodes.get(r.node, 0)))
    report.counter_sets, report.more_counter_sets = _short_counter_sets(report.rooms, scene)
    del report.rooms[MAX_ROOMS:]
    return report


def _short_counter_sets(rooms: Sequence[Room], scene: Scene) -> tuple[list[CounterSetUse], int]:
    """The counter sets ``rooms`` (nearest first) found short, with who holds them, and how many
    more there are."""
    short: dict[tuple[str, str], list[str]] = {}  # (pool, counter set) -> its counters found short
    for room in rooms:
        if room.kind == "counter" and not room.fits and room.reason is None and room.pool is not None:
            set_name, _, counter = room.name.partition("/")
            names = short.setdefault((room.pool, set_name), [])
            if counter not in names:
                names.append(counter)
    uses = []
    for (pool, set_name), names in list(short.items())[:MAX_COUNTER_SETS]:
        counters = scene.counters.get((scene.driver, pool), {}).get(set_name, {})
        uses.append(counter_set_use(scene.driver, pool, set_name, scene.newest.get((scene.driver, pool), []),
                                    counters, scene.held, names))
    return uses, max(0, len(short) - MAX_COUNTER_SETS)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def conclude(verdict: Verdict, driver: str, *, candidates: int) -> str:
    """One line: where the claim fits, or the first reason it cannot."""
    for claim in verdict.claims:
        for request in claim.requests:
            if not request.class_exists:
                return f"request {request.name}: DeviceClass {request.class_name} does not exist"
    if verdict.error is not None:
        return f"the scheduler stops with an error {verdict.error}"
    if verdict.satisfiable:
        if all(c.allocated is not None for c in verdict.claims):
            where = ", ".join(sorted({c.allocated_node for c in verdict.claims if c.allocated_node})) or "any node"
            return f"allocated on {where}: " + "; ".join(f"{c.name}: {', '.join(c.allocated or [])}" for c in verdict.claims)
        return f"can be allocated on {_plural(len(verdict.nodes), 'node')}: {', '.join(verdict.nodes)}"
    if candidates == 0:
        return "no node can run the pod: its node selection (or its allocated claims' nodes) excludes every node"
    for claim in verdict.claims:
        for request in claim.requests:
            published = sum(n.published for n in request.nodes)
            class_match = sum(n.class_match for n in request.nodes)
            request_match = sum(n.request_match for n in request.nodes)
            if published == 0:
                return f"no node can satisfy request {request.name}: no {driver} device is published on any node the pod may use"
            if class_match == 0:
                return (f"no node can satisfy request {request.name}: none of {_plural(published, 'published device')} "
                        f"matches DeviceClass {request.class_name}{_rejected(request)}")
            if request_match == 0:
                return (f"no node can satisfy request {request.name}: {_plural(class_match, 'device')} match the class, "
                        f"0 pass {_rejected(request).removeprefix(': ')}")
            best = max(request.nodes, key=lambda n: n.free)
            needed = best.needed if request.mode == "All" else request.count
            if best.free < needed or request.mode == "All" and any(
                    n.untolerated or n.in_use or n.no_room for n in request.nodes if n.request_match):
                want = f"all {needed}" if request.mode == "All" else str(needed)
                return (f"no node can satisfy request {request.name}: it needs {want} on one node, "
                        f"at most {best.free} free on one node ({best.node}) of {request_match} matching"
                        + _unavailable(request, best.node))
    constraints = [c for claim in verdict.claims for c in claim.constraints]
    if constraints:
        return f"no node can satisfy all requests together under the constraints ({'; '.join(constraints)})"
    drawn = next((r for claim in verdict.claims for q in claim.requests for r in q.rooms if r.fits), None)
    if drawn is not None:
        shared = "counters" if drawn.kind == "counter" else "capacity"
        return (f"no node can satisfy all requests together: each fits alone, but the devices draw on the same "
                f"{shared}, which does not cover them all at once (e.g. {drawn.describe()})")
    return "no node can satisfy all requests together (each fits alone, not all at once on one node)"


def _unavailable(request: RequestReport, node: str) -> str:
    """Why matching devices are not free: who holds them, taints, the room left."""
    held = Counter[str]()
    for n in request.nodes:
        held.update(n.holders)
    text = f"; in use by {', '.join(f'{c} ({k})' for c, k in held.most_common(3))}" if held else ""
    tainted = sum(n.untolerated for n in request.nodes)
    if tainted:
        text += f"; {tainted} with taints the request does not tolerate"
    short = [r for r in request.rooms if not r.fits]
    if short:
        nearest = next((r for r in short if r.node == node), short[0])
        without = sum(n.no_room for n in request.nodes)
        text += f"; {without} without room for it, e.g. {nearest.describe()}"
        text += _counter_holders(request, nearest)
    return text


def _counter_holders(request: RequestReport, nearest: Room) -> str:
    """Who holds the counter sets the request found short, the nearest miss's first."""
    own = (nearest.pool, nearest.name.partition("/")[0])
    sets = sorted(request.counter_sets, key=lambda s: (s.pool, s.name) != own)
    text = "".join("; " + use.describe(every_counter=False, holders=HOLDERS_IN_LINE)
                   for use in sets[:COUNTER_SETS_IN_LINE])
    more = len(sets) - COUNTER_SETS_IN_LINE + request.more_counter_sets
    if more > 0:
        text += f"; {more} more counter {'set' if more == 1 else 'sets'} short of it"
    return text


def _rejected(request: RequestReport) -> str:
    rejection = request.rejection
    if rejection is None:
        return ""
    values = ", ".join(f"{k}={v}" for k, v in rejection.values.items())
    text = f": {rejection.selector} `{rejection.expression}`"
    if rejection.error:
        text += f" fails on {rejection.device} ({rejection.error})"
    elif values:
        text += f" (e.g. {rejection.device} has {values})"
    if request.largest:
        text += f" (largest: {request.largest})"
    return text
