"""The chaos run's fault schedule: pure, and the same for the same seed (CHAOS_SEED reproduces a run's
faults: which, where, with which signal, and when they are due).

Fault kinds (docs/chaos.md says what each does to the local cluster):

* ``apiserver``: kube-apiserver stopped and started again in place (same port, same etcd);
* ``etcd``: etcd stopped and started again in place (same data directory);
* ``agent``: one node's ``gpudra agent`` SIGKILLed, then started again as its DaemonSet would;
* ``operator``: one operator replica SIGKILLed, then started again as its Deployment would;
* ``kubelet``: one node's kubelet stopped and started again: on a real node the kubelet process
  (SIGTERM or SIGKILL, then started on the same state directories), on another the stand-in (it
  registers with the agent anew and forgets what it had in memory, as a restarted kubelet).

The guaranteed agent and kubelet faults (one of each kind comes in every run) hit a real node when
there is one: the short run of ``make test`` then always restarts the real kubelet and SIGKILLs the
agent it calls."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

APISERVER, ETCD, AGENT, OPERATOR, KUBELET = "apiserver", "etcd", "agent", "operator", "kubelet"
FAULT_KINDS = (APISERVER, ETCD, AGENT, OPERATOR, KUBELET)
# The control plane's components are stopped either way a node loses them: SIGTERM (an upgrade, a
# drained control-plane node) or SIGKILL (OOM, a crash). The agents and the operator are SIGKILLed.
SIGNALS = ("SIGTERM", "SIGKILL")


@dataclass(frozen=True)
class Fault:
    at: float  # seconds after the chaos began when it is due (it waits for the one before it)
    kind: str
    target: str | None  # the node (agent, kubelet) or the replica's index (operator); None: the control plane's
    signal: str

    def describe(self) -> str:
        where = f" {self.target}" if self.target is not None else ""
        return f"t+{self.at:.1f}s {self.kind}{where} ({self.signal})"


def make_schedule(seed: int, duration: float, *, nodes: Sequence[str], replicas: int, mean_gap: float,
                  real_nodes: Sequence[str] = (), guaranteed: Sequence[str] = FAULT_KINDS, warmup: float = 5.0,
                  cooldown: float = 5.0, min_gap: float = 2.0) -> list[Fault]:
    """Faults due in ``[warmup, duration - cooldown]``, at least ``min_gap`` apart, sorted by time.

    Each kind of ``guaranteed`` comes once, in a shuffled order, one per equal slot of the window
    (so a short run still has every kind, spread over it); then more of random kinds come with
    exponential gaps of mean ``mean_gap`` (a Poisson process). ``mean_gap`` of 0: only the
    guaranteed ones. The window must hold the guaranteed faults ``min_gap`` apart. The guaranteed
    agent and kubelet faults hit one of ``real_nodes`` (of ``nodes``) when there are any."""
    if not nodes:
        raise ValueError("a chaos schedule needs at least one node")
    strangers = sorted(set(real_nodes) - set(nodes))
    if strangers:
        raise ValueError(f"real node(s) {', '.join(strangers)} not among the nodes {', '.join(nodes)}")
    if replicas < 1:
        raise ValueError("a chaos schedule needs at least one operator replica")
    unknown = sorted(set(guaranteed) - set(FAULT_KINDS))
    if unknown:
        raise ValueError(f"unknown fault kind(s) {', '.join(unknown)}; known: {', '.join(FAULT_KINDS)}")
    start, end = warmup, duration - cooldown
    if end - start < min_gap * max(len(guaranteed), 1):
        raise ValueError(f"a chaos run of {duration:g}s has no room for {len(guaranteed)} faults "
                         f"{min_gap:g}s apart after {warmup:g}s of warm-up and before {cooldown:g}s of cool-down")
    rng = random.Random(seed)
    times: list[tuple[float, str, bool]] = []  # (due, kind, guaranteed)
    order = list(guaranteed)
    rng.shuffle(order)
    slot = (end - start) / max(len(order), 1)
    for i, kind in enumerate(order):
        # anywhere in its slot but its last min_gap, so consecutive slots keep them apart
        times.append((start + i * slot + rng.uniform(0, max(slot - min_gap, 0)), kind, True))
    if mean_gap > 0:
        at = start
        while True:
            at += rng.expovariate(1 / mean_gap)
            if at > end:
                break
            kind = rng.choice(FAULT_KINDS)
            if all(abs(at - other) >= min_gap for other, _, _ in times):  # else it is dropped
                times.append((at, kind, False))
    faults = []
    for at, kind, sure in sorted(times):
        target = _target(rng, kind, real_nodes if sure and real_nodes else nodes, replicas)
        faults.append(Fault(round(at, 3), kind, target, _signal(rng, kind, real=target in real_nodes)))
    return faults


def _target(rng: random.Random, kind: str, nodes: Sequence[str], replicas: int) -> str | None:
    if kind in (AGENT, KUBELET):
        return rng.choice(list(nodes))
    if kind == OPERATOR:
        return str(rng.randrange(replicas))
    return None


def _signal(rng: random.Random, kind: str, *, real: bool) -> str:
    """The control plane and a real kubelet: either signal; the agents and the operator: SIGKILL;
    a kubelet stand-in is restarted (it is a task of the run, no process)."""
    if kind in (APISERVER, ETCD) or (kind == KUBELET and real):
        return rng.choice(SIGNALS)
    return "SIGKILL" if kind in (AGENT, OPERATOR) else "restart"


def counts_by_kind(faults: Sequence[Fault]) -> dict[str, int]:
    """How many faults of each kind (every kind named, zero included), in FAULT_KINDS order."""
    return {kind: sum(1 for f in faults if f.kind == kind) for kind in FAULT_KINDS}
