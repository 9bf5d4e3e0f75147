"""The client of gpudra-allocator (operator/gpudra-allocator): the helper program that runs
Kubernetes' own DRA allocator and DRA CEL (k8s.io/dynamic-resource-allocation) of one release,
so that `gpudra explain` and the operator's class counts answer as the cluster's scheduler does.

One binary per supported release, ``gpudra-allocator-1.<minor>``, in ``$GPUDRA_ALLOCATOR_DIR`` (a
source checkout: ``hack/allocator-bin.sh`` builds them) or else in this package's ``bin/`` (the
wheel and the operator image carry them). A cluster newer than the newest binary is answered by
the newest, older than the oldest by the oldest, each with a note that says so.

One process per :class:`AllocatorHelper`, JSON lines over its stdin and stdout, one request at a
time; every request has a deadline (the helper's own, and this side's a little later), and a
helper that dies or stops answering is killed and started afresh on the next request."""

from __future__ import annotations

import asyncio
import collections
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Obj = dict[str, Any]

DIRECTORY_ENV = "GPUDRA_ALLOCATOR_DIR"
PACKAGED = Path(__file__).resolve().parent / "bin"
PREFIX = "gpudra-allocator-1."
DEFAULT_TIMEOUT = 60.0  # seconds a request may take in the helper
GRACE = 5.0  # this side waits that much longer before it kills the helper
STREAM_LIMIT = 1 << 30  # the longest answer line read (a 5,000-node allocation is a few MB)


class AllocatorUnavailable(RuntimeError):
    """No gpudra-allocator binary here: the message says how to get one."""


class AllocatorError(RuntimeError):
    """The helper refused a request (its message), or died, or missed its deadline."""


def directory() -> Path:
    given = os.environ.get(DIRECTORY_ENV)
    return Path(given) if given else PACKAGED


def available_minors(where: Path | None = None) -> list[int]:
    """The releases (1.<minor>) with a runnable binary in ``where``, oldest first."""
    where = directory() if where is None else where
    minors = []
    for path in where.glob(f"{PREFIX}*") if where.is_dir() else ():
        suffix = path.name.removeprefix(PREFIX)
        if suffix.isdigit() and os.access(path, os.X_OK):
            minors.append(int(suffix))
    return sorted(minors)


@dataclass(frozen=True)
class Choice:
    path: Path
    minor: int
    note: str | None  # set when the cluster's release is not the helper's


def choose(server_minor: int | None, where: Path | None = None) -> Choice:
    """The binary for a cluster of Kubernetes 1.<server_minor> (None: the oldest supported)."""
    where = directory() if where is None else where
    minors = available_minors(where)
    if not minors:
        source = f"${DIRECTORY_ENV}={where}" if os.environ.get(DIRECTORY_ENV) else f"{where} (the package's)"
        raise AllocatorUnavailable(
            f"gpudra-allocator (Kubernetes' own DRA allocator, which explain and the class counts run) is not "
            f"installed: no {PREFIX}<minor> in {source}. Install a gpudra wheel built for this platform, or in "
            f"a source checkout build it: hack/allocator-bin.sh (then export {DIRECTORY_ENV}=<the directory it "
            "prints>)")
    if server_minor is None:
        return Choice(where / f"{PREFIX}{minors[0]}", minors[0], None)
    if server_minor in minors:
        return Choice(where / f"{PREFIX}{server_minor}", server_minor, None)
    chosen = minors[-1] if server_minor > minors[-1] else minors[0]
    newer = server_minor > chosen
    return Choice(where / f"{PREFIX}{chosen}", chosen,
                  f"the cluster runs Kubernetes 1.{server_minor}; gpudra has no allocator of that release and "
                  f"answers with 1.{chosen}'s" + (", which may not know features the cluster's scheduler has"
                                                   if newer else ""))


@dataclass(frozen=True)
class Compiled:
    """A selector as the API server judges it when stored: its compile error, its estimated cost."""

    error: str | None
    max_cost: int


@dataclass(frozen=True)
class Outcome:
    """One selector on one device, as the allocator runs it."""

    matches: bool
    error: str | None
    actual_cost: int | None


@dataclass(frozen=True)
class NodeOutcome:
    """The allocator on one node: one AllocationResult per claim when they fit, else None; or the
    error that stops the scheduler (on every node)."""

    name: str
    results: list[Obj] | None
    error: str | None


@dataclass(frozen=True)
class ExtendedNode:
    """What kube-scheduler's Filter makes of the pod's extended resources on one node: the index of
    the claim variant to allocate there; None when device plugins serve them all there (its
    NodeResourcesFit decides); or why the pod cannot go there at all (``unschedulable``)."""

    name: str
    variant: int | None
    unschedulable: str | None


@dataclass(frozen=True)
class ExtendedPlan:
    """The claim kube-scheduler builds for a pod's extended resources that DeviceClasses map to DRA
    devices (KEP-5004), as the helper's ``extended`` answers it."""

    resources: dict[str, int]  # resource -> amount the pod asks (only those a class maps)
    classes: dict[str, str]  # resource -> the DeviceClass that maps it
    prior: str | None  # the claim an earlier scheduling attempt created, if any
    variants: list[Obj]  # {"requests": [DeviceRequest], "mappings": [ContainerExtendedResourceRequest]}
    nodes: list[ExtendedNode]


class AllocatorHelper:
    """One gpudra-allocator process for a cluster's release; use ``async with``."""

    def __init__(self, server_minor: int | None = None, *, feature_gates: Mapping[str, bool] | None = None,
                 timeout: float = DEFAULT_TIMEOUT, where: Path | None = None, idle_close: float | None = None,
                 filter_timeout: float | None = None) -> None:
        """``filter_timeout``: the seconds kube-scheduler's DynamicResources Filter gives one node
        (its ``filterTimeout`` argument); None: the release's default (10 s where the
        DRASchedulerFilterTimeout gate is on), 0: none."""
        self.choice = choose(server_minor, where)
        self.feature_gates = dict(feature_gates or {})
        self.filter_timeout = filter_timeout
        self.timeout = timeout
        self.idle_close = idle_close
        self._idle: asyncio.TimerHandle | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._stderr: collections.deque[str] = collections.deque(maxlen=20)
        self._stderr_task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    @property
    def note(self) -> str | None:
        return self.choice.note

    async def __aenter__(self) -> AllocatorHelper:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _start(self) -> asyncio.subprocess.Process:
        process = await asyncio.create_subprocess_exec(
            str(self.choice.path), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, limit=STREAM_LIMIT)
        self._stderr_task = asyncio.create_task(self._drain(process), name="gpudra-allocator stderr")
        return process

    async def _drain(self, process: asyncio.subprocess.Process) -> None:
        assert process.stderr is not None
        async for line in process.stderr:
            self._stderr.append(line.decode(errors="replace").rstrip())

    def _abandon(self) -> None:
        """Kill the helper now, without waiting (a cancelled request's caller cannot wait)."""
        process, self._process = self._process, None
        if process is not None and process.returncode is None:
            process.kill()

    def _arm_idle_close(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        if self.idle_close is not None:
            self._idle = asyncio.get_running_loop().call_later(self.idle_close, self._close_if_idle)

    def _close_if_idle(self) -> None:
        if not self._lock.locked():
            self._abandon()

    async def close(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        process, self._process = self._process, None
        if process is None:
            return
        if process.returncode is None:
            process.kill()
        await process.wait()
        if self._stderr_task is not None:
            await asyncio.gather(self._stderr_task, return_exceptions=True)

    async def ask(self, request: Obj, timeout: float | None = None) -> Obj:
        """One request (``op`` and its fields) answered; :class:`AllocatorError` when refused."""
        timeout = self.timeout if timeout is None else timeout
        filter_timeout = 0 if self.filter_timeout is None else (self.filter_timeout or -1)
        line = json.dumps({**request, "featureGates": self.feature_gates, "timeoutSeconds": timeout,
                           "filterTimeoutSeconds": filter_timeout}, separators=(",", ":")).encode() + b"\n"
        async with self._lock:
            if self._process is None or self._process.returncode is not None:
                self._process = await self._start()
            process = self._process
            assert process.stdin is not None and process.stdout is not None
            try:
                process.stdin.write(line)
                await asyncio.wait_for(process.stdin.drain(), timeout + GRACE)
                reply = await asyncio.wait_for(process.stdout.readline(), timeout + GRACE)
            except (TimeoutError, ConnectionError, ValueError) as error:
                await self.close()
                raise AllocatorError(f"gpudra-allocator {self.choice.minor} did not answer within {timeout + GRACE:.0f} s"
                                     if isinstance(error, TimeoutError) else f"gpudra-allocator failed: {error}") from None
            except asyncio.CancelledError:
                self._abandon()
                raise
            if not reply:
                await self.close()
                raise AllocatorError(f"gpudra-allocator {self.choice.minor} exited: " + " | ".join(self._stderr))
            self._arm_idle_close()
        answer: Obj = json.loads(reply)
        if answer.get("error"):
            raise AllocatorError(str(answer["error"]))
        return answer

    async def features(self) -> Obj:
        """``release``, ``defaults`` and ``gates`` (those in effect) of the helper."""
        return await self.ask({"op": "features"})

    async def compile(self, expressions: Sequence[str]) -> tuple[list[Compiled], int]:
        """Each selector as the API server judges it when stored, and the cost limit."""
        answer = await self.ask({"op": "compile", "expressions": list(expressions)})
        return [Compiled(c.get("error"), int(c.get("maxCost") or 0)) for c in answer.get("compile") or []], \
            int(answer.get("costLimit") or 0)

    async def match(self, expressions: Sequence[str],
                    devices: Sequence[tuple[str, Obj]]) -> tuple[list[Compiled], list[list[Outcome]]]:
        """Each selector on each (driver, ResourceSlice device), as the allocator runs it."""
        answer = await self.ask({"op": "match", "expressions": list(expressions),
                                 "devices": [{"driver": d, "device": device} for d, device in devices]})
        compiled = [Compiled(c.get("error"), int(c.get("maxCost") or 0)) for c in answer.get("compile") or []]
        rows = answer.get("results") or []
        return compiled, [[Outcome(bool(o.get("matches")), o.get("error"), o.get("actualCost")) for o in row]
                          for row in rows]

    async def extended(self, *, pod: Obj, classes: Sequence[Obj], claims: Sequence[Obj],
                       nodes: Sequence[Obj]) -> ExtendedPlan | None:
        """The claim the scheduler builds for ``pod``'s extended resources on each of ``nodes``
        (their allocatable says what device plugins serve), from the DeviceClasses that map them
        (``classes``: all of the cluster's); ``claims``: the namespace's claims that carry the
        extended-resource-claim annotation. None when the release's DRAExtendedResource gate is
        off or no class maps the pod's extended resources."""
        answer = await self.ask({"op": "extended", "pod": pod, "classes": list(classes), "claims": list(claims),
                                 "nodes": [{"metadata": n.get("metadata") or {},
                                            "status": {"allocatable": (n.get("status") or {}).get("allocatable") or {}}}
                                           for n in nodes]})
        plan = answer.get("extended")
        if plan is None:
            return None
        return ExtendedPlan(resources={str(k): int(v) for k, v in (plan.get("resources") or {}).items()},
                            classes={str(k): str(v) for k, v in (plan.get("classes") or {}).items()},
                            prior=plan.get("prior"), variants=list(plan.get("variants") or []),
                            nodes=[ExtendedNode(str(n.get("name")), n.get("variant"), n.get("unschedulable"))
                                   for n in plan.get("nodes") or []])

    async def allocate(self, *, classes: Sequence[Obj], slices: Sequence[Obj], allocated_claims: Sequence[Obj],
                       claims: Sequence[Obj], nodes: Sequence[Obj],
                       device_taint_rules: Sequence[Obj] = (), pod: Obj | None = None,
                       extended_claims: Sequence[Obj] = (), node_extended: Sequence[int] = ()) -> list[NodeOutcome]:
        """The release's allocator on each node, for ``claims`` (not allocated yet) against what
        ``allocated_claims`` hold, in ``nodes``' order. With ``pod``, ``extended_claims`` (variants
        from :meth:`extended`: their requests) and ``node_extended`` (per node, a variant's index
        or -1), each node's variant of the pod's extended-resource claim is allocated after
        ``claims``, as the scheduler does."""
        request: Obj = {"op": "allocate", "classes": list(classes), "slices": list(slices),
                        "allocatedClaims": list(allocated_claims), "claims": list(claims),
                        "nodes": [{"metadata": n.get("metadata") or {}} for n in nodes],
                        "deviceTaintRules": list(device_taint_rules)}
        if pod is not None:
            request.update(pod=pod, extendedClaims=[{"requests": c.get("requests") or []} for c in extended_claims],
                           nodeExtended=list(node_extended))
        answer = await self.ask(request)
        return [NodeOutcome(str(n.get("name")), n.get("results"), n.get("error")) for n in answer.get("nodes") or []]
