"""ResourceSlice building: the device model in, resource.k8s.io/v1 objects (plain dicts) out.

One pool per node, named after the node, as NVIDIA's driver and the upstream kubeletplugin helper
do. Devices are sorted by name (naturally: gpu-2 before gpu-10) and cut into slices of at most 128
(64 while any device of the pool carries a taint: the API's limit for a slice with taints),
so the same devices always land in the same slice with the same name; a publisher can compare
desired and observed objects and write nothing when nothing changed. Dynamic MIG GPUs
(:mod:`gpudra_core.migpartitions`) add, after those, a slice of counter sets and a slice per GPU of
the devices that consume them, as Kubernetes 1.35+ requires (a slice holds devices or counter
sets, not both). Every limit in
:mod:`gpudra_core.limits` is checked before anything is returned.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from typing import Any, TypeVar

from gpudra_core import limits
from gpudra_core.devicemodel import CounterSet, Device
from gpudra_driver.deviceapi import counter_set_to_api, device_to_api

_T = TypeVar("_T")

API_VERSION = "resource.k8s.io/v1"
KIND = "ResourceSlice"
MANAGED_BY = "gpudra-agent"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_NODE = "gpudra.io/node"


def build_slices(
    driver: str,
    node_name: str,
    node_uid: str | None,
    generation: int,
    devices: Iterable[Device],
    *,
    max_devices: int | None = None,
) -> list[dict[str, Any]]:
    """The ResourceSlices publishing ``devices`` for ``node_name``'s pool at ``generation``.

    ``node_uid`` makes each slice owned by (garbage collected with) the Node; None leaves the owner
    out, which only an offline preview (``gpudra discover``) should do. An empty device list still
    yields one empty slice: an empty pool says "this node has no GPUs", a missing one says nothing.
    """
    limits.check_driver_name(driver)
    limits.check_dns_subdomain("node name", node_name)
    limits.check_dns_subdomain("pool name", node_name, limits.MAX_POOL_NAME_LENGTH)
    if not 0 <= generation <= limits.INT64_MAX:
        raise limits.LimitError("pool generation", f"{generation} must be a non-negative int64")
    ordered = sorted(devices, key=lambda d: _natural_key(d.name))
    names = [d.name for d in ordered]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:  # the allocator rejects a pool with duplicate device names
        raise limits.LimitError(f"pool {node_name}", f"duplicate device names {duplicates}")
    plain = [d for d in ordered if not d.consumes_counters]
    tainted = any(d.taints for d in plain)
    limit = limits.MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS if tainted else limits.MAX_DEVICES_PER_SLICE
    if max_devices is None:
        max_devices = limit
    if not 0 < max_devices <= limit:
        raise limits.LimitError("max_devices", f"must be 1..{limit}")

    # Each slice's content: plain devices first, then (partitionable devices, KEP-4815) the counter
    # sets, 8 to a slice, and each set's devices in slices of their own: a slice holds devices or
    # counter sets, never both (1.35+), and at most 64 devices that consume counters.
    contents: list[dict[str, Any]] = [{"devices": [device_to_api(d) for d in chunk]}
                                      for chunk in _chunks(plain, max_devices)]
    counter_sets = _counter_sets(node_name, ordered)
    by_set = _consumers(node_name, ordered, counter_sets)
    set_names = sorted(counter_sets, key=_natural_key)
    for set_chunk in _chunks(set_names, limits.MAX_COUNTER_SETS_PER_SLICE):
        contents.append({"sharedCounters": [counter_set_to_api(counter_sets[n]) for n in set_chunk]})
    for set_name in set_names:
        for chunk in _chunks(by_set[set_name], min(max_devices, limits.MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS)):
            contents.append({"devices": [device_to_api(d) for d in chunk]})
    if not contents:  # an empty pool says "this node has no GPUs", a missing one says nothing
        contents = [{}]

    labels = {LABEL_MANAGED_BY: MANAGED_BY, LABEL_NODE: node_label_value(node_name)}
    slices = []
    for i, content in enumerate(contents):
        name = slice_name(node_name, driver, i)
        limits.check_dns_subdomain("ResourceSlice name", name)
        limits.check_labels(f"ResourceSlice {name}", labels)
        entries = content.get("devices") or []
        limits.check_devices_per_slice(f"ResourceSlice {name}", len(entries),
                                       taints_or_counters=any("taints" in e or "consumesCounters" in e for e in entries))
        metadata: dict[str, Any] = {"name": name, "labels": dict(labels)}
        if node_uid:
            metadata["ownerReferences"] = [
                {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid, "controller": True}
            ]
        spec: dict[str, Any] = {
            "driver": driver,
            "pool": {"name": node_name, "generation": generation, "resourceSliceCount": len(contents)},
            "nodeName": node_name,
            **{key: value for key, value in content.items() if value},  # the API server drops an empty list
        }
        slices.append({"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": spec})
    return slices


def _chunks(items: list[_T], size: int) -> list[list[_T]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _counter_sets(pool: str, devices: list[Device]) -> dict[str, CounterSet]:
    """The pool's counter sets, from the devices that provide them; each name once."""
    found: dict[str, CounterSet] = {}
    for device in devices:
        provided = device.provides_counters
        if provided is None:
            continue
        if provided.name in found:
            raise limits.LimitError(f"pool {pool}", f"counter set {provided.name} provided twice")
        found[provided.name] = provided
    return found


def _consumers(pool: str, devices: list[Device], counter_sets: dict[str, CounterSet]) -> dict[str, list[Device]]:
    """Each counter set's consumers (a device goes with the first set it consumes from), after
    checking that every consumption names a set of the pool and counters that set has: the
    scheduler would otherwise find the whole pool invalid."""
    by_set: dict[str, list[Device]] = {name: [] for name in counter_sets}
    for device in devices:
        for consumption in device.consumes_counters:
            known = counter_sets.get(consumption.counter_set)
            if known is None:
                raise limits.LimitError(f"device {device.name}",
                                        f"consumes from counter set {consumption.counter_set}, which pool {pool} lacks")
            unknown = sorted(set(consumption.counters) - set(known.counters))
            if unknown:
                raise limits.LimitError(f"device {device.name}",
                                        f"consumes counters {unknown} that set {known.name} does not have")
        if device.consumes_counters:
            by_set[device.consumes_counters[0].counter_set].append(device)
    return by_set


def slice_name(node_name: str, driver: str, index: int) -> str:
    """``<node>-<driver with dots as dashes>-<index>``; the node part is shortened with a hash suffix
    when the whole would pass 253 characters, so names stay unique and deterministic."""
    suffix = f"-{driver.replace('.', '-')}-{index}"
    if len(node_name) + len(suffix) <= limits.MAX_DNS_SUBDOMAIN_LENGTH:
        return node_name + suffix
    keep = limits.MAX_DNS_SUBDOMAIN_LENGTH - len(suffix) - 9
    return f"{node_name[:keep].rstrip('.-')}-{_short_hash(node_name)}{suffix}"


def node_label_value(node_name: str) -> str:
    """The node name if it is a valid label value (at most 63 characters), else a shortened form
    with a hash suffix; select slices by ``spec.nodeName`` when the full name matters."""
    if limits.is_label_value(node_name):
        return node_name
    return f"{node_name[:54].rstrip('.-_')}-{_short_hash(node_name)}"


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _natural_key(name: str) -> list[tuple[int, int | str]]:
    return [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name) if part]
