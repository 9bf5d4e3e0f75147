"""`gpudra explain pod|claim <ns>/<name>`: why a claim is (not) allocated, from the live cluster.

Functional core: :mod:`.inventory` (pools, allocations, node selection), :mod:`.allocator` (the
scheduler's allocation, ported), :mod:`.verdict` (counts, rejections, the conclusion),
:mod:`.ownership` (which requests are the driver's), :mod:`.report` (text, YAML, JSON). Imperative
shell: :mod:`.gather` reads the cluster; :mod:`gpudra_operator.explain_cmd` is the command."""

from __future__ import annotations

from gpudra_operator.explain.gather import ExplainInputError, Snapshot
from gpudra_operator.explain.inventory import nodes_of
from gpudra_operator.explain.ownership import ours_only
from gpudra_operator.explain.verdict import Verdict, explain


def explain_snapshot(snapshot: Snapshot, driver: str) -> Verdict:
    """The verdict for what :func:`~gpudra_operator.explain.gather.read_snapshot` read; pure.
    :class:`ExplainInputError` when no request of the claims is the driver's."""
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
    nodes = nodes_of(snapshot.slices, snapshot.nodes)
    verdict = explain(snapshot.target, claims, pod=snapshot.pod if snapshot.nodes is not None else None,
                      classes=snapshot.classes, slices=snapshot.slices, nodes=nodes,
                      other_claims=snapshot.other_claims, namespace=snapshot.namespace, driver=driver,
                      server_minor=snapshot.server_minor)
    verdict.notes = notes + verdict.notes
    return verdict


__all__ = ["ExplainInputError", "Snapshot", "Verdict", "explain", "explain_snapshot"]
