"""`gpudra explain pod|claim <ns>/<name>`: why a claim is (not) allocated, from the live cluster.

The verdict is Kubernetes' own: gpudra-allocator (:mod:`gpudra_operator.allocatorhelper`) runs the
DRA allocator and CEL of the cluster's release (k8s.io/dynamic-resource-allocation). Python gathers
the objects and explains the answer.

Functional core: :mod:`.inventory` (pools, what claims hold, node selection), :mod:`.claims` (a
claim's requests), :mod:`.room` (capacity and counters left), :mod:`.verdict` (what to ask, then
counts, rejections, the conclusion), :mod:`.ownership` (which requests are the driver's),
:mod:`.report` (text, YAML, JSON). Imperative shell: :mod:`.gather` reads the cluster,
:func:`explain_snapshot` asks the allocator, :mod:`gpudra_operator.explain_cmd` is the command."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from gpudra_driver.kubeapi import Kube
from gpudra_operator.allocatorhelper import AllocatorHelper, Compiled, Outcome
from gpudra_operator.explain.claims import claim_label, claim_requests
from gpudra_operator.explain.gather import ExplainInputError, Snapshot, read_snapshot, server_minor
from gpudra_operator.deviceclasses.celrefs import device_projection, selector_references
from gpudra_operator.explain.inventory import Device, DeviceID, Obj, nodes_of
from gpudra_operator.explain.ownership import ours_only
from gpudra_operator.explain.verdict import Answers, Verdict, explain, scene

MATCH_BATCH = 2000  # devices per match request: a few MB of JSON each


async def explain_live(kube: Kube, kind: str, namespace: str, name: str, driver: str, *,
                       feature_gates: Mapping[str, bool] | None = None) -> Verdict:
    """`gpudra explain pod|claim`: read the pod's or claim's snapshot from the cluster and explain it
    with the allocator of the cluster's release, started with ``feature_gates`` over that release's
    defaults (those the cluster's kube-scheduler runs with)."""
    async with AllocatorHelper(await server_minor(kube), feature_gates=feature_gates) as helper:
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
    claims = []
    notes = list(snapshot.notes)
    for claim in snapshot.claims:
        trimmed, dropped = ours_only(claim, snapshot.classes, driver)
        notes += dropped
        if (trimmed.get("spec") or {}).get("devices", {}).get("requests"):
            claims.append(trimmed)
    if not claims:
        raise ExplainInputError(f"{snapshot.target}: no request is for {driver}'s devices ("
                                + "; ".join(notes) + "); gpudra explains only its own driver's")
    features = await helper.features()
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
    nodes = []
    if asked.pending and asked.candidates:
        nodes = await helper.allocate(classes=[dict(c) for c in snapshot.classes.values()],
                                      slices=[dict(s) for s in asked.slices],
                                      allocated_claims=[dict(c) for c in asked.holders],
                                      claims=[dict(c) for c in asked.pending], nodes=[dict(n) for n in asked.candidates],
                                      device_taint_rules=[dict(r) for r in asked.taint_rules])
    verdict = explain(asked, Answers(release=str(features.get("release")), nodes=nodes, selectors=outcomes,
                                     feature_gates=helper.feature_gates, note=helper.note))
    verdict.notes = notes + verdict.notes
    return verdict


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


__all__ = ["Answers", "ExplainInputError", "Snapshot", "Verdict", "explain", "explain_live", "explain_snapshot", "scene"]
