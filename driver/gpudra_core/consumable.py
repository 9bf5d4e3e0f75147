"""Consumable capacity (KEP-5075, the DRAConsumableCapacity feature): full GPUs published so that
the scheduler may allocate one GPU to several ResourceClaims, each consuming part of its memory and,
optionally, one of a fixed number of shares. Pure, except :func:`api_server_keeps_sharing`.

With ``--consumable-memory-step STEP [--consumable-shares N]`` every full GPU of ``M`` bytes is
published as (``F`` is ``M`` rounded down to a multiple of ``STEP``)::

    allowMultipleAllocations: true
    capacity:
      memory: {value: M, requestPolicy: {default: F, validRange: {min: STEP, max: F, step: STEP}}}
      shares: {value: N, requestPolicy: {default: 1, validRange: {min: 1, max: N, step: 1}}}  # N > 0

The scheduler then keeps, per GPU, the sum of what its allocations consumed at most the capacity
(k8s.io/dynamic-resource-allocation, structured allocator). A claim that asks for
``capacity.requests: {memory: 10Gi}`` consumes 10Gi rounded up to a multiple of STEP, and one share;
a claim that names no memory consumes ``F``, the whole GPU, exactly as without sharing, so turning
the option on changes nothing for existing workloads. It is accounting, not isolation: nothing here
limits what a process allocates on the GPU (docs/sharing.md).

MIG devices are left as they are, one claim each: a MIG device already is the GPU's own partition,
with the memory and compute isolation consumable capacity does not give. A GPU with less than two
steps of memory is left unshared too (the API requires ``min + step <= value``), with a warning.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from gpudra_core.devicemodel import Device, RequestPolicy
from gpudra_core.quantity import format_quantity, parse_quantity

log = logging.getLogger(__name__)

MAX_SHARES = 1000  # spec.sharing.consumableCapacity.shares' maximum in the CRD
FEATURE_GATE = "DRAConsumableCapacity"


@dataclass(frozen=True)
class ConsumableCapacity:
    """The sharing policy: ``memory_step`` bytes (> 0), ``shares`` claims per GPU at most (0: no
    count, only memory limits them)."""

    memory_step: int
    shares: int = 0

    def __post_init__(self) -> None:
        if type(self.memory_step) is not int or self.memory_step <= 0:
            raise ValueError(f"the memory step must be a positive number of bytes, got {self.memory_step!r}")
        if type(self.shares) is not int or not 0 <= self.shares <= MAX_SHARES:
            raise ValueError(f"shares must be 0..{MAX_SHARES}, got {self.shares!r}")

    @classmethod
    def parse(cls, memory_step: str, shares: int = 0) -> ConsumableCapacity:
        """From the quantity string the flag and the CRD take (``1Gi``, ``512Mi``, ``1G``)."""
        return cls(parse_memory_step(memory_step), shares)


def parse_memory_step(text: str) -> int:
    """``text`` in bytes: a positive, whole number of bytes (``ValueError`` saying why not)."""
    value: Decimal = parse_quantity(text)
    if value <= 0 or value != value.to_integral_value():
        raise ValueError(f"{text!r} is not a positive whole number of bytes (e.g. 1Gi, 512Mi)")
    return int(value)


def memory_policy(memory: int, step: int) -> RequestPolicy | None:
    """The memory request policy of a GPU with ``memory`` bytes; None when it is too small to share
    (less than two steps)."""
    if memory < 2 * step:
        return None
    whole = memory - memory % step
    return RequestPolicy(default=whole, min=step, max=whole, step=step)


def shares_policy(shares: int) -> RequestPolicy:
    """One share per claim unless it asks for more, at most ``shares``. With one share there is no
    step: the API requires ``min + step <= value``."""
    if shares == 1:
        return RequestPolicy(default=1, min=1, max=1)
    return RequestPolicy(default=1, min=1, max=shares, step=1)


def share_device(device: Device, policy: ConsumableCapacity) -> tuple[Device, str | None]:
    """``device`` as published for sharing, and a warning when it is left exclusive."""
    if device.type != "gpu" or "memory" not in device.capacity:
        return device, None
    if device.consumes_counters:  # a dynamic MIG GPU: whole (its MIG mode off for one claim) or partitioned
        return device, (f"GPU {device.name}: a dynamic MIG GPU is not shared by consumable capacity (its MIG "
                        "placements are its partitions): published unshared, one claim at a time")
    memory = memory_policy(device.capacity["memory"], policy.memory_step)
    if memory is None:
        return device, (f"GPU {device.name}: its memory ({format_quantity(device.capacity['memory'], binary=True)}) "
                        f"is less than two steps of {format_quantity(policy.memory_step, binary=True)} "
                        "(--consumable-memory-step): published unshared, one claim at a time")
    capacity = dict(device.capacity)
    policies = {"memory": memory}
    if policy.shares:
        capacity["shares"] = policy.shares
        policies["shares"] = shares_policy(policy.shares)
    return dataclasses.replace(device, capacity=capacity, allow_multiple_allocations=True,
                               request_policies=policies), None


def share_devices(devices: Iterable[Device], policy: ConsumableCapacity | None) -> tuple[list[Device], list[str]]:
    """The devices as published under ``policy`` (None: unchanged), and one warning per GPU that
    stays exclusive."""
    if policy is None:
        return list(devices), []
    shared, warnings = [], []
    for device in devices:
        published, warning = share_device(device, policy)
        shared.append(published)
        if warning:
            warnings.append(warning)
    return shared, warnings


def policy_to_api(policy: RequestPolicy, *, binary: bool) -> dict[str, Any]:
    """The v1 ``requestPolicy`` object, quantities in the canonical form the API server returns."""
    def q(amount: int) -> str:
        return format_quantity(amount, binary=binary)

    valid_range: dict[str, str] = {"min": q(policy.min)}
    if policy.max is not None:
        valid_range["max"] = q(policy.max)
    if policy.step is not None:
        valid_range["step"] = q(policy.step)
    return {"default": q(policy.default), "validRange": valid_range}


# -- the agent's command line --------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--consumable-memory-step`` and ``--consumable-shares``, for ``gpudra agent`` and ``discover``."""
    parser.add_argument("--consumable-memory-step", metavar="QUANTITY", default=None, type=_memory_step,
                        help="publish full GPUs for sharing (KEP-5075 consumable capacity, Kubernetes 1.36+): "
                             "several claims per GPU, each consuming memory in multiples of this quantity, "
                             "e.g. 1Gi; a claim that names no memory still gets the whole GPU (default: off)")
    parser.add_argument("--consumable-shares", metavar="N", default=0, type=_shares,
                        help="with --consumable-memory-step: also a 'shares' capacity of N, at most N claims "
                             "per GPU; 0: none (default: %(default)s)")


def from_args(args: argparse.Namespace) -> ConsumableCapacity | None:
    """The policy the flags ask for (None: sharing off). ``ValueError`` for shares without a step."""
    step, shares = getattr(args, "consumable_memory_step", None), getattr(args, "consumable_shares", 0)
    if step is None:
        if shares:
            raise ValueError("--consumable-shares needs --consumable-memory-step")
        return None
    return ConsumableCapacity(step, shares)


def _memory_step(text: str) -> int:
    try:
        return parse_memory_step(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _shares(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_SHARES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of shares 0..{MAX_SHARES}")
    return value


# -- the one check against the API server -------------------------------------------------------

PROBE_STEP = 2**30


def probe_slice(driver: str, node: str) -> dict[str, Any]:
    """A ResourceSlice of ``node`` with one shared device, for a server-side dry run."""
    memory = memory_policy(2 * PROBE_STEP, PROBE_STEP)
    assert memory is not None
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"generateName": "gpudra-consumable-capacity-probe-"},
        "spec": {"driver": driver, "nodeName": node,
                 "pool": {"name": node, "generation": 0, "resourceSliceCount": 1},
                 "devices": [{"name": "probe", "allowMultipleAllocations": True,
                              "capacity": {"memory": {"value": format_quantity(2 * PROBE_STEP, binary=True),
                                                      "requestPolicy": policy_to_api(memory, binary=True)}}}]},
    }


def keeps_sharing(stored: dict[str, Any]) -> bool:
    """Whether the API server stored the probe slice with its sharing fields (pure)."""
    devices = (stored.get("spec") or {}).get("devices") or [{}]
    memory = (devices[0].get("capacity") or {}).get("memory") or {}
    return devices[0].get("allowMultipleAllocations") is True and "requestPolicy" in memory


async def api_server_keeps_sharing(kube: Any, driver: str, node: str) -> tuple[bool, str]:
    """Whether the API server keeps ``allowMultipleAllocations`` and ``requestPolicy`` in this
    node's slices, by a server-side dry-run create of one (nothing is stored), and why not.

    A server whose DRAConsumableCapacity gate is off (Kubernetes 1.35's default) drops both fields
    without an error. Publishing them anyway would leave every slice different from what the
    server keeps, and the publisher rewriting the pool forever; so the agent publishes unshared
    GPUs there. Errors other than a refusal (the API server unreachable) are raised: the caller
    retries."""
    from gpudra_core.kubeapi import dry_run_create

    stored, refused = await dry_run_create(kube, probe_slice(driver, node))
    if stored is None:
        return False, f"a dry-run ResourceSlice with allowMultipleAllocations was refused: {refused}"
    if keeps_sharing(stored):
        return True, ""
    return False, (f"the API server drops allowMultipleAllocations and requestPolicy from ResourceSlices: its "
                   f"{FEATURE_GATE} feature gate is off (alpha and off by default in Kubernetes 1.35, beta and "
                   "on from 1.36)")
