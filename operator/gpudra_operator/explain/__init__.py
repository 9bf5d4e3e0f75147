"""`gpudra explain pod|claim <ns>/<name>`: why a claim is (not) allocated, from the live cluster.

Functional core: :mod:`.inventory` (pools, allocations, node selection), :mod:`.allocator` (the
scheduler's allocation, ported), :mod:`.verdict` (counts, rejections, the conclusion),
:mod:`.ownership` (which requests are the driver's), :mod:`.report` (text, YAML, JSON). Imperative
shell: :mod:`.gather` reads the cluster; :mod:`gpudra_operator.explain_cmd` is the command."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from gpudra_operator.cel import SelectorCompileError, compile_selector
from gpudra_operator.cel.cost import SELECTOR_MAX_COST, describe
from gpudra_operator.cel.releases import OLDEST, CelRelease, release_of
from gpudra_operator.explain.allocator import claim_label, claim_requests
from gpudra_operator.explain.gather import ExplainInputError, Snapshot
from gpudra_operator.explain.inventory import Obj, nodes_of
from gpudra_operator.explain.ownership import ours_only
from gpudra_operator.explain.verdict import Verdict, explain


def explain_snapshot(snapshot: Snapshot, driver: str) -> Verdict:
    """The verdict for what :func:`~gpudra_operator.explain.gather.read_snapshot` read; pure.
    :class:`ExplainInputError` when no request of the claims is the driver's, or a selector they
    use does not compile (or uses what gpudra's evaluator lacks)."""
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
    release = release_of(snapshot.server_minor)
    check_selectors(claims, snapshot.classes, release)
    notes += costly_selectors(claims, snapshot.classes, release)
    nodes = nodes_of(snapshot.slices, snapshot.nodes)
    verdict = explain(snapshot.target, claims, pod=snapshot.pod if snapshot.nodes is not None else None,
                      classes=snapshot.classes, slices=snapshot.slices, nodes=nodes,
                      other_claims=snapshot.other_claims, namespace=snapshot.namespace, driver=driver,
                      server_minor=snapshot.server_minor)
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


def costly_selectors(claims: Sequence[Obj], classes: Mapping[str, Obj], release: CelRelease = OLDEST) -> list[str]:
    """A note for each selector estimated past the cost limit: the API server refuses such a
    selector today, so it was stored under older rules, and the scheduler stops any run of it that
    costs more than the limit."""
    notes = []
    for where, expression in _selectors(claims, classes):
        selector = compile_selector(expression, release)
        if not selector.within_cost_limit:
            notes.append(f"{where}: its estimated CEL cost ({describe(selector.max_cost)}) exceeds the limit of "
                         f"{SELECTOR_MAX_COST:,}; the API server refuses such a selector today, and the scheduler "
                         "stops a run that costs more")
    return notes


def check_selectors(claims: Sequence[Obj], classes: Mapping[str, Obj], release: CelRelease = OLDEST) -> None:
    """:class:`ExplainInputError` for the first selector that does not compile here: one the API
    server would refuse too (the scheduler then fails the pod with that error)."""
    for where, expression in _selectors(claims, classes):
        try:
            compile_selector(expression, release)
        except SelectorCompileError as error:
            first = next((line for line in error.message.splitlines() if line.strip()), error.message)
            raise ExplainInputError(f"{where} does not compile (the scheduler fails the pod with this error "
                                    f"too): {first}") from None


__all__ = ["ExplainInputError", "Snapshot", "Verdict", "explain", "explain_snapshot"]
