"""Deciding what preparing one claim means (pure).

``plan_prepare`` takes the claim as the API server returned it, this node's devices, and the
checkpoint; it returns the :class:`PreparedClaim` to write, or raises :class:`ClaimError` with a
message that names the claim and the reason. Nothing here does I/O."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpudra_driver.plugin.cdi import cdi_device_id
from gpudra_driver.plugin.checkpoint import COMPLETED, Checkpoint
from gpudra_driver.plugin.devicenodes import NodeDevice
from gpudra_driver.plugin.model import ClaimError, ClaimRef, PreparedClaim, PreparedDevice


@dataclass(frozen=True)
class Plan:
    claim: PreparedClaim
    done: bool  # already prepared (checkpoint says PrepareCompleted): answer again, write nothing


def plan_prepare(ref: ClaimRef, claim: Mapping[str, Any] | ClaimError | None, devices: Mapping[str, NodeDevice] | None,
                 checkpoint: Checkpoint, *, node: str, driver: str) -> Plan:
    """What to prepare for ``ref``. ``claim`` is the GET result (None: not found); ``devices`` are
    this node's discovered devices by name (None: discovery has not finished yet). A GET that
    failed arrives as its :class:`ClaimError`; it matters only if the claim is not prepared yet."""
    ref.check()
    entry = checkpoint.claims.get(ref.uid)
    if entry is not None and entry.state == COMPLETED and not _reallocated(entry.claim, claim, driver):
        # Idempotent: the kubelet retries after timeouts and restarts; answer what we answered.
        return Plan(entry.claim, done=True)
    if isinstance(claim, ClaimError):
        raise claim
    if claim is None:
        raise ClaimError(f"{ref}: not found")
    meta = claim.get("metadata") or {}
    if meta.get("uid") != ref.uid:
        raise ClaimError(f"{ref}: the API server has UID {meta.get('uid')!r}; the claim was replaced")
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError(f"{ref}: not allocated")
    _check_node_selector(ref, allocation, node)
    results = _driver_results(allocation, driver)
    if not results:  # the kubelet only asks the drivers named in the allocation
        raise ClaimError(f"{ref}: no device of driver {driver} is allocated to it")
    if results and devices is None:
        raise ClaimError(f"{ref}: this node's devices are not discovered yet; retry")
    by_device: dict[str, list[str]] = {}
    exclusive: set[str] = set()  # devices with at least one result without adminAccess
    for result in results:
        pool, name = result.get("pool"), result.get("device")
        if pool != node:
            raise ClaimError(f"{ref}: device {name!r} is allocated from pool {pool!r}, not this node's "
                             f"pool {node!r}")
        assert devices is not None
        if name not in devices:
            raise ClaimError(f"{ref}: device {name!r} is not a device of node {node}")
        request = str(result.get("request") or "").split("/", 1)[0]  # "req/sub" -> "req"
        requests = by_device.setdefault(name, [])
        if request and request not in requests:
            requests.append(request)
        if not result.get("adminAccess"):
            exclusive.add(name)
    for name in exclusive:
        owner = checkpoint.device_owner(node, name)
        if owner is not None and owner != ref.uid:
            raise ClaimError(f"{ref}: device {name} is already prepared for claim {owner}; "
                             f"sharing a device between claims is not supported")
    assert devices is not None or not by_device
    prepared = tuple(
        PreparedDevice(tuple(requests), node, name, devices[name].uuid, devices[name].device_nodes,  # type: ignore[index]
                       cdi_device_id(driver, ref.uid, name), admin_access=name not in exclusive)
        for name, requests in by_device.items())
    return Plan(PreparedClaim(ref, prepared), done=False)


def _reallocated(prepared: PreparedClaim, claim: Mapping[str, Any] | ClaimError | None, driver: str) -> bool:
    """True when the API server shows the claim (same UID) allocated to other devices of ours than
    those it was prepared with: deallocated and allocated again while an unprepare never reached
    us. Answering the old devices would hand the container the wrong GPU. A failed GET, a missing
    or unallocated claim is no evidence: the prepared answer stands."""
    if not isinstance(claim, Mapping) or (claim.get("metadata") or {}).get("uid") != prepared.uid:
        return False
    allocation = (claim.get("status") or {}).get("allocation") or {}
    now = {(r.get("pool"), r.get("device")) for r in _driver_results(allocation, driver)}
    return bool(now) and now != {(d.pool, d.device) for d in prepared.devices}


def _driver_results(allocation: Mapping[str, Any], driver: str) -> list[Any]:
    """The allocation's results for ``driver`` (the kubelet asks each driver about its own)."""
    return [r for r in ((allocation.get("devices") or {}).get("results") or []) if r.get("driver") == driver]


def _check_node_selector(ref: ClaimRef, allocation: Mapping[str, Any], node: str) -> None:
    """The scheduler pins node-local allocations with ``matchFields metadata.name In [node]``."""
    terms = ((allocation.get("nodeSelector") or {}).get("nodeSelectorTerms")) or []
    names = [set(expr.get("values") or []) for term in terms for expr in term.get("matchFields") or []
             if expr.get("key") == "metadata.name" and expr.get("operator") == "In"]
    if names and not any(node in values for values in names):
        raise ClaimError(f"{ref}: allocated to node {sorted(set().union(*names))}, not {node}")
