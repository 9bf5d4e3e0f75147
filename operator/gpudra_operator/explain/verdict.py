"""Why a claim (or a pod's claims) can or cannot be allocated: a pure function of API objects.

:func:`explain` runs the scheduler's allocation (:mod:`.allocator`) on every node the pod may use,
which decides the verdict, then counts, per request and node, how many published devices pass the
class selectors, then the request's, how many of those carry taints the request does not tolerate
or are held by other claims, and what is left against what the request needs. Those counts, the
first selector that rejects a sample device (with the device's actual values) and one line of
conclusion say why."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from gpudra_driver.quantity import parse_quantity
from gpudra_operator.cel import semverlib
from gpudra_operator.cel.releases import release_of
from gpudra_operator.deviceclasses.celrefs import CelSyntaxError, all_model_references
from gpudra_operator.explain.allocator import (
    AllocationError,
    NodeAllocator,
    Request,
    SelectorMemo,
    claim_label,
    claim_requests,
    untolerated_taints,
)
from gpudra_operator.explain.inventory import (
    Device,
    DeviceID,
    Obj,
    SliceIndex,
    allocated_devices,
    gather_pools,
    node_selector_matches,
    pod_fits_node,
)

ADMIN_ACCESS_LABEL = "resource.kubernetes.io/admin-access"


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
    in_use: int = 0
    free: int = 0
    needed: int = 0
    errors: int = 0
    holders: dict[str, int] = field(default_factory=dict)  # claim -> devices it holds among the matches


@dataclass
class RequestReport:
    name: str
    class_name: str
    class_exists: bool
    mode: str  # "ExactCount" or "All"
    count: int
    admin_access: bool
    nodes: list[NodeCounts] = field(default_factory=list)
    rejection: Rejection | None = None
    largest: str | None = None  # the best value among class-matching devices, for the rejecting selector


@dataclass
class ClaimReport:
    name: str
    allocated: list[str] | None  # "driver/pool/device" when already allocated
    allocated_node: str | None
    requests: list[RequestReport] = field(default_factory=list)
    constraints: list[str] = field(default_factory=list)


@dataclass
class Verdict:
    target: str  # "pod ns/name" or "claim ns/name"
    satisfiable: bool
    nodes: list[str]  # where the pending claims can be allocated
    error: str | None  # the allocator's error: the scheduler fails the pod on every node
    conclusion: str
    claims: list[ClaimReport]
    notes: list[str] = field(default_factory=list)
    # The error is this evaluator's limit (a run past the CEL cost limit or cel-cpp's loop budget):
    # whether the scheduler allocates is not known.
    undetermined: bool = False


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


def _order_key(where: str, entry: Obj) -> Any:
    if where == "capacity":
        return (0, parse_quantity(str(entry.get("value"))))
    if entry.get("int") is not None:
        return (0, Decimal(entry["int"]))
    if entry.get("version") is not None:
        v = semverlib.parse(entry["version"])
        return (1, (v.major, v.minor, v.patch))
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
            return f"{best[1]} on {best[2].pool}/{best[2].name}"
    return None


# --- per-request counting ----------------------------------------------------------------------

def _selectors(device_class: Obj | None) -> list[str]:
    return [str((s.get("cel") or {}).get("expression", ""))
            for s in ((device_class or {}).get("spec") or {}).get("selectors") or []]


def _first_failure(memo: SelectorMemo, device: Device,
                   selectors: Sequence[tuple[str, str]]) -> tuple[str, str, str | None] | None:
    """(label, expression, error) of the first selector ``device`` does not pass, or None."""
    for label, expression in selectors:
        matched, error = memo.outcome(expression, device)
        if not matched:
            return label, expression, error
    return None


def count_request(request: Request, device_class: Obj | None, node: str, devices: Sequence[Device],
                  in_use: Mapping[DeviceID, str],
                  memo: SelectorMemo) -> tuple[NodeCounts, list[tuple[str, str, Device, str | None]], list[Device]]:
    """The funnel for ``request`` on one node, every rejection met (label, expression, device,
    error), and the class-matching devices."""
    counts = NodeCounts(node=node, published=len(devices))
    class_name = ((device_class or {}).get("metadata") or {}).get("name", request.class_name)
    class_selectors = [(f"class {class_name} #{i}", e) for i, e in enumerate(_selectors(device_class))]
    request_selectors = [(f"request {request.result_name} #{i}", e) for i, e in enumerate(request.selectors)]
    rejections: list[tuple[str, str, Device, str | None]] = []
    class_matching: list[Device] = []
    for device in devices:
        failure = _first_failure(memo, device, class_selectors) if device_class is not None else ("class", "", None)
        if failure is None:
            counts.class_match += 1
            class_matching.append(device)
            failure = _first_failure(memo, device, request_selectors)
        if failure is not None:
            label, expression, error = failure
            counts.errors += error is not None
            if expression:
                rejections.append((label, expression, device, error))
            continue
        counts.request_match += 1
        if untolerated_taints(device, request):
            counts.untolerated += 1
        elif device.id in in_use and not request.admin_access:
            counts.in_use += 1
            holder = in_use[device.id]
            counts.holders[holder] = counts.holders.get(holder, 0) + 1
        else:
            counts.free += 1
    counts.needed = counts.request_match if request.all_devices else request.count
    return counts, rejections, class_matching


# --- the verdict -------------------------------------------------------------------------------

def _allocation(claim: Obj) -> Obj | None:
    return (claim.get("status") or {}).get("allocation")


def _allocated_node(allocation: Obj, nodes: Sequence[Obj]) -> str | None:
    selector = allocation.get("nodeSelector")
    if selector is None:
        return None
    fitting = [n["metadata"]["name"] for n in nodes if node_selector_matches(selector, n)]
    return fitting[0] if len(fitting) == 1 else None


def explain(target: str, claims: Sequence[Obj], *, pod: Obj | None, classes: Mapping[str, Obj],
            slices: Sequence[Obj], nodes: Sequence[Obj], other_claims: Sequence[Obj],
            namespace: Obj | None, driver: str, server_minor: int | None = None) -> Verdict:
    """The verdict for ``claims`` (one claim, or a pod's claims in order) against the cluster.

    ``slices``: the ResourceSlices to consider (the driver's); ``nodes``: the cluster's Nodes;
    ``other_claims``: every readable claim (their allocations hold devices); ``namespace``: the
    claims' Namespace, or None when it could not be read; ``server_minor``: the cluster's
    Kubernetes minor version (None: 1.35's scheduler is assumed)."""
    pending = [c for c in claims if _allocation(c) is None]
    allocated = [c for c in claims if _allocation(c) is not None]
    uids = {(c.get("metadata") or {}).get("uid") for c in claims}
    in_use = allocated_devices([c for c in other_claims if (c.get("metadata") or {}).get("uid") not in uids])
    notes: list[str] = []

    # Nodes the pod may use: its own node selection, and the nodes its allocated claims are on.
    candidates = [n for n in nodes if pod_fits_node(pod, n)
                  and all((_allocation(c) or {}).get("nodeSelector") is None
                          or node_selector_matches(_allocation(c)["nodeSelector"], n) for c in allocated)]  # type: ignore[index]
    index = SliceIndex(slices)
    pools_by_node = {n["metadata"]["name"]: gather_pools(index, n) for n in nodes}
    memo = SelectorMemo(release_of(server_minor))
    quirk = server_minor is None or server_minor <= 35

    # The scheduler's answer, node by node; one error fails the whole attempt.
    fitting: list[str] = []
    error: str | None = None
    undetermined = False
    if pending:
        for node in candidates:
            name = node["metadata"]["name"]
            try:
                if NodeAllocator(pending, classes, pools_by_node[name], in_use, memo,
                                 all_subrequest_quirk=quirk).allocate() is not None:
                    fitting.append(name)
            except AllocationError as failure:
                if error is None:
                    error, undetermined = f"on node {name}: {failure}", failure.undetermined
    else:
        fitting = sorted({n for c in allocated if (n := _allocated_node(_allocation(c) or {}, nodes))})
    # Nothing left to allocate: allocated it is (devices without a node selector fit any node).
    satisfiable = not pending or (error is None and bool(fitting))

    reports: list[ClaimReport] = []
    for claim in claims:
        allocation = _allocation(claim)
        results = ((allocation or {}).get("devices") or {}).get("results") or []
        report = ClaimReport(
            name=claim_label(claim),
            allocated=[f"{r['driver']}/{r['pool']}/{r['device']}" for r in results] if allocation else None,
            allocated_node=_allocated_node(allocation, nodes) if allocation else None,
            constraints=[f"matchAttribute {c['matchAttribute']} over {', '.join(c.get('requests') or ['all requests'])}"
                         for c in ((claim.get("spec") or {}).get("devices") or {}).get("constraints") or []
                         if c.get("matchAttribute")])
        if allocation is None:
            for alternatives in claim_requests(claim):
                for request in alternatives:
                    report.requests.append(_request_report(request, classes, candidates, pools_by_node, in_use, memo))
        reports.append(report)

    if namespace is not None:
        labels = (namespace.get("metadata") or {}).get("labels") or {}
        wants_admin = [r.name for c in reports for r in c.requests if r.admin_access]
        if wants_admin and labels.get(ADMIN_ACCESS_LABEL) != "true":
            notes.append(f"request(s) {', '.join(wants_admin)} ask for adminAccess, but namespace "
                         f"{namespace['metadata']['name']} lacks the label {ADMIN_ACCESS_LABEL}=true")
    if pod is not None and len(candidates) < len(nodes):
        notes.append(f"the pod's node selection leaves {len(candidates)} of {len(nodes)} nodes")

    verdict = Verdict(target=target, satisfiable=satisfiable, nodes=fitting, error=error, conclusion="",
                      claims=reports, notes=notes, undetermined=undetermined)
    verdict.conclusion = conclude(verdict, driver, candidates=len(candidates))
    return verdict


def _request_report(request: Request, classes: Mapping[str, Obj], candidates: Sequence[Obj],
                    pools_by_node: Mapping[str, Sequence[Any]], in_use: Mapping[DeviceID, str],
                    memo: SelectorMemo) -> RequestReport:
    device_class = classes.get(request.class_name)
    report = RequestReport(name=request.result_name, class_name=request.class_name,
                           class_exists=device_class is not None,
                           mode="All" if request.all_devices else "ExactCount", count=request.count,
                           admin_access=request.admin_access)
    class_matching: list[Device] = []
    for node in candidates:
        name = node["metadata"]["name"]
        devices = [d for pool in pools_by_node[name] if not pool.incomplete and not pool.invalid for d in pool.devices()]
        counts, rejections, matching = count_request(request, device_class, name, devices, in_use, memo)
        report.nodes.append(counts)
        class_matching += matching
        if report.rejection is None and rejections:
            # Prefer a rejection by the request's own selectors (the class ones reject other kinds of devices).
            chosen = next((r for r in rejections if r[0].startswith("request")), None)
            if chosen is None and counts.class_match == 0:
                chosen = rejections[0]
            if chosen is not None:
                label, expression, device, error = chosen
                report.rejection = Rejection(label, expression, f"{device.pool}/{device.name}",
                                             referenced_values(expression, device), error)
    if report.rejection is not None:
        report.largest = largest_value(report.rejection.expression, class_matching)
    return report


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def conclude(verdict: Verdict, driver: str, *, candidates: int) -> str:
    """One line: where the claim fits, or the first reason it cannot."""
    for claim in verdict.claims:
        for request in claim.requests:
            if not request.class_exists:
                return f"request {request.name}: DeviceClass {request.class_name} does not exist"
    if verdict.undetermined:
        return f"explain cannot tell whether the scheduler allocates: {verdict.error}"
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
                    n.untolerated or n.in_use for n in request.nodes if n.request_match):
                held = Counter[str]()
                for n in request.nodes:
                    held.update(n.holders)
                holders = f"; in use by {', '.join(f'{c} ({k})' for c, k in held.most_common(3))}" if held else ""
                tainted = sum(n.untolerated for n in request.nodes)
                taints = f"; {tainted} with taints the request does not tolerate" if tainted else ""
                want = f"all {needed}" if request.mode == "All" else str(needed)
                return (f"no node can satisfy request {request.name}: it needs {want} on one node, "
                        f"at most {best.free} free on one node ({best.node}) of {request_match} matching{holders}{taints}")
    constraints = [c for claim in verdict.claims for c in claim.constraints]
    if constraints:
        return f"no node can satisfy all requests together under the constraints ({'; '.join(constraints)})"
    return "no node can satisfy all requests together (each fits alone, not all at once on one node)"


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
