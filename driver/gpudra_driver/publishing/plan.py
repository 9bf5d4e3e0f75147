"""What to write so the API server holds exactly this node's pool: the pure half of publishing.

The rule follows the upstream resourceslice controller: when the observed slices already are the
desired ones, write nothing; otherwise bump the pool generation above every generation seen,
delete the slices that no longer belong (with uid and resourceVersion preconditions) and apply
the desired slices under their stable names. The scheduler only trusts a pool whose slices all
carry the newest generation, so a half-written update is never mistaken for a whole one."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpudra_core.devicemodel import Device
from gpudra_core.diff import contains
from gpudra_driver.publishing.slices import build_slices

Obj = dict[str, Any]


@dataclass(frozen=True)
class SliceRef:
    name: str
    uid: str
    resource_version: str


@dataclass(frozen=True)
class PublishPlan:
    generation: int
    apply: list[Obj] = field(default_factory=list)
    delete: list[SliceRef] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.apply and not self.delete


def matches(live: Obj, desired: Obj) -> bool:
    """True when ``live`` already is ``desired``: our labels and owner present (others may add
    labels and annotations) and every spec field we write exactly equal. Equality, not a subset:
    the device list is atomic, so an attribute or capacity someone added to one of our devices is
    a foreign edit that an apply of ours removes."""
    meta, live_meta = desired["metadata"], live.get("metadata") or {}
    if not contains(live_meta, {k: meta[k] for k in ("labels", "ownerReferences") if k in meta}):
        return False
    spec, live_spec = desired["spec"], live.get("spec") or {}
    return (all(live_spec.get(k) == v for k, v in spec.items())
            and ("devices" in live_spec) == ("devices" in spec))


def plan_publish(driver: str, node_name: str, node_uid: str, devices: Iterable[Device],
                 observed: Mapping[str, Obj], last_generation: int = 0) -> PublishPlan:
    """``observed``: every slice of ``driver`` on ``node_name`` by name (from a list or a watch).
    ``last_generation``: the highest generation this publisher wrote; a republish always goes
    above it, so a restored pool never repeats a generation that caches may still hold."""
    devices = list(devices)
    generations = [int(s["spec"]["pool"].get("generation", 0)) for s in observed.values()
                   if s["spec"].get("pool", {}).get("name") == node_name]
    current = max(generations, default=0)
    if current and current >= last_generation:
        desired = build_slices(driver, node_name, node_uid, current, devices)
        if len(desired) == len(observed) and all(
            d["metadata"]["name"] in observed and matches(observed[d["metadata"]["name"]], d)
            for d in desired
        ):
            return PublishPlan(current)
    generation = max(current, last_generation) + 1
    desired = build_slices(driver, node_name, node_uid, generation, devices)
    keep = {d["metadata"]["name"] for d in desired}
    obsolete = [SliceRef(name, s["metadata"]["uid"], s["metadata"]["resourceVersion"])
                for name, s in sorted(observed.items()) if name not in keep]
    return PublishPlan(generation, apply=desired, delete=obsolete)
