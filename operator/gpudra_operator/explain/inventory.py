"""What the scheduler's allocator sees of the cluster, from plain API objects, for explaining its
verdict (the verdict itself is Kubernetes' own allocator's, run by gpudra-allocator): the pools of
ResourceSlices a node can use, what other claims hold (whole devices, shares of a device's
consumable capacity, counters of partitionable devices), and node selection.

Follows k8s.io/dynamic-resource-allocation/structured (``GatherPools``, ``NodeMatches``; a slice
counts for a node by ``nodeName``, ``allNodes``, ``nodeSelector`` or, with partitionable devices, a
device's own node selection; per pool only the slices of the newest generation; a pool missing
slices is incomplete, one with a duplicate device name invalid; the allocated state as
kube-scheduler gathers it) and k8s.io/component-helpers/scheduling/corev1/nodeaffinity for node
selectors."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from gpudra_core.quantity import quantity_value

Obj = Mapping[str, Any]
DeviceID = tuple[str, str, str]  # driver, pool, device
PoolID = tuple[str, str]  # driver, pool


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

    @property
    def label(self) -> str:
        return f"{self.pool}/{self.name}"


@dataclass
class Pool:
    driver: str
    name: str
    slices: list[Obj] = field(default_factory=list)
    incomplete: bool = False
    invalid: str | None = None  # why, when invalid
    node: Obj | None = None  # the node it was gathered for: per-device node selection picks devices by it

    def devices(self) -> list[Device]:
        """The pool's devices the node can use, slice by slice in name order (as upstream's buildPool)."""
        devices = []
        for slice_ in sorted(self.slices, key=lambda s: str((s.get("metadata") or {}).get("name", ""))):
            spec = slice_["spec"]
            per_device = bool(spec.get("perDeviceNodeSelection")) and self.node is not None
            for entry in spec.get("devices") or []:
                if not per_device or serves_node(entry, self.node or {}):
                    devices.append(Device(self.driver, self.name, entry))
        return devices


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


def serves_node(where: Obj, node: Obj) -> bool:
    """``NodeMatches`` for a slice's spec, or for a device of a slice with per-device node
    selection: ``nodeName``, ``allNodes`` or ``nodeSelector``."""
    if where.get("nodeName"):
        return bool(where["nodeName"] == (node.get("metadata") or {}).get("name"))
    if where.get("allNodes"):
        return True
    if where.get("nodeSelector") is not None:
        return node_selector_matches(where["nodeSelector"], node)
    return False


def slice_serves_node(slice_: Obj, node: Obj) -> bool:
    """Whether a slice offers ``node`` anything: by its own node selection, or, with per-device node
    selection, by any of its devices'."""
    spec = slice_.get("spec") or {}
    if spec.get("perDeviceNodeSelection"):
        return any(serves_node(device, node) for device in spec.get("devices") or [])
    return serves_node(spec, node)


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

def _pool_id(slice_: Obj) -> PoolID:
    spec = slice_["spec"]
    return (str(spec["driver"]), str(spec["pool"]["name"]))


def _generation(slice_: Obj) -> int:
    return int(slice_["spec"]["pool"].get("generation", 0))


class SliceIndex:
    """The slices, indexed once per explain: by node name, the ones that select nodes otherwise,
    per pool how many slices each generation has (a 2,000-node cluster is 2,000 pools), and per
    pool the slices of its newest generation."""

    def __init__(self, slices: Iterable[Obj]) -> None:
        self.by_node: dict[str, list[Obj]] = {}
        self.selecting: list[Obj] = []  # allNodes, nodeSelector or per-device node selection
        self.generations: dict[PoolID, dict[int, int]] = {}
        self.newest: dict[PoolID, list[Obj]] = {}
        for slice_ in slices:
            spec = slice_.get("spec") or {}
            if spec.get("nodeName"):
                self.by_node.setdefault(spec["nodeName"], []).append(slice_)
            elif spec.get("allNodes") or spec.get("nodeSelector") is not None or spec.get("perDeviceNodeSelection"):
                self.selecting.append(slice_)
            key, generation = _pool_id(slice_), _generation(slice_)
            counts = self.generations.setdefault(key, {})
            counts[generation] = counts.get(generation, 0) + 1
            newest = self.newest.setdefault(key, [])
            if newest and generation > _generation(newest[0]):
                newest.clear()
            if not newest or generation == _generation(newest[0]):
                newest.append(slice_)


def _partitionable(slice_: Obj) -> bool:
    spec = slice_.get("spec") or {}
    return spec.get("perDeviceNodeSelection") is not None or bool(spec.get("sharedCounters"))


def gather_pools(index: SliceIndex, node: Obj, *, partitionable: bool = False) -> list[Pool]:
    """``GatherPools`` for ``node``, ordered by driver and pool name. ``partitionable``: the
    scheduler's DRAPartitionableDevices gate; without it, slices with counter sets or per-device
    node selection are left out (so a pool that has them is incomplete)."""
    name = (node.get("metadata") or {}).get("name", "")
    pools: dict[PoolID, Pool] = {}
    for slice_ in [*index.by_node.get(name, []), *index.selecting]:
        if (not partitionable and _partitionable(slice_)) or not slice_serves_node(slice_, node):
            continue
        key = _pool_id(slice_)
        pool = pools.setdefault(key, Pool(*key, node=node))
        generation = _generation(slice_)
        current = _generation(pool.slices[0]) if pool.slices else None
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
            pool.incomplete = counts[generation] != wanted  # every slice counts here, as upstream's checkSlicesInPool
        seen: set[str] = set()
        duplicate = None
        for entry in (d for s in pool.slices for d in s["spec"].get("devices") or []):
            if entry.get("name") in seen:
                duplicate = entry.get("name")
                break
            seen.add(str(entry.get("name")))
        pool.invalid = f"duplicate device name {duplicate}" if duplicate else None
        result.append(pool)
    return result


def with_taint_rules(slices: Sequence[Obj], rules: Sequence[Obj]) -> list[Obj]:
    """``slices`` with the taints of the DeviceTaintRules added to the devices they select, as
    kube-scheduler's resourceslice tracker adds them (applyPatches: a rule without a selector
    selects nothing; each of driver, pool and device that is set must match)."""
    patched: list[Obj] = []
    for slice_ in slices:
        spec = slice_.get("spec") or {}
        copied: dict[str, Any] | None = None
        for rule in rules:
            selector = (rule.get("spec") or {}).get("deviceSelector")
            taint = (rule.get("spec") or {}).get("taint")
            if selector is None or taint is None:
                continue
            if selector.get("driver") not in (None, spec.get("driver")) or \
                    selector.get("pool") not in (None, (spec.get("pool") or {}).get("name")):
                continue
            for index, device in enumerate(spec.get("devices") or []):
                if selector.get("device") not in (None, device.get("name")):
                    continue
                if copied is None:
                    copied = {**slice_, "spec": {**spec, "devices": list(spec["devices"])}}
                entry = copied["spec"]["devices"][index]
                copied["spec"]["devices"][index] = {**entry, "taints": [*(entry.get("taints") or []), taint]}
        patched.append(copied if copied is not None else slice_)
    return patched


# --- what allocated claims hold ---------------------------------------------------------------

@dataclass(frozen=True)
class Share:
    """One allocation result holding a share of a device (consumable capacity)."""

    claim: str  # namespace/name
    consumed: Mapping[str, Decimal]  # capacity name -> what the share consumes


@dataclass
class Holdings:
    """What allocated claims hold, as kube-scheduler gathers it for the allocator: whole devices
    (a result without a share ID), and, where the scheduler has DRAConsumableCapacity on, shares of
    devices that allow multiple allocations. Admin access holds nothing."""

    whole: dict[DeviceID, str] = field(default_factory=dict)  # device -> the claim holding it
    shares: dict[DeviceID, list[Share]] = field(default_factory=dict)

    def allocated(self, device: DeviceID) -> bool:
        return device in self.whole or device in self.shares

    def consumed(self, device: DeviceID) -> dict[str, Decimal]:
        """Per capacity, what the shares of ``device`` consume together."""
        total: dict[str, Decimal] = {}
        for share in self.shares.get(device, []):
            for name, amount in share.consumed.items():
                total[name] = total.get(name, Decimal(0)) + amount
        return total


def holdings(claims: Iterable[Obj], *, consumable: bool) -> Holdings:
    """What ``claims``' allocations hold. ``consumable``: the scheduler's DRAConsumableCapacity
    gate (without it, a share holds its device whole)."""
    held = Holdings()
    for claim in claims:
        meta = claim.get("metadata") or {}
        label = f"{meta.get('namespace')}/{meta.get('name')}"
        allocation = (claim.get("status") or {}).get("allocation") or {}
        for result in (allocation.get("devices") or {}).get("results") or []:
            if result.get("adminAccess"):
                continue  # admin access does not take the device from others
            device = (result["driver"], result["pool"], result["device"])
            if consumable and result.get("shareID"):
                consumed = {str(k): v for k, raw in (result.get("consumedCapacity") or {}).items()
                            if (v := quantity_value(raw)) is not None}
                held.shares.setdefault(device, []).append(Share(label, consumed))
            else:
                held.whole[device] = label
    return held


# --- counters of partitionable devices --------------------------------------------------------

@dataclass(frozen=True)
class Counter:
    """One counter of a counter set: what the set has, and what allocated devices leave of it."""

    total: Decimal
    left: Decimal
    binary: bool  # written as a binary quantity (bytes): shown that way


CounterSets = dict[str, dict[str, Counter]]  # counter set -> counter -> Counter


def counters_left(index: SliceIndex, held: Holdings) -> dict[PoolID, CounterSets]:
    """Per pool, its counter sets (``sharedCounters``, on 1.35+ in slices of their own) less what
    its allocated devices consume (``consumesCounters``), over every slice of the pool's newest
    generation, as the allocator's checkAvailableCounters counts them."""
    result: dict[PoolID, CounterSets] = {}
    for key, slices in index.newest.items():
        sets: dict[str, dict[str, list[Any]]] = {}
        for slice_ in slices:
            for counter_set in slice_["spec"].get("sharedCounters") or []:
                counters = sets.setdefault(str(counter_set.get("name")), {})
                for name, counter in (counter_set.get("counters") or {}).items():
                    raw = str(counter.get("value"))
                    counters[name] = [quantity_value(raw) or Decimal(0), quantity_value(raw) or Decimal(0),
                                      raw.endswith("i")]
        if not sets:
            continue
        for slice_ in slices:
            for device in slice_["spec"].get("devices") or []:
                if not held.allocated((key[0], key[1], str(device.get("name")))):
                    continue
                for consumption in device.get("consumesCounters") or []:
                    counters = sets.get(str(consumption.get("counterSet")), {})
                    for name, counter in (consumption.get("counters") or {}).items():
                        if name in counters:
                            counters[name][1] -= quantity_value(counter.get("value")) or Decimal(0)
        result[key] = {set_name: {name: Counter(total, left, binary) for name, (total, left, binary) in counters.items()}
                       for set_name, counters in sets.items()}
    return result


def nodes_of(slices: Sequence[Obj], nodes: Sequence[Obj] | None) -> list[Obj]:
    """The nodes to consider: the cluster's when they could be read, else a stand-in per
    ``nodeName`` the slices name (no labels: node selectors then cannot be judged)."""
    if nodes is not None:
        return sorted(nodes, key=lambda n: n["metadata"]["name"])
    names = sorted({s["spec"]["nodeName"] for s in slices if (s.get("spec") or {}).get("nodeName")})
    return [{"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}} for name in names]
