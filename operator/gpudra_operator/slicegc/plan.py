"""Which of a driver's ResourceSlices are stale: the ResourceSlice GC's one pure decision.

The rules, the never-rules and why each exists are in docs/gc.md; this module is their only
implementation. Inputs are compact records (:class:`SliceInfo`, :class:`NodeInfo`) built from the
listed objects page by page, so a fleet's slices never sit in memory as whole objects.

Grace periods need memory: ``first_seen`` maps a slice UID to the rule that made it stale and when
that was first observed. The caller carries the returned map to the next pass; a slice that is not
stale in a pass drops out of it, so its clock restarts if it turns stale again."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

NODE_GONE = "node-gone"
OWNER_UID_MISMATCH = "owner-uid-mismatch"
SUPERSEDED_GENERATION = "superseded-generation"
NODE_UNSELECTED = "node-unselected"
# The fifth rule, "driver no longer managed", is the teardown's of a deleted config (teardown.py).
RULES = (NODE_GONE, OWNER_UID_MISMATCH, SUPERSEDED_GENERATION, NODE_UNSELECTED)
GRACE_RULES = frozenset({SUPERSEDED_GENERATION, NODE_UNSELECTED})

_EMPTY: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True)
class SliceInfo:
    """What the GC needs of one ResourceSlice."""

    name: str
    uid: str
    resource_version: str
    driver: str
    pool: str
    generation: int
    node_name: str | None
    node_owner_uid: str | None = None  # the UID in a v1 Node ownerReference, if any

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> SliceInfo:
        meta, spec = obj["metadata"], obj.get("spec") or {}
        pool = spec.get("pool") or {}
        owner = next((ref for ref in meta.get("ownerReferences") or []
                      if ref.get("kind") == "Node" and ref.get("apiVersion") == "v1"), None)
        return cls(name=meta["name"], uid=meta["uid"], resource_version=meta.get("resourceVersion", ""),
                   driver=spec.get("driver", ""), pool=pool.get("name", ""),
                   generation=int(pool.get("generation") or 0), node_name=spec.get("nodeName") or None,
                   node_owner_uid=owner.get("uid") if owner else None)


@dataclass(frozen=True)
class NodeInfo:
    """A Node's identity and labels (all a metadata-only list returns that the GC needs)."""

    name: str
    uid: str
    labels: Mapping[str, str] = field(default_factory=lambda: _EMPTY)

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> NodeInfo:
        meta = obj["metadata"]
        return cls(name=meta["name"], uid=meta["uid"], labels=MappingProxyType(dict(meta.get("labels") or {})))


@dataclass(frozen=True)
class AgentPlacement:
    """Which Nodes the agent DaemonSet selects: its nodeSelector and required node affinity.

    Taints and tolerations are not evaluated (a metadata-only Node list has no taints), so a Node
    the agent cannot tolerate still counts as selected: the safe direction, it only keeps slices."""

    node_selector: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    affinity: Mapping[str, Any] | None = None

    def selects(self, node: NodeInfo) -> bool:
        if any(node.labels.get(k) != v for k, v in self.node_selector.items()):
            return False
        required = ((self.affinity or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution")
        if not required:
            return True
        terms = required.get("nodeSelectorTerms") or []
        return any(_term_matches(term, node) for term in terms)


def _term_matches(term: Mapping[str, Any], node: NodeInfo) -> bool:
    """One nodeSelectorTerm (its requirements ANDed). An empty term matches nothing, as upstream."""
    expressions = list(term.get("matchExpressions") or [])
    fields = list(term.get("matchFields") or [])
    if not expressions and not fields:
        return False
    values_of = [(e, node.labels.get(e.get("key", ""))) for e in expressions]
    values_of += [(f, node.name if f.get("key") == "metadata.name" else None) for f in fields]
    return all(_requirement_matches(req, value, has=value is not None) for req, value in values_of)


def _requirement_matches(req: Mapping[str, Any], value: str | None, *, has: bool) -> bool:
    op, values = req.get("operator"), list(req.get("values") or [])
    if op == "In":
        return has and value in values
    if op == "NotIn":
        return not has or value not in values
    if op == "Exists":
        return has
    if op == "DoesNotExist":
        return not has
    if op in ("Gt", "Lt"):
        try:
            number, bound = int(value or ""), int(values[0])
        except (ValueError, IndexError):
            return False
        return number > bound if op == "Gt" else number < bound
    return True  # an operator this code does not know: treat as selected (keeps slices)


@dataclass(frozen=True)
class Verdict:
    """A stale slice: the rule that condemned it, in words, and since when (clock seconds)."""

    slice: SliceInfo
    rule: str
    reason: str
    since: float


@dataclass
class Decision:
    condemned: list[Verdict] = field(default_factory=list)  # delete now
    pending: list[Verdict] = field(default_factory=list)  # stale, but inside the grace period
    first_seen: dict[str, tuple[str, float]] = field(default_factory=dict)  # carry to the next pass


def stale_slices(driver: str, slices: Iterable[SliceInfo], nodes: Mapping[str, NodeInfo],
                 agent_nodes: frozenset[str] | set[str], placement: AgentPlacement, *, now: float,
                 grace_period: float, first_seen: Mapping[str, tuple[str, float]] | None = None) -> Decision:
    """Decide which of ``driver``'s slices to delete now (docs/gc.md has the rules).

    ``nodes`` are the cluster's Nodes by name, ``agent_nodes`` the names of Nodes that run a pod of
    this config's agent, ``now`` a monotonic clock reading in seconds, ``first_seen`` the memory
    returned by the previous pass. Slices of any other driver, and slices not bound to one Node by
    ``spec.nodeName``, are never condemned."""
    ours = [s for s in slices if s.driver == driver and s.node_name]
    highest: dict[str, int] = {}
    for s in ours:
        highest[s.pool] = max(highest.get(s.pool, s.generation), s.generation)
    memory = first_seen or {}
    decision = Decision()
    for s in sorted(ours, key=lambda s: s.name):
        found = _rule_for(s, nodes.get(s.node_name or ""), s.node_name in agent_nodes,
                          highest[s.pool], placement)
        if found is None:
            continue
        rule, reason = found
        if rule not in GRACE_RULES:
            decision.condemned.append(Verdict(s, rule, reason, now))
            continue
        previous = memory.get(s.uid)
        since = previous[1] if previous and previous[0] == rule else now
        decision.first_seen[s.uid] = (rule, since)
        verdict = Verdict(s, rule, reason, since)
        (decision.condemned if now - since >= grace_period else decision.pending).append(verdict)
    return decision


def _rule_for(s: SliceInfo, node: NodeInfo | None, has_agent: bool, highest: int,
              placement: AgentPlacement) -> tuple[str, str] | None:
    current = s.generation >= highest
    if current and has_agent:
        return None  # never: the current generation on a node that runs our agent
    if node is None:
        return NODE_GONE, f"Node {s.node_name} does not exist"
    if s.node_owner_uid is not None and s.node_owner_uid != node.uid:
        return OWNER_UID_MISMATCH, (f"owner Node {s.node_name} has UID {node.uid}, the slice names "
                                    f"{s.node_owner_uid} (an older Node of the same name)")
    if not current:
        return SUPERSEDED_GENERATION, f"pool {s.pool} generation {s.generation} < {highest}"
    if not has_agent and not placement.selects(node):
        return NODE_UNSELECTED, f"Node {s.node_name} is not selected by the agent and runs no agent pod"
    return None
