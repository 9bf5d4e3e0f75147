"""How much room a device has left for a request, in the words of the objects: what other claims
hold of each consumable capacity of a shared device against what the request asks, and what
allocated devices leave of a partitionable device's counters against what the device needs.

This is explanation arithmetic, after k8s.io/dynamic-resource-allocation/structured
(consumable_capacity.go: the consumed amount of a request, its request policy; checkAvailableCounters:
the counters a pool's allocated devices consume). Whether a claim is allocated is decided by
Kubernetes' own allocator (gpudra-allocator) alone; where this arithmetic and the allocator ever
differ at an edge (milli-value rounding of a fractional range), the allocator's verdict stands."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import ROUND_CEILING, Decimal

from gpudra_core.quantity import format_quantity, quantity_value
from gpudra_operator.explain.inventory import CounterSets, Device, Holdings, Obj


@dataclass
class Room:
    """One limited resource of one device as a request meets it: a capacity (consumable capacity)
    or a counter of the counter set the device draws on (partitionable devices)."""

    node: str
    device: str  # pool/device
    kind: str  # "capacity" or "counter"
    name: str  # the capacity, or "<counter set>/<counter>"
    fits: bool
    total: str | None = None
    held: str | None = None  # what other claims' allocations hold of it
    left: str | None = None
    asks: str | None = None  # what the request consumes of the capacity, or the device of the counter
    holders: dict[str, str] = field(default_factory=dict)  # claim -> what its share holds
    reason: str | None = None  # a rule rather than arithmetic: a missing capacity, the request policy, a gate
    pool: str | None = None  # of a counter's device: the pool whose counter set it is

    def describe(self) -> str:
        if self.reason is not None:
            return f"{self.device} {self.reason}"
        if self.kind == "counter":
            counter_set, _, counter = self.name.partition("/")
            return (f"{self.device} needs {self.asks} of counter {counter} of counter set {counter_set}, "
                    f"{self.left} of {self.total} left")
        held = f" (held: {', '.join(f'{c} {q}' for c, q in self.holders.items())})" if self.holders else ""
        return f"{self.device} has {self.left} of {self.total} {self.name} left, the request asks {self.asks}{held}"


def show(amount: Decimal, binary: bool) -> str:
    """A quantity as people read it: ``20Gi``, ``4``, ``500m``, ``-2Gi`` (over-committed)."""
    if amount < 0:
        return "-" + show(-amount, binary)
    if amount == amount.to_integral_value():
        return format_quantity(int(amount), binary=binary)
    milli = amount * 1000
    return f"{int(milli)}m" if milli == milli.to_integral_value() else str(amount)


def _quantity(raw: object) -> Decimal | None:
    return quantity_value(raw) if isinstance(raw, (int, str)) else None


def consumed(asked: str | None, capacity: Obj) -> Decimal:
    """What a request consumes of one capacity (calculateConsumedCapacity): what it asks, rounded up
    by the capacity's request policy (to the range's minimum and step, or the next valid value);
    asking nothing consumes the policy's default, or else the whole capacity."""
    policy = capacity.get("requestPolicy") or {}
    if asked is None:
        default = _quantity(policy.get("default"))
        return default if default is not None else _quantity(capacity.get("value")) or Decimal(0)
    value = _quantity(asked) or Decimal(0)
    valid_range = policy.get("validRange") or {}
    low = _quantity(valid_range.get("min"))
    if low is not None:
        if value < low:
            return low
        step = _quantity(valid_range.get("step"))
        if step:
            return low + ((value - low) / step).to_integral_value(ROUND_CEILING) * step
        return value
    for candidate in (_quantity(v) for v in policy.get("validValues") or []):
        if candidate is not None and value <= candidate:
            return candidate
    return value


def policy_refuses(amount: Decimal, capacity: Obj, binary: bool) -> str | None:
    """What the capacity's request policy says against consuming ``amount`` (violatesPolicy), or None."""
    policy = capacity.get("requestPolicy") or {}
    if not policy or amount == _quantity(policy.get("default")):
        return None
    valid_range = policy.get("validRange")
    if valid_range:
        high, low, step = (_quantity(valid_range.get(k)) for k in ("max", "min", "step"))
        if high is not None and amount > high:
            return f"at most {show(high, binary)}"
        if step and low is not None and (amount - low) % step:
            return f"multiples of {show(step, binary)} from {show(low, binary)}"
        return None
    values = [v for v in (_quantity(raw) for raw in policy.get("validValues") or []) if v is not None]
    if values and amount not in values:
        return "one of " + ", ".join(show(v, binary) for v in values)
    return None


def capacity_rooms(node: str, device: Device, asked: Mapping[str, str], held: Holdings) -> list[Room]:
    """Each capacity of ``device`` against a request asking ``asked`` (``capacity.requests``),
    with what the shares other claims hold of it (CmpRequestOverCapacity)."""
    capacities: Mapping[str, Obj] = device.spec.get("capacity") or {}
    missing = sorted(set(asked) - set(capacities))
    if missing:
        return [Room(node, device.label, "capacity", name, False,
                     reason=f"has no capacity {name}, which the request asks for") for name in missing]
    others = held.consumed(device.id)
    rooms = []
    for name, capacity in sorted(capacities.items()):
        binary = str(capacity.get("value", "")).endswith("i")
        total = _quantity(capacity.get("value")) or Decimal(0)
        amount = consumed(asked.get(name), capacity)
        holding = others.get(name, Decimal(0))
        holders = {share.claim: show(share.consumed[name], binary)
                   for share in held.shares.get(device.id, []) if name in share.consumed}
        room = Room(node, device.label, "capacity", name, holding + amount <= total, total=show(total, binary),
                    held=show(holding, binary), left=show(total - holding, binary), asks=show(amount, binary),
                    holders=holders)
        refusal = policy_refuses(amount, capacity, binary)
        if refusal is not None:
            room.fits = False
            room.reason = (f"cannot give the {show(amount, binary)} {name} the request asks: its request policy "
                           f"allows {refusal}")
        rooms.append(room)
    return rooms


def counter_rooms(node: str, device: Device, sets: CounterSets | None) -> list[Room]:
    """Each counter ``device`` consumes (``consumesCounters``) against what allocated devices leave
    of its pool's counter set."""
    rooms = []
    for consumption in device.spec.get("consumesCounters") or []:
        set_name = str(consumption.get("counterSet"))
        counters = (sets or {}).get(set_name)
        for name, need in sorted((consumption.get("counters") or {}).items()):
            counter = (counters or {}).get(name)
            if counter is None:
                rooms.append(Room(node, device.label, "counter", f"{set_name}/{name}", False, pool=device.pool,
                                  reason=f"consumes counter {name} of counter set {set_name}, which its pool lacks"))
                continue
            amount = _quantity(need.get("value")) or Decimal(0)
            rooms.append(Room(node, device.label, "counter", f"{set_name}/{name}", amount <= counter.left,
                              total=show(counter.total, counter.binary),
                              held=show(counter.total - counter.left, counter.binary),
                              left=show(counter.left, counter.binary), asks=show(amount, counter.binary),
                              pool=device.pool))
    return rooms
