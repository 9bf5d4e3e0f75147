"""The verdict for people (a table, then one line of conclusion) and for tools (YAML, JSON)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import yaml

from gpudra_operator.explain.verdict import Verdict

MAX_NODE_ROWS = 20  # per request; the nodes with the most free devices first
MAX_ROOM_LINES = 3  # per request: the nearest misses (-o yaml lists them all)
MAX_COUNTER_SET_LINES = 3  # per request: the counter sets short of room, nearest first
_COLUMNS = ("CLAIM", "REQUEST", "CLASS", "NODE", "PUBLISHED", "CLASS-MATCH", "REQUEST-MATCH",
            "TAINTED", "IN-USE", "NO-ROOM", "FREE", "NEEDED")


def as_data(verdict: Verdict) -> dict[str, Any]:
    return dataclasses.asdict(verdict)


def as_json(verdict: Verdict) -> str:
    return json.dumps(as_data(verdict), indent=2) + "\n"


def as_yaml(verdict: Verdict) -> str:
    return str(yaml.safe_dump(as_data(verdict), sort_keys=False))


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows]


def as_text(verdict: Verdict) -> str:
    """The table of every pending request per node, what rejected a sample device, the room left
    on shared devices, whose allocator answered, the notes, and the conclusion as the last line."""
    lines = [f"{verdict.target}:"]
    rows: list[tuple[str, ...]] = [_COLUMNS]
    details: list[str] = []
    for claim in verdict.claims:
        if claim.allocated is not None:
            details.append(f"  {claim.name}: allocated on {claim.allocated_node or '?'}: {', '.join(claim.allocated)}")
            continue
        for request in claim.requests:
            class_name = request.class_name if request.class_exists else f"{request.class_name} (missing)"
            nodes = sorted(request.nodes, key=lambda n: (-n.free, -n.request_match, n.node))
            for counts in nodes[:MAX_NODE_ROWS]:
                needed = f"all ({counts.needed})" if request.mode == "All" else str(counts.needed)
                rows.append((claim.name, request.name, class_name, counts.node, str(counts.published),
                             str(counts.class_match), str(counts.request_match), str(counts.untolerated),
                             str(counts.in_use), str(counts.no_room), str(counts.free), needed))
            if len(nodes) > MAX_NODE_ROWS:
                details.append(f"  request {request.name}: {len(nodes) - MAX_NODE_ROWS} more nodes not shown (-o yaml lists all)")
            if not request.nodes:
                rows.append((claim.name, request.name, class_name, "(no node)", "-", "-", "-", "-", "-", "-", "-", "-"))
            rejection = request.rejection
            if rejection is not None:
                values = ", ".join(f"{k}={v}" for k, v in rejection.values.items())
                why = f"error: {rejection.error}" if rejection.error else (f"it has {values}" if values else "")
                details.append(f"  request {request.name}: {rejection.selector} `{rejection.expression}` rejects "
                               f"{rejection.device}{': ' + why if why else ''}"
                               + (f" (largest: {request.largest})" if request.largest else ""))
            holders: dict[str, int] = {}
            for counts in request.nodes:
                for holder, n in counts.holders.items():
                    holders[holder] = holders.get(holder, 0) + n
            if holders:
                details.append(f"  request {request.name}: matching devices in use by "
                               + ", ".join(f"{c} ({n})" for c, n in sorted(holders.items())))
            if request.capacity:
                details.append(f"  request {request.name}: asks " + ", ".join(
                    f"{name} {amount}" for name, amount in sorted(request.capacity.items())) + " of a device")
            for room in request.rooms[:MAX_ROOM_LINES]:
                details.append(f"  request {request.name}: {'fits: ' if room.fits else 'no room: '}{room.describe()}")
            if len(request.rooms) > MAX_ROOM_LINES:
                details.append(f"  request {request.name}: {len(request.rooms) - MAX_ROOM_LINES} more of the room met "
                               "not shown (-o yaml lists it)")
            for use in request.counter_sets[:MAX_COUNTER_SET_LINES]:
                details.append(f"  request {request.name}: short of {use.describe()}")
            listed = len(request.counter_sets) - MAX_COUNTER_SET_LINES  # in -o yaml, not here
            if listed + request.more_counter_sets > 0:
                details.append(f"  request {request.name}: {listed + request.more_counter_sets} more counter sets "
                               "short of room not shown" + (f" (-o yaml lists {listed})" if listed > 0 else ""))
        for constraint in claim.constraints:
            details.append(f"  {claim.name}: constraint {constraint}")
    if verdict.extended is not None and verdict.extended.claim:
        by_request: dict[str, list[str]] = {}
        for mapping in verdict.extended.mappings:
            by_request.setdefault(str(mapping.get("requestName")), []).append(
                f"{mapping.get('containerName')} {mapping.get('resourceName')}")
        details.append(f"  {verdict.extended.claim}: the scheduler's claim for the pod's extended resources: "
                       + "; ".join(f"{request} serves {', '.join(sorted(users))}"
                                   for request, users in sorted(by_request.items())))
    if len(rows) > 1:
        lines += ["  " + line for line in _table(rows)]
    lines += details
    gates = ", ".join(f"{name}={str(on).lower()}" for name, on in sorted(verdict.feature_gates.items()))
    lines.append(f"  allocator: {verdict.allocator}" + (f", feature gates {gates}" if gates else ""))
    lines += [f"  note: {note}" for note in verdict.notes]
    lines.append(verdict.conclusion)
    return "\n".join(lines) + "\n"
