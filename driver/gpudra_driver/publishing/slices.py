"""ResourceSlice building: the device model in, resource.k8s.io/v1 objects (plain dicts) out.

One pool per node, named after the node, as NVIDIA's driver and the upstream kubeletplugin helper
do. Devices are sorted by name (naturally: gpu-2 before gpu-10) and cut into slices of at most 128
(64 while any device of the pool carries a taint: the API's limit for a slice with taints),
so the same devices always land in the same slice with the same name; a publisher can compare
desired and observed objects and write nothing when nothing changed. Every limit in
:mod:`gpudra_core.limits` is checked before anything is returned.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from typing import Any

from gpudra_core import limits
from gpudra_core.devicemodel import Device
from gpudra_driver.deviceapi import device_to_api

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
    tainted = any(d.taints for d in ordered)
    limit = limits.MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS if tainted else limits.MAX_DEVICES_PER_SLICE
    if max_devices is None:
        max_devices = limit
    if not 0 < max_devices <= limit:
        raise limits.LimitError("max_devices", f"must be 1..{limit}")

    names = [d.name for d in ordered]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:  # the allocator rejects a pool with duplicate device names
        raise limits.LimitError(f"pool {node_name}", f"duplicate device names {duplicates}")

    chunks = [ordered[i : i + max_devices] for i in range(0, len(ordered), max_devices)] or [[]]
    labels = {LABEL_MANAGED_BY: MANAGED_BY, LABEL_NODE: node_label_value(node_name)}
    slices = []
    for i, chunk in enumerate(chunks):
        name = slice_name(node_name, driver, i)
        limits.check_dns_subdomain("ResourceSlice name", name)
        limits.check_labels(f"ResourceSlice {name}", labels)
        limits.check_devices_per_slice(f"ResourceSlice {name}", len(chunk),
                                       taints_or_counters=any(d.taints for d in chunk))
        metadata: dict[str, Any] = {"name": name, "labels": dict(labels)}
        if node_uid:
            metadata["ownerReferences"] = [
                {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid, "controller": True}
            ]
        spec: dict[str, Any] = {
            "driver": driver,
            "pool": {"name": node_name, "generation": generation, "resourceSliceCount": len(chunks)},
            "nodeName": node_name,
        }
        if chunk:  # the API server drops an empty list, so leave it out to compare equal
            spec["devices"] = [device_to_api(d) for d in chunk]
        slices.append({"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": spec})
    return slices


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
