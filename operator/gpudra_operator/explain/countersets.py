"""Who holds a counter set of partitionable devices, and what is left of it, for a claim short of
counters: the devices allocated from the set (on a dynamic MIG GPU, the placements taken), the
claims holding them, and each counter's remainder, with a run of one-unit counters of one kind
(``memory-slice-0`` .. ``memory-slice-7``) summarised as ranges taken and free.

Counted as the allocator counts (checkAvailableCounters in k8s.io/dynamic-resource-allocation
structured): a device of the pool's newest slices consumes its counters once while any claim holds
it, whole or as a share; an ``adminAccess`` result holds nothing (so :func:`~.inventory.holdings`
gathers it). Names come from claims, which tenants write: what is shown is bounded in number and
length."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gpudra_core.quantity import quantity_value
from gpudra_operator.explain.inventory import Counter, Holdings, Obj
from gpudra_operator.explain.room import show

MAX_TAKEN = 32  # devices listed per counter set (-o yaml); the rest are counted
MAX_CLAIMS = 4  # claims listed per device (shares of one device)
MAX_NAME = 120  # characters of a claim's or a device's name shown
_INDEXED = re.compile(r"^(?P<base>.+)-(?P<index>\d{1,4})$")


@dataclass(frozen=True)
class Left:
    """What is left of one counter of the set, as a quantity people read (``0``, ``20Gi``)."""

    total: str
    left: str


@dataclass
class Taken:
    """A device allocated from the counter set and the claims holding it (several: shares)."""

    device: str
    claims: list[str]
    more_claims: int = 0


@dataclass
class CounterSetUse:
    """One counter set a request found short, as the allocator saw it."""

    pool: str
    name: str
    node: str | None  # the node its slice is for, if the slice names one
    counters: dict[str, Left]
    short: list[str]  # the counters the request's devices found short
    taken: list[Taken] = field(default_factory=list)  # in the order of the unit counters they take
    more_taken: int = 0

    def describe(self, *, every_counter: bool = True, holders: int = 8) -> str:
        """``counter set gpu-0-counters on node-a: compute-slices 0 of 7 left; memory slices 0-6
        taken, 7 free; held by ns/a (gpu-0-mig-4g40gb-at0), ...``; ``every_counter`` False names
        only the short counters besides the unit runs."""
        where = f"on {self.node}" if self.node else f"of pool {self.pool}"
        runs = unit_runs(self.counters)
        in_runs = {name for members in runs.values() for name in members.values()}
        named = [n for n in sorted(self.counters) if n not in in_runs and (every_counter or n in self.short)]
        parts = []
        if named:
            parts.append(", ".join(f"{n} {self.counters[n].left} of {self.counters[n].total}" for n in named) + " left")
        for base, members in sorted(runs.items()):
            taken = [i for i, name in members.items() if _spent(self.counters[name])]
            free = [i for i in members if i not in taken]
            parts.append(f"{_plural(base)} " + ", ".join(
                f"{ranges(group)} {state}" for group, state in ((taken, "taken"), (free, "free")) if group))
        parts.append(_holders(self.taken, self.more_taken, holders))
        return f"counter set {self.name} {where}: " + "; ".join(parts)


def _spent(counter: Left) -> bool:
    left = quantity_value(counter.left)
    return left is None or left <= 0


def _plural(base: str) -> str:
    words = base.replace("-", " ")
    return words if words.endswith("s") else words + "s"


def _holders(taken: Sequence[Taken], more: int, limit: int) -> str:
    if not taken:
        return "nothing allocated from it"
    shown = [f"{', '.join(t.claims)}{f' and {t.more_claims} more' if t.more_claims else ''} ({t.device})"
             for t in taken[:limit]]
    rest = len(taken) - len(shown) + more
    return "held by " + ", ".join(shown) + (f" and {rest} more" if rest else "")


def ranges(indices: Iterable[int]) -> str:
    """``0-3, 5 and 7-8`` for 0, 1, 2, 3, 5, 7, 8."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    texts = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    return " and ".join(filter(None, [", ".join(texts[:-1]), *texts[-1:]]))


def unit_runs(counters: Mapping[str, Left]) -> dict[str, dict[int, str]]:
    """The counters of one unit each that share a base name (``memory-slice`` of
    ``memory-slice-<k>``), by base: index -> counter name; a base with one member is no run."""
    runs: dict[str, dict[int, str]] = {}
    for name, counter in counters.items():
        match = _INDEXED.match(name)
        if match and quantity_value(counter.total) == 1:
            runs.setdefault(match["base"], {})[int(match["index"])] = name
    return {base: dict(sorted(members.items())) for base, members in runs.items() if len(members) > 1}


def clip(text: str) -> str:
    return text if len(text) <= MAX_NAME else text[:MAX_NAME - 1] + "…"


def counter_set_use(driver: str, pool: str, name: str, slices: Sequence[Obj], counters: Mapping[str, Counter],
                    held: Holdings, short: Sequence[str] = ()) -> CounterSetUse:
    """Counter set ``name`` of ``pool`` (its newest ``slices``): ``counters`` as
    :func:`~.inventory.counters_left` left them, and the devices allocated from it by ``held``."""
    left = {n: Left(show(c.total, c.binary), show(c.left, c.binary)) for n, c in counters.items()}
    position = {counter: index for members in unit_runs(left).values() for index, counter in members.items()}
    node = None
    found: list[tuple[tuple[float, str], Taken]] = []
    for slice_ in slices:
        spec = slice_.get("spec") or {}
        if any(s.get("name") == name for s in spec.get("sharedCounters") or []):
            node = spec.get("nodeName") or None
        for device in spec.get("devices") or []:
            draws = [c for c in device.get("consumesCounters") or [] if c.get("counterSet") == name]
            device_id = (driver, pool, str(device.get("name")))
            if not draws or not held.allocated(device_id):
                continue
            claims = ([held.whole[device_id]] if device_id in held.whole
                      else list(dict.fromkeys(s.claim for s in held.shares.get(device_id, []))))
            first = min((position[c] for d in draws for c in d.get("counters") or {} if c in position),
                        default=float("inf"))
            found.append(((first, device_id[2]), Taken(clip(device_id[2]), [clip(c) for c in claims[:MAX_CLAIMS]],
                                                      max(0, len(claims) - MAX_CLAIMS))))
    found.sort(key=lambda entry: entry[0])
    return CounterSetUse(pool=pool, name=name, node=node, counters=left, short=list(short),
                         taken=[t for _, t in found[:MAX_TAKEN]], more_taken=max(0, len(found) - MAX_TAKEN))
