"""`gpudra explain pod|claim <ns>/<name>`: why a claim is (not) allocated, from the live cluster.

The verdict is Kubernetes' own: gpudra-allocator (:mod:`gpudra_operator.allocatorhelper`) runs the
DRA allocator and CEL of the cluster's release (k8s.io/dynamic-resource-allocation). Python gathers
the objects and explains the answer.

Functional core: :mod:`.inventory` (pools, what claims hold, node selection), :mod:`.claims` (a
claim's requests), :mod:`.room` (capacity and counters left), :mod:`.countersets` (who holds a
counter set a claim is short of), :mod:`.verdict` (what to ask, then
counts, rejections, the conclusion), :mod:`.ownership` (which requests are the driver's),
:mod:`.report` (text, YAML, JSON), :mod:`.extended` (the claim the scheduler builds for extended
resources, as the helper answers it). Imperative shell: :mod:`.gather` reads the cluster,
:func:`explain_snapshot` asks the allocator, :mod:`gpudra_operator.explain_cmd` is the command."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

from gpudra_core.kubeapi import Kube
from gpudra_operator.allocatorhelper import AllocatorHelper, Compiled, ExtendedPlan, NodeOutcome, Outcome
from gpudra_operator.explain.claims import claim_label, claim_requests
from gpudra_operator.explain.extended import ExtendedClaim, extended_claim, owns_extended_claim
from gpudra_operator.explain.gather import ExplainInputError, Snapshot, read_snapshot, server_minor
from gpudra_operator.deviceclasses.celrefs import device_projection, selector_references
from gpudra_operator.explain.inventory import Device, DeviceID, Obj, nodes_of, pod_fits_node
from gpudra_operator.explain.ownership import ours_only
from gpudra_operator.explain.verdict import Answers, ExtendedReport, Verdict, explain, scene

MATCH_BATCH = 2000  # devices per match request: a few MB of JSON each


async def explain_live(kube: Kube, kind: str, namespace: str, name: str, driver: str, *,
                       feature_gates: Mapping[str, bool] | None = None, filter_timeout: float | None = None) -> Verdict:
    """`gpudra explain pod|claim`: read the pod's or claim's snapshot from the cluster and explain it
    with the allocator of the cluster's release, started with ``feature_gates`` over that release's
    defaults (those the cluster's kube-scheduler runs with)."""
    async with AllocatorHelper(await server_minor(kube), feature_gates=feature_gates,
                               filter_timeout=filter_timeout) as helper:
        await helper.features()  # a missing helper or an unknown gate is said before the cluster is read
        snapshot = await read_snapshot(kube, kind, namespace, name, driver)
        return await explain_snapshot(snapshot, driver, helper)


async def explain_snapshot(snapshot: Snapshot, driver: str, helper: AllocatorHelper) -> Verdict:
    """The verdict for what :func:`~gpudra_operator.explain.gather.read_snapshot` read, as the
    allocator ``helper`` runs (open it for ``snapshot.server_minor``, with the cluster's scheduler's
    feature gates). :class:`ExplainInputError` when no request of the claims is the driver's, or a
    selector they use does not compile; :class:`~gpudra_operator.allocatorhelper.AllocatorError`
    when the helper refuses (an unknown feature gate) or fails. Safe to call concurrently on one
    helper (it answers one request at a time)."""
    claims: list[Obj] = []
    notes = list(snapshot.notes)
    for claim in snapshot.claims:
        trimmed, dropped = ours_only(claim, snapshot.classes, driver)
        notes += dropped
        if (trimmed.get("spec") or {}).get("devices", {}).get("requests"):
            claims.append(trimmed)
    features = await helper.features()
    built: ExtendedClaim | None = None
    if snapshot.extended and snapshot.pod is not None and not owns_extended_claim(snapshot.pod, snapshot.claims):
        built, more = await _replay_extended(snapshot, driver, helper, features)
        notes += more
        if built is not None and built.claim is not None:
            claims.append(built.claim)
    if built is not None and built.claim is None and not claims:
        return _without_claims(snapshot, built, features, helper, notes)
    if not claims:
        raise ExplainInputError(f"{snapshot.target}: no request is for {driver}'s devices ("
                                + "; ".join(notes) + "); gpudra explains only its own driver's")
    selectors = list(_selectors(claims, snapshot.classes))
    expressions = list(dict.fromkeys(expression for _, expression in selectors))
    compiled, cost_limit = await helper.compile(expressions) if expressions else ([], 0)
    judged = dict(zip(expressions, compiled))
    check_selectors(selectors, judged)
    notes += costly_selectors(selectors, judged, cost_limit)

    asked = scene(snapshot.target, claims, pod=snapshot.pod if snapshot.nodes is not None else None,
                  classes=snapshot.classes, slices=snapshot.slices, nodes=nodes_of(snapshot.slices, snapshot.nodes),
                  other_claims=snapshot.other_claims, namespace=snapshot.namespace, driver=driver,
                  gates=features.get("gates") or {}, taint_rules=snapshot.taint_rules)
    outcomes: dict[tuple[str, DeviceID], Outcome] = {}
    if asked.expressions:
        # One device asked per distinct set of the values the selectors read (a fleet of one GPU
        # model is a handful), every device when a selector may read more.
        references = selector_references(asked.expressions)
        alike: dict[Any, list[Device]] = {}
        for device in asked.devices:
            key = (device.driver, device_projection(references, device.driver, device.spec)) \
                if references is not None else device.id
            alike.setdefault(key, []).append(device)
        groups = list(alike.values())
        for start in range(0, len(groups), MATCH_BATCH):
            batch = groups[start:start + MATCH_BATCH]
            _, rows = await helper.match(asked.expressions, [(g[0].driver, dict(g[0].spec)) for g in batch])
            for group, row in zip(batch, rows):
                for device in group:
                    outcomes.update(((expression, device.id), outcome)
                                    for expression, outcome in zip(asked.expressions, row))
    nodes: list[NodeOutcome] = []
    if asked.pending and asked.candidates:
        allocate = partial(helper.allocate, classes=[dict(c) for c in snapshot.classes.values()],
                           slices=[dict(s) for s in asked.slices], allocated_claims=[dict(c) for c in asked.holders],
                           device_taint_rules=[dict(r) for r in asked.taint_rules])
        if built is None:
            nodes = await allocate(claims=[dict(c) for c in asked.pending], nodes=[dict(n) for n in asked.candidates])
        else:
            nodes = await _allocate_with_extended(allocate, built, snapshot.pod or {},
                                                  [dict(c) for c in asked.pending if c is not built.claim],
                                                  [dict(n) for n in asked.candidates])
    verdict = explain(asked, Answers(release=str(features.get("release")), nodes=nodes, selectors=outcomes,
                                     feature_gates=helper.feature_gates, note=helper.note))
    verdict.notes = notes + verdict.notes
    if built is not None:
        verdict.extended = built.report(asked.candidates)
        _explain_extended(verdict, asked.candidates)
    return verdict


async def _replay_extended(snapshot: Snapshot, driver: str, helper: AllocatorHelper,
                           features: Mapping[str, Any]) -> tuple[ExtendedClaim | None, list[str]]:
    """The claim kube-scheduler builds for the pod's extended resources (KEP-5004), from the
    release's own code in the helper; None, with a note, where it builds none."""
    pod = snapshot.pod or {}
    asked = ", ".join(snapshot.extended)
    plan: ExtendedPlan | None = await helper.extended(
        pod=dict(pod), classes=[dict(c) for c in snapshot.classes.values()],
        claims=[dict(c) for c in snapshot.extended_claims],
        nodes=_pod_nodes(snapshot))  # the claim most of them get is the one explained
    if plan is None:
        gates = features.get("gates") or {}
        why = ("the scheduler's DRAExtendedResource gate is off (Kubernetes 1.35's default; --feature-gates "
               "DRAExtendedResource=true if the cluster turned it on): device plugins alone serve extended resources"
               if not gates.get("DRAExtendedResource") else
               "no DeviceClass maps them (spec.extendedResourceName, or the implicit "
               "deviceclass.resource.kubernetes.io/<class>): device plugins alone serve them")
        if not snapshot.claims:
            raise ExplainInputError(f"{snapshot.target} has no resourceClaims and asks for extended resources ({asked}); "
                                    f"{why}. kubectl describe pod shows the scheduler's message")
        return None, [f"the pod's extended resources ({asked}): {why}"]
    built = extended_claim(pod, plan, snapshot.classes, driver)
    return built, built.notes


def _pod_nodes(snapshot: Snapshot) -> list[dict[str, Any]]:
    """The nodes the pod's own node selection leaves (all of them when Nodes are not readable)."""
    return [dict(n) for n in nodes_of(snapshot.slices, snapshot.nodes)
            if snapshot.nodes is None or pod_fits_node(snapshot.pod, n)]


async def _allocate_with_extended(allocate: Callable[..., Awaitable[list[NodeOutcome]]], built: ExtendedClaim,
                                  pod: Obj, pending: Sequence[dict[str, Any]],
                                  candidates: Sequence[dict[str, Any]]) -> list[NodeOutcome]:
    """The allocator on each candidate as the scheduler's Filter runs it for a pod with extended
    resources: the pod's claims plus the node's variant of the built claim; a node where the pod
    cannot go at all is not asked, a node whose device plugins serve them all is DRA's only for
    the pod's own claims."""
    asked: list[dict[str, Any]] = []
    variants: list[int] = []
    decided: dict[str, NodeOutcome] = {}
    for node in candidates:
        name = node["metadata"]["name"]
        plan = built.node(name)
        if plan is not None and plan.unschedulable is not None:
            decided[name] = NodeOutcome(name, None, None)
        elif (plan is None or plan.variant is None) and not pending:
            decided[name] = NodeOutcome(name, [], None)  # DRA has nothing to allocate there
        else:
            asked.append(node)
            variants.append(-1 if plan is None or plan.variant is None else plan.variant)
    answers = iter(await allocate(claims=pending, nodes=asked, pod=dict(pod), extended_claims=built.variants,
                                  node_extended=variants) if asked else [])
    return [decided.get(n["metadata"]["name"]) or next(answers) for n in candidates]


def _without_claims(snapshot: Snapshot, built: ExtendedClaim, features: Mapping[str, Any], helper: AllocatorHelper,
                    notes: list[str]) -> Verdict:
    """A pod with extended resources alone for which no node leaves DRA anything to allocate: on
    each node it may use, device plugins serve them all or the scheduler turns the node down."""
    candidates = _pod_nodes(snapshot)
    report = built.report(candidates)
    verdict = Verdict(target=snapshot.target, satisfiable=bool(report.device_plugin_nodes),
                      nodes=list(report.device_plugin_nodes), error=None, conclusion="", claims=[], notes=notes,
                      allocator=f"Kubernetes {features.get('release')}", feature_gates=dict(helper.feature_gates),
                      extended=report)
    if helper.note:
        verdict.notes.insert(0, helper.note)
    if verdict.satisfiable:
        verdict.conclusion = (f"DRA allocates nothing for the pod: device plugins serve {', '.join(report.resources)} "
                              f"on {len(report.device_plugin_nodes)} node(s) it may use: "
                              + ", ".join(report.device_plugin_nodes))
    elif not candidates:
        verdict.conclusion = "no node can run the pod: its node selection excludes every node"
    _explain_extended(verdict, candidates)
    return verdict


def _explain_extended(verdict: Verdict, candidates: Sequence[Obj]) -> None:
    """Notes on where the extended resources are not DRA's, and the conclusion where no node can
    take the pod at all."""
    report = verdict.extended
    assert report is not None
    names = [n["metadata"]["name"] for n in candidates]
    if report.device_plugin_nodes:
        shown = ", ".join(report.device_plugin_nodes[:5]) + (" ..." if len(report.device_plugin_nodes) > 5 else "")
        verdict.notes.append(f"device plugins serve {', '.join(report.resources)} on {len(report.device_plugin_nodes)} "
                             f"node(s) ({shown}): there kube-scheduler's NodeResourcesFit decides, not DRA")
    if not verdict.satisfiable and names and all(n in report.unfit for n in names):
        verdict.conclusion = f"no node can run the pod: {report.unfit[names[0]]} (on {names[0]})"
        verdict.notes.append("the scheduler turns every node down before it allocates anything")


def _selectors(claims: Sequence[Obj], classes: Mapping[str, Obj]) -> Iterator[tuple[str, str]]:
    """(where, expression) of every selector the claims' requests and their classes use."""
    for claim in claims:
        for alternatives in claim_requests(claim):
            for request in alternatives:
                device_class = classes.get(request.class_name) or {}
                for i, selector in enumerate((device_class.get("spec") or {}).get("selectors") or []):
                    yield f"DeviceClass {request.class_name} selector #{i}", str((selector.get("cel") or {}).get("expression", ""))
                for i, expression in enumerate(request.selectors):
                    yield f"claim {claim_label(claim)} request {request.result_name} selector #{i}", expression


def costly_selectors(selectors: Sequence[tuple[str, str]], compiled: Mapping[str, Compiled], cost_limit: int) -> list[str]:
    """A note for each selector the API server estimates past the cost limit: it refuses such a
    selector today, so it was stored under older rules, and the scheduler stops any run of it that
    costs more than the limit."""
    notes = []
    for where, expression in selectors:
        judged = compiled.get(expression)
        if judged is not None and judged.error is None and judged.max_cost > cost_limit:
            notes.append(f"{where}: its estimated CEL cost ({judged.max_cost:,}) exceeds the limit of {cost_limit:,}; "
                         "the API server refuses such a selector today, and the scheduler stops a run that costs more")
    return notes


def check_selectors(selectors: Sequence[tuple[str, str]], compiled: Mapping[str, Compiled]) -> None:
    """:class:`ExplainInputError` for the first selector that does not compile: the scheduler
    fails the pod with that error too."""
    for where, expression in selectors:
        judged = compiled.get(expression)
        if judged is not None and judged.error is not None:
            first = next((line for line in judged.error.splitlines() if line.strip()), judged.error)
            raise ExplainInputError(f"{where} does not compile (the scheduler fails the pod with this error "
                                    f"too): {first}")


__all__ = ["Answers", "ExplainInputError", "ExtendedReport", "Snapshot", "Verdict", "explain", "explain_live", "explain_snapshot", "scene"]
