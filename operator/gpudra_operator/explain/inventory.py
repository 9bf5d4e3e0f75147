"""What the scheduler's allocator sees of the cluster, from plain API objects: the pools of
ResourceSlices a node can use, the devices already allocated, and node selection.

Follows k8s.io/dynamic-resource-allocation/structured/internal/stable/pools_stable.go (1.35):
``GatherPools`` (a slice counts for a node by ``nodeName``, ``allNodes`` or ``nodeSelector``; per
pool only the slices of the newest generation; a pool missing slices is incomplete, one with a
duplicate device name invalid) and ``NodeMatches``; and k8s.io/component-helpers/scheduling/corev1/
nodeaffinity for node selectors."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Obj = Mapping[str, Any]
DeviceID = tuple[str, str, str]  # driver, pool, device


@dataclass(frozen=True)
class Device:
    driver: str
    pool: str
    spec: Obj  # the slice's entry in spec.devices

    @property
    def name(self) -> str:
        return str(self.spec.get("name", ""))

    @property
    def id(self) -> DeviceID:
        return (self.driver, self.pool, self.name)


@dataclass
class Pool:
    driver: str
    name: str
    slices: list[Obj] = field(default_factory=list)
    incomplete: bool = False
    invalid: str | None = None  # why, when invalid

    def devices(self) -> list[Device]:
        return [Device(self.driver, self.name, d) for s in self.slices for d in s["spec"].get("devices") or []]


# --- node selection (nodeaffinity.NodeSelector) ----------------------------------------------

def _requirement_matches(requirement: Obj, values_of: Mapping[str, str]) -> bool:
    key, operator = requirement.get("key", ""), requirement.get("operator", "")
    values = list(requirement.get("values") or [])
    present = key in values_of
    value = values_of.get(key)
    if operator == "In":
        return present and value in values
    if operator == "NotIn":
        return not present or value not in values
    if operator == "Exists":
        return present
    if operator == "DoesNotExist":
        return not present
    if operator in ("Gt", "Lt") and present and len(values) == 1:
        try:
            mine, theirs = int(str(value)), int(values[0])
        except ValueError:
            return False
        return mine > theirs if operator == "Gt" else mine < theirs
    return False


def _term_matches(term: Obj, node: Obj) -> bool:
    expressions = term.get("matchExpressions") or []
    fields = term.get("matchFields") or []
    if not expressions and not fields:
        return False  # an empty term matches nothing
    labels = (node.get("metadata") or {}).get("labels") or {}
    name = {"metadata.name": (node.get("metadata") or {}).get("name", "")}
    return (all(_requirement_matches(r, labels) for r in expressions)
            and all(_requirement_matches(r, name) for r in fields))


def node_selector_matches(selector: Obj, node: Obj) -> bool:
    """A v1 NodeSelector: any of its terms."""
    return any(_term_matches(term, node) for term in selector.get("nodeSelectorTerms") or [])


def slice_serves_node(slice_: Obj, node: Obj) -> bool:
    """pools_stable.go ``NodeMatches`` for a slice."""
    spec = slice_.get("spec") or {}
    if spec.get("nodeName"):
        return spec["nodeName"] == (node.get("metadata") or {}).get("name")
    if spec.get("allNodes"):
        return True
    if spec.get("nodeSelector") is not None:
        return node_selector_matches(spec["nodeSelector"], node)
    return False


def pod_fits_node(pod: Obj | None, node: Obj) -> bool:
    """The pod's own node selection: ``nodeName``, ``nodeSelector`` and required node affinity
    (the scheduler's NodeName and NodeAffinity filters)."""
    if pod is None:
        return True
    spec = pod.get("spec") or {}
    meta = node.get("metadata") or {}
    if spec.get("nodeName") and spec["nodeName"] != meta.get("name"):
        return False
    labels = meta.get("labels") or {}
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    required = (((spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution"))
    return required is None or node_selector_matches(required, node)


# --- pools ----------------------------------------------------------------------------------

class SliceIndex:
    """The slices, indexed once per explain: by node name, the ones that select nodes otherwise,
    and per pool how many slices each generation has (a 2,000-node cluster is 2,000 pools)."""

    def __init__(self, slices: Iterable[Obj]) -> None:
        self.by_node: dict[str, list[Obj]] = {}
        self.selecting: list[Obj] = []  # allNodes or nodeSelector
        self.generations: dict[tuple[str, str], dict[int, int]] = {}
        for slice_ in slices:
            spec = slice_.get("spec") or {}
            if spec.get("nodeName"):
                self.by_node.setdefault(spec["nodeName"], []).append(slice_)
            elif spec.get("allNodes") or spec.get("nodeSelector") is not None:
                self.selecting.append(slice_)
            key = (spec["driver"], spec["pool"]["name"])
            generation = int(spec["pool"].get("generation", 0))
            counts = self.generations.setdefault(key, {})
            counts[generation] = counts.get(generation, 0) + 1


def gather_pools(index: SliceIndex, node: Obj) -> list[Pool]:
    """pools_stable.go ``GatherPools`` for ``node``, ordered by driver and pool name (upstream's
    order is a Go map's; it only matters for which device a failing selector trips over first)."""
    name = (node.get("metadata") or {}).get("name", "")
    pools: dict[tuple[str, str], Pool] = {}
    for slice_ in [*index.by_node.get(name, []), *index.selecting]:
        spec = slice_.get("spec") or {}
        if spec.get("perDeviceNodeSelection") is not None or not slice_serves_node(slice_, node):
            continue  # per-device node selection needs DRAPartitionableDevices (alpha, off)
        key = (spec["driver"], spec["pool"]["name"])
        pool = pools.setdefault(key, Pool(*key))
        generation = int(spec["pool"].get("generation", 0))
        current = int(pool.slices[0]["spec"]["pool"].get("generation", 0)) if pool.slices else None
        if current is None or generation > current:
            pool.slices = [slice_]
        elif generation == current:
            pool.slices.append(slice_)
    result: list[Pool] = []
    for key in sorted(pools):
        pool = pools[key]
        first = pool.slices[0]["spec"]["pool"]
        generation, wanted = int(first.get("generation", 0)), int(first.get("resourceSliceCount", 1))
        if len(pool.slices) != wanted:  # as upstream: only a pool short of slices here is looked at further
            counts = index.generations[key]
            if max(counts) > generation:
                continue  # obsolete: a newer generation exists (for other nodes)
            pool.incomplete = counts[generation] != wanted
        names = [d.name for d in pool.devices()]
        duplicate = next((n for n in names if names.count(n) > 1), None)
        pool.invalid = f"duplicate device name {duplicate}" if duplicate else None
        result.append(pool)
    return result


def allocated_devices(claims: Iterable[Obj], *, except_uid: str | None = None) -> dict[DeviceID, str]:
    """Every allocated device and the claim (``namespace/name``) holding it."""
    held: dict[DeviceID, str] = {}
    for claim in claims:
        meta = claim.get("metadata") or {}
        if except_uid is not None and meta.get("uid") == except_uid:
            continue
        allocation = (claim.get("status") or {}).get("allocation") or {}
        for result in (allocation.get("devices") or {}).get("results") or []:
            if result.get("adminAccess"):
                continue  # admin access does not take the device from others
            held[(result["driver"], result["pool"], result["device"])] = f"{meta.get('namespace')}/{meta.get('name')}"
    return held


def nodes_of(slices: Sequence[Obj], nodes: Sequence[Obj] | None) -> list[Obj]:
    """The nodes to consider: the cluster's when they could be read, else a stand-in per
    ``nodeName`` the slices name (no labels: node selectors then cannot be judged)."""
    if nodes is not None:
        return sorted(nodes, key=lambda n: n["metadata"]["name"])
    names = sorted({s["spec"]["nodeName"] for s in slices if (s.get("spec") or {}).get("nodeName")})
    return [{"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}} for name in names]
