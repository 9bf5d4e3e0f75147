"""What must hold of a GPU cluster under chaos, as pure checks over observed state (the chaos
driver observes; nothing here reads a file or calls the API server).

* No device is held by two claims that may not share it: on the nodes (the agents' checkpoints,
  either state) and in the API (allocations). Claims may share a device only as consumable-capacity
  shares (KEP-5075: each allocation result has a shareID), within the device's capacity.
* A node prepares for a claim exactly the devices allocated to that claim.
* No CDI spec, checkpoint entry or MPS daemon outlives its claim: each names a claim that exists and
  is reserved for some pod. A fault may delay the release by a little; :class:`OrphanTracker` says
  which have lasted longer than a grace period.
* Slices converge to the hardware: each node's pool publishes exactly its GPUs, once, in slices of
  one generation whose count is the pool's resourceSliceCount.
* Every pod that should run gets its devices: none waits to run longer than a deadline."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Device = tuple[str, str]  # (pool, device)


@dataclass(frozen=True)
class Holding:
    """A device a claim holds: allocated to it, or prepared for it on a node."""
    claim_uid: str
    pool: str
    device: str
    share_id: str | None = None
    consumed: tuple[tuple[str, int], ...] = ()  # capacity name -> base units (bytes, shares)

    @property
    def key(self) -> Device:
        return self.pool, self.device


@dataclass(frozen=True)
class NodeState:
    node: str
    checkpoint: Mapping[str, tuple[str, tuple[Holding, ...]]]  # claim UID -> (state, devices held)
    cdi_claims: frozenset[str]  # claim UIDs with a CDI spec in the node's CDI directory
    mps_claims: frozenset[str]  # claim UIDs with a running MPS control daemon


@dataclass(frozen=True)
class ClaimState:
    uid: str
    namespace: str
    name: str
    allocated: tuple[Holding, ...]  # the driver's allocation results; () when not allocated
    reserved_for: frozenset[str]  # pod UIDs


@dataclass(frozen=True)
class Violation:
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


def _over_capacity(holders: Sequence[Holding], capacity: Mapping[str, int] | None) -> str | None:
    """Why ``holders`` (two or more) may not hold one device together; None when they may."""
    unshared = [h.claim_uid for h in holders if h.share_id is None]
    if unshared:
        return f"held whole by {', '.join(sorted(unshared))} beside {len(holders) - len(unshared)} other(s)"
    if len({h.claim_uid for h in holders}) < len(holders):
        return "one claim holds it twice"
    totals: Counter[str] = Counter()
    for holder in holders:
        totals.update(dict(holder.consumed))
    for name, used in sorted(totals.items()):
        limit = (capacity or {}).get(name)
        if limit is None or used > limit:
            return f"{name} consumed {used} of {limit if limit is not None else 'no such capacity'}"
    return None


def overcommitted(holdings: Iterable[Holding], capacities: Mapping[Device, Mapping[str, int]],
                  *, where: str) -> list[Violation]:
    """Devices held by claims that may not share them (``where`` names the source in the message)."""
    by_device: dict[Device, list[Holding]] = defaultdict(list)
    for holding in holdings:
        by_device[holding.key].append(holding)
    violations = []
    for key, holders in sorted(by_device.items()):
        if len(holders) < 2:
            continue
        reason = _over_capacity(holders, capacities.get(key))
        if reason:
            claims = ", ".join(sorted(h.claim_uid for h in holders))
            violations.append(Violation("device-shared", f"{where}: {key[0]}/{key[1]} held by {claims}: {reason}"))
    return violations


def prepared_holdings(nodes: Iterable[NodeState]) -> list[Holding]:
    return [h for node in nodes for _state, held in node.checkpoint.values() for h in held]


def prepared_not_allocated(nodes: Iterable[NodeState], claims: Mapping[str, ClaimState]) -> list[Violation]:
    """Checkpoint entries holding a device their (existing, allocated) claim was not allocated."""
    violations = []
    for node in nodes:
        for uid, (state, held) in sorted(node.checkpoint.items()):
            claim = claims.get(uid)
            if claim is None or not claim.allocated:
                continue  # gone or deallocated: an orphan, if it lasts (see orphans)
            allocated = {h.key for h in claim.allocated}
            extra = sorted(h.key for h in held if h.key not in allocated)
            if extra:
                violations.append(Violation("prepared-not-allocated", (
                    f"{node.node}: claim {claim.namespace}/{claim.name} ({uid}, {state}) holds "
                    f"{', '.join('/'.join(k) for k in extra)}, allocated {', '.join('/'.join(k) for k in sorted(allocated))}")))
    return violations


def orphans(nodes: Iterable[NodeState], claims: Mapping[str, ClaimState]) -> set[tuple[str, str, str]]:
    """(node, what, claim UID) for each checkpoint entry, CDI spec and MPS daemon whose claim does
    not exist or is reserved for no pod."""
    live = {uid for uid, claim in claims.items() if claim.reserved_for and claim.allocated}
    found: set[tuple[str, str, str]] = set()
    for node in nodes:
        for what, uids in (("checkpoint entry", node.checkpoint), ("CDI spec", node.cdi_claims),
                           ("MPS daemon", node.mps_claims)):
            found.update((node.node, what, uid) for uid in uids if uid not in live)
    return found


@dataclass
class OrphanTracker:
    """Remembers since when each orphan has been seen; reports each once it has lasted ``grace``
    seconds (a release delayed by a fault is fine, one that never comes is not)."""
    grace: float
    first_seen: dict[tuple[str, str, str], float] = field(default_factory=dict)
    reported: set[tuple[str, str, str]] = field(default_factory=set)

    def update(self, now: float, current: set[tuple[str, str, str]]) -> list[Violation]:
        self.first_seen = {key: self.first_seen.get(key, now) for key in current}
        violations = []
        for key, since in sorted(self.first_seen.items()):
            if now - since >= self.grace and key not in self.reported:
                self.reported.add(key)
                node, what, uid = key
                violations.append(Violation("outlived-claim", f"{node}: {what} of claim {uid} for {now - since:.0f}s"))
        return violations


def slice_mismatch(expected: Mapping[str, Iterable[str]], slices: Iterable[Mapping[str, Any]]) -> list[Violation]:
    """Each node's pool against its hardware (node -> device names): the devices, each once, in
    slices of one generation whose number is the pool's resourceSliceCount."""
    by_node: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for slice_ in slices:
        by_node[slice_["spec"].get("nodeName") or ""].append(slice_)
    violations = []
    for node in sorted(set(expected) | set(by_node)):
        pool = by_node.get(node, [])
        names = [d["name"] for s in pool for d in s["spec"].get("devices") or []]
        want = sorted(expected.get(node, ()))
        problems = []
        if sorted(names) != want:
            problems.append(f"devices {sorted(names)}, hardware {want}")
        generations = {s["spec"]["pool"]["generation"] for s in pool}
        if len(generations) > 1:
            problems.append(f"generations {sorted(generations)}")
        counts = {s["spec"]["pool"]["resourceSliceCount"] for s in pool}
        if pool and counts != {len(pool)}:
            problems.append(f"{len(pool)} slice(s), resourceSliceCount {sorted(counts)}")
        if problems:
            violations.append(Violation("slices", f"{node}: {'; '.join(problems)}"))
    return violations


@dataclass(frozen=True)
class PodRecord:
    namespace: str
    name: str
    created: float  # monotonic
    running: float | None = None  # when its kubelet started it, its claims prepared
    deleted: float | None = None  # when the workload asked for its deletion


def pods_not_run(pods: Iterable[PodRecord], now: float, deadline: float) -> list[Violation]:
    """Pods the workload still wants that have waited longer than ``deadline`` seconds to run."""
    return [Violation("pod-not-run", f"{p.namespace}/{p.name} waiting {now - p.created:.0f}s")
            for p in pods if p.running is None and p.deleted is None and now - p.created > deadline]


def allocation_holdings(claims: Iterable[ClaimState]) -> list[Holding]:
    return [h for claim in claims for h in claim.allocated]


def check_state(nodes: Sequence[NodeState], claims: Mapping[str, ClaimState],
                capacities: Mapping[Device, Mapping[str, int]]) -> list[Violation]:
    """The safety invariants, which hold at every moment."""
    return [*overcommitted(prepared_holdings(nodes), capacities, where="prepared on the nodes"),
            *overcommitted(allocation_holdings(claims.values()), capacities, where="allocated"),
            *prepared_not_allocated(nodes, claims)]


def holding_from_result(result: Mapping[str, Any], claim_uid: str) -> Holding:
    """A Holding from an allocation result of a claim's status (consumedCapacity as base units)."""
    from gpudra_core.quantity import parse_quantity

    consumed = tuple(sorted((name, int(parse_quantity(value)))
                            for name, value in (result.get("consumedCapacity") or {}).items()))
    return Holding(claim_uid, result["pool"], result["device"], result.get("shareID"), consumed)
