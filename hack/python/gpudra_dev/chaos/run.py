"""The chaos run: a local GPU cluster under load and faults, with its invariants checked throughout
and at the end (docs/chaos.md).

What is real: etcd, kube-apiserver, kube-controller-manager and kube-scheduler (processes of their
own, restarted in place), the operator (two replicas electing a leader), one ``gpudra agent`` and
one MPS supervisor per node (host processes on a fake driver root, the real pynvml on the mock
libnvidia-ml, the mock MPS control daemon), and ``real_nodes`` whole nodes (:mod:`.realnode`): the
release's kubelet on containerd + runc, running the pods' containers with their GPUs injected by
CDI, restarted as a process. What stands in on the other nodes: the Nodes (API objects without a
kubelet) and their kubelets (:mod:`.kubelet`: the kubelet's gRPC calls into the agents, pod status,
no containers). The agents and supervisors run as processes that the run restarts where a DaemonSet
would, with the flags the operator renders for them.

The workload keeps at most one unit per GPU alive, so every pod can run: ``plain`` (a claim from a
template, one GPU), ``shared`` (one ResourceClaim, two pods), ``mps`` (one ResourceClaim with MPS
sharing, two pods) and ``consumable`` (a claim from a template asking 4Gi of a shared GPU)."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import yaml

from gpudra_core.kubeapi import Kube, Obj, connect, is_status, resource_type
from gpudra_core.quantity import parse_quantity
from gpudra_driver.plugin.checkpoint import COMPLETED, decode
from gpudra_driver.plugin.plugin import socket_paths
from gpudra_driver.plugin.state import CHECKPOINT_FILE
from gpudra_operator.leaderelection import LOST_LEASE_EXIT
from gpudra_operator.render import sharing_args
from gpudra_operator.spec import SharingSpec
from gpudra_dev.localcluster import mockstate
from gpudra_dev.localcluster.agents import AgentProcess, start_agent, start_mps_supervisor
from gpudra_dev.localcluster.controlplane import ControlPlane, find_binaries
from gpudra_dev.localcluster.fakedriverroot import make_driver_root, make_pci_sysfs
from gpudra_dev.localcluster.gpucluster import GPU_NODE_LABELS
from gpudra_dev.localcluster.kubelet_sim import running_status
from gpudra_dev.localcluster.objects import create_fake_node, install_crd
from gpudra_dev.localcluster.replicas import Replica, Replicas
from gpudra_dev.localcluster.waiting import ConditionTimeout, wait_for

from . import invariants as inv
from .kubelet import KubeletStats, NodeKubelet, allocated_devices, claim_names
from .realnode import RealNode, container_spec, parse_output, pod_tolerations
from .schedule import AGENT, APISERVER, ETCD, FAULT_KINDS, KUBELET, OPERATOR, Fault, counts_by_kind, make_schedule

REPO = Path(__file__).resolve().parents[4]
SAMPLE_CONFIG = REPO / "manifests" / "samples" / "gpudraconfig-sharing.yaml"
PROFILES = REPO / "driver" / "gpudra_driver" / "profiles"
POD = resource_type("v1", "Pod")
CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")
TEMPLATE = resource_type("resource.k8s.io/v1", "ResourceClaimTemplate")
SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
CONFIG = resource_type("gpudra.io/v1alpha1", "GpuDraConfig")
NAMESPACE = resource_type("v1", "Namespace")
SERVICE_ACCOUNT = resource_type("v1", "ServiceAccount")
AGENT_NAMESPACE = "gpudra-system"
WORKLOAD_NAMESPACE = "chaos"
UNIT_KINDS = ("plain", "shared", "mps", "consumable")
CLAIM_UID = re.compile(r"claim_([0-9a-f-]{36})\.json$")
REGISTERED = "registered with the kubelet as"  # what the agent logs each time a kubelet registers it
log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Settings:
    seed: int
    duration: float  # seconds of faults and load; setup and the final checks come on top
    nodes: int = 3
    real_nodes: int = 1  # of ``nodes``: the real kubelet on containerd + runc (the others: stand-ins)
    profile: str = "l4x2"
    replicas: int = 2
    mean_gap: float = 20.0  # mean seconds between the faults beyond one of each kind (0: none)
    pod_deadline: float = 150.0  # longest a pod may wait to run while faults go on
    orphan_grace: float = 90.0  # longest a CDI spec, checkpoint entry or MPS daemon may outlive its claim
    settle_timeout: float = 180.0  # the final checks' deadline, after the last fault


@dataclass
class FaultRecord:
    fault: Fault
    started: float
    done: float | None = None
    error: str | None = None


def _outcome(record: FaultRecord) -> str:
    if record.error:
        return f"failed: {record.error}"
    return f"back in {record.done - record.started:.1f}s" if record.done is not None else "not injected"


@dataclass
class RealNodeStats:
    """One real node's share of the run, seen from outside (its kubelet's calls are its own)."""
    pods_run: int = 0  # pods whose container ran and showed exactly its claims' GPUs, injected by CDI
    claims_prepared: set[str] = field(default_factory=set)  # UIDs seen PrepareCompleted in its checkpoint
    claims_unprepared: set[str] = field(default_factory=set)  # of those, UIDs whose entry went away
    kubelet_restarts: int = 0


@dataclass
class Report:
    settings: Settings
    faults: list[FaultRecord] = field(default_factory=list)
    pods_created: int = 0
    pods_run: int = 0
    pods_deleted: int = 0
    units: dict[str, int] = field(default_factory=lambda: dict.fromkeys(UNIT_KINDS, 0))
    kubelets: dict[str, KubeletStats] = field(default_factory=dict)  # the stand-ins'
    real_nodes: dict[str, RealNodeStats] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    # Processes that exited without a fault, restarted as their controller would: an operator
    # replica fenced off by its Lease (exit 3, by design) and anything else (a crash).
    exits: list[str] = field(default_factory=list)
    longest_not_ready: float = 0.0  # the longest stretch the config was not Ready after it first was
    ready_after_chaos: float | None = None  # seconds from the end of the chaos to the config Ready
    checks: int = 0
    wall: float = 0.0

    def render(self) -> str:
        done = [r for r in self.faults if r.done is not None]
        kinds = counts_by_kind([r.fault for r in done])
        stats = list(self.kubelets.values())
        lines = [
            f"chaos run: seed {self.settings.seed} (reproduce: CHAOS_SEED={self.settings.seed} "
            f"CHAOS_DURATION={self.settings.duration:g} make chaos), {self.settings.nodes} nodes x "
            f"{self.settings.profile} ({len(self.real_nodes)} real), {self.settings.replicas} operator replicas, "
            f"{self.wall:.0f}s wall",
            f"faults injected: {len(done)} ({', '.join(f'{k} {n}' for k, n in kinds.items())})",
            *(f"  {r.fault.describe()}: {_outcome(r)}" for r in self.faults),
            f"units created: {sum(self.units.values())} ({', '.join(f'{k} {n}' for k, n in self.units.items())})",
            f"pods: {self.pods_created} created, {self.pods_run} run, {self.pods_deleted} deleted",
            *(f"real node {name} (kubelet, containerd, runc): {r.pods_run} pods ran with their claims' GPUs "
              f"injected by CDI; {len(r.claims_prepared)} claims prepared, {len(r.claims_unprepared)} unprepared; "
              f"kubelet restarted {r.kubelet_restarts} times" for name, r in self.real_nodes.items()),
            f"stand-in nodes' claims: {len(set().union(*(s.claims_prepared for s in stats)))} prepared, "
            f"{len(set().union(*(s.claims_unprepared for s in stats)))} unprepared; kubelet calls: "
            f"{sum(s.prepared for s in stats)} claims prepared, {sum(s.unprepared for s in stats)} unprepared, "
            f"{sum(s.prepare_errors for s in stats)} prepare and {sum(s.unprepare_errors for s in stats)} unprepare "
            f"errors retried, {sum(s.registrations for s in stats)} plugin registrations",
            f"invariant checks: {self.checks}; longest the config was not Ready: {self.longest_not_ready:.1f}s; "
            f"Ready {self.ready_after_chaos:.1f}s after the chaos" if self.ready_after_chaos is not None
            else f"invariant checks: {self.checks}; the config was not Ready after the chaos",
            f"exits without a fault (restarted): {len(self.exits)}",
            *(f"  {e}" for e in self.exits),
            f"invariant violations: {len(self.violations)}",
            *(f"  {v}" for v in self.violations),
        ]
        return "\n".join(lines)


@dataclass
class Node:
    name: str
    workdir: Path
    driver_root: Path
    sysfs: Path
    agent: AgentProcess
    supervisor: AgentProcess
    kubelet: asyncio.Task[None]  # the stand-in; on a real node, the task watching its pods
    real: RealNode | None = None
    kubelet_stopped: bool = False  # the real kubelet is down for a fault (not exited on its own)

    @property
    def kubelet_dir(self) -> Path:
        return self.workdir / "kubelet"

    @property
    def cdi_dir(self) -> Path:
        return self.workdir / "cdi"

    @property
    def ready_file(self) -> Path:
        return self.workdir / "agent-ready"


@dataclass
class Unit:
    kind: str
    name: str
    pods: list[str]
    claim: str | None  # the ResourceClaim the pods share (shared, mps)


def transient(error: BaseException) -> bool:
    """An API error a fault explains: the API server or etcd away, or overloaded while they return."""
    return (isinstance(error, (OSError, asyncio.TimeoutError, aiohttp.ClientError))
            or is_status(error, 429, 500, 502, 503, 504))


async def retrying(call: Callable[[], Awaitable[T]], what: str, timeout: float = 120.0) -> T:
    """``call`` again while it fails for a reason a fault explains, for up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except Exception as error:
            if not transient(error):
                raise
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{what}: still failing after {timeout:.0f}s: {error}") from error
            await asyncio.sleep(0.5)


class ChaosRun:
    def __init__(self, settings: Settings, say: Callable[[str], None] = print) -> None:
        self.settings = settings
        self.say = say
        self.report = Report(settings)
        self.rng = random.Random(settings.seed)  # the workload's choices (the faults have their own)
        self.driver = "gpu.gpudra.io"
        self.nodes: dict[str, Node] = {}
        self.pods: dict[str, inv.PodRecord] = {}  # pod name -> record
        self.units: dict[str, Unit] = {}
        self.replicas: list[Replica] = []
        self.capacities: dict[inv.Device, dict[str, int]] = {}
        self.hardware: dict[str, list[str]] = {}
        self.gpu_uuids: dict[str, list[str]] = {}  # node -> its GPUs' UUIDs, as published
        self.gpu_ids: dict[inv.Device, tuple[str, int]] = {}  # -> (UUID, minor), as published
        self._prepared_seen: dict[str, frozenset[str]] = {}  # real node -> claims PrepareCompleted last seen
        self.tracker = inv.OrphanTracker(settings.orphan_grace)
        self.violations: set[str] = set()
        self.started = time.monotonic()
        self._unit_counter = 0
        self._ready_since: float | None = None
        self._not_ready_since: float | None = None

    # --- the whole run --------------------------------------------------------------------
    async def run(self) -> Report:
        self.workdir = Path(tempfile.mkdtemp(prefix="gpudra-chaos-"))  # short: unix socket paths
        self.plane = ControlPlane(find_binaries(), self.workdir / "cluster",
                                  feature_gates=("DRAConsumableCapacity=true",))
        supervising = asyncio.Event()
        supervisor: asyncio.Task[None] | None = None
        try:
            await self._setup()
            supervisor = asyncio.create_task(self._supervise(supervising), name="process supervisor")
            await self._chaos()
            await self._settle()
            await self._drain()
        finally:
            supervising.set()
            if supervisor is not None:
                await asyncio.gather(supervisor, return_exceptions=True)
            await self._teardown()
            self.report.wall = time.monotonic() - self.started
            self.report.violations = sorted(self.violations)
        return self.report

    def _violate(self, violations: list[inv.Violation] | list[str]) -> None:
        for violation in violations:
            text = str(violation)
            if text not in self.violations:
                self.violations.add(text)
                self.say(f"VIOLATION {text}")

    # --- setup ----------------------------------------------------------------------------
    async def _setup(self) -> None:
        s = self.settings
        self.say(f"chaos seed {s.seed}, {s.duration:g}s of faults and load, workdir {self.workdir}")
        self.plane.start()  # from this (the main) thread: the components die with it, not with a worker
        self.api = await connect(str(self.plane.kubeconfig))
        self.kube = Kube(self.api, field_manager="gpudra-chaos")
        await install_crd(self.kube)
        for namespace in (AGENT_NAMESPACE, WORKLOAD_NAMESPACE):
            await self.kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        await self.kube.create({"apiVersion": "v1", "kind": "ServiceAccount",
                                "metadata": {"name": "gpudra-agent", "namespace": AGENT_NAMESPACE}})
        await wait_for(lambda: self.kube.get(SERVICE_ACCOUNT, "default", WORKLOAD_NAMESPACE), timeout=60,
                       what="the workload namespace's default ServiceAccount")
        config = yaml.safe_load(SAMPLE_CONFIG.read_text())
        sharing = SharingSpec.from_dict(config["spec"]["sharing"], "spec.sharing")
        self.agent_args = tuple(sharing_args(sharing.consumable_capacity))  # what the operator renders
        self.hardware_count = len(yaml.safe_load((PROFILES / f"{s.profile}.yaml").read_text())["gpus"])
        for i in range(s.nodes):
            if i < s.real_nodes:
                name = f"chaos-real-{i}"
                self.nodes[name] = await self._start_real_node(name)
            else:
                name = f"chaos-{i}"
                await create_fake_node(self.kube, name, GPU_NODE_LABELS)
                self.nodes[name] = self._start_node(name)
        (self.workdir / "operator").mkdir()
        operators = Replicas(self.plane, self.kube, self.workdir / "operator", AGENT_NAMESPACE)
        self.operators = operators
        self.replicas = [operators.start(f"operator-{i}") for i in range(s.replicas)]
        await self.kube.apply(config)
        self.config_name = config["metadata"]["name"]
        await self._wait_ready(120, "the sample GpuDraConfig to be Ready")
        await self._wait_published(120)
        for node in self.nodes.values():
            await wait_for(partial(_exists, node.ready_file), timeout=60, what=f"agent on {node.name} ready")
        await self._create_templates()
        self.say(f"cluster up in {time.monotonic() - self.started:.0f}s: {s.nodes} nodes ({s.real_nodes} real), "
                 f"{sum(len(d) for d in self.hardware.values())} GPUs, agent flags {' '.join(self.agent_args)}")

    def _start_node(self, name: str, real: RealNode | None = None) -> Node:
        workdir = self.workdir / name
        root = make_driver_root(workdir / "driver-root", self.settings.profile)
        sysfs = make_pci_sysfs(workdir / "sys", self.settings.profile)
        node = Node(name, workdir, root, sysfs, agent=None, supervisor=None, kubelet=None, real=real)  # type: ignore[arg-type]
        node.agent = self._start_agent(node)
        node.supervisor = self._start_supervisor(node)
        if real is None:
            self.report.kubelets[name] = KubeletStats()
            node.kubelet = self._start_kubelet(node)
        else:
            self.report.real_nodes[name] = RealNodeStats()
            node.kubelet = asyncio.create_task(self._watch_real_node(node), name=f"pods of {name}")
        return node

    async def _start_real_node(self, name: str) -> Node:
        """containerd + runc + the real kubelet (its Node registered by itself, tainted so that only
        the workload's pods run there), Ready; then its agent and MPS supervisor."""
        workdir = self.workdir / name
        real = RealNode(workdir, bin_dir=self.plane.bin_dir, kubeconfig=self.plane.kubeconfig, name=name,
                        cdi_dir=workdir / "cdi")
        try:
            real.start()  # from this (the main) thread, as the control plane
            await real.wait_ready(self.kube)
            node = self._start_node(name, real)
        except BaseException:
            problems = real.stop()
            if problems:
                self.say(f"{name} torn down after a failed start; left: {problems}")
            raise
        assert node.kubelet_dir == real.kubelet_dir, (node.kubelet_dir, real.kubelet_dir)
        return node

    def _start_agent(self, node: Node) -> AgentProcess:
        node.ready_file.unlink(missing_ok=True)
        return start_agent(kubeconfig=self.plane.kubeconfig, node_name=node.name, nvml=f"mock:{self.settings.profile}",
                           driver=self.driver, workdir=node.workdir, driver_root=node.driver_root, sysfs=node.sysfs,
                           extra_args=("--pod-uid", f"chaos-{node.name}", "--ready-file", str(node.ready_file),
                                       *self.agent_args))

    def _start_supervisor(self, node: Node) -> AgentProcess:
        return start_mps_supervisor(plugin_dir=node.kubelet_dir / "plugins" / self.driver,
                                    driver_root=node.driver_root, workdir=node.workdir)

    def _start_kubelet(self, node: Node) -> asyncio.Task[None]:
        registration = socket_paths(node.kubelet_dir, self.driver, f"chaos-{node.name}")[1]
        kubelet = NodeKubelet(self.kube, node.name, driver=self.driver, registration_socket=registration,
                              cdi_dir=node.cdi_dir, stats=self.report.kubelets[node.name], on_running=self._pod_running)
        return asyncio.create_task(kubelet.run(), name=f"kubelet {node.name}")

    def _pod_running(self, pod: Obj) -> None:
        name = pod["metadata"]["name"]
        record = self.pods.get(name)
        if record is not None and record.running is None:
            self.pods[name] = replace(record, running=time.monotonic())
            self.report.pods_run += 1

    async def _watch_real_node(self, node: Node) -> None:
        """The real kubelet runs the pods: one counts as run once its container has printed what CDI
        gave it, and that is exactly its claims' GPUs (their UUIDs and device nodes)."""
        while True:
            try:
                async for pod in self.kube.list(POD, WORKLOAD_NAMESPACE, field_selector=f"spec.nodeName={node.name}"):
                    await self._check_real_pod(node, pod)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                if not transient(error):
                    self._violate([f"watching the pods on {node.name}: {type(error).__name__}: {error}"])
                log.info("pods on %s: %s (next poll)", node.name, error)
            await asyncio.sleep(0.5)

    async def _check_real_pod(self, node: Node, pod: Obj) -> None:
        assert node.real is not None
        name = pod["metadata"]["name"]
        record = self.pods.get(name)
        if record is None or record.running is not None:
            return
        status = pod.get("status") or {}
        if status.get("phase") in ("Failed", "Succeeded"):
            # A pod being deleted ends as its container does (SIGTERM; the script exits 0): no wonder.
            if record.deleted is None and not pod["metadata"].get("deletionTimestamp"):
                self._violate([f"real-node: pod {name} on {node.name} ended ({status.get('phase')}) before it "
                               f"was deleted: {status.get('containerStatuses')}"])
            return
        if status.get("phase") != "Running":
            return
        injected = parse_output(node.real.container_output(pod))
        if injected is None:
            return
        names = claim_names(pod)
        if names is None:
            return
        held: set[inv.Device] = set()
        for claim_name in names:
            claim = await self.kube.get(CLAIM, claim_name, WORKLOAD_NAMESPACE)
            if claim is None:
                return
            held |= allocated_devices(claim, self.driver)
        want = {self.gpu_ids[d] for d in held}
        if injected.uuids != {u for u, _ in want} or injected.minors != {m for _, m in want}:
            self._violate([f"cdi: pod {name} on {node.name} saw GPUs {sorted(injected.uuids)}, device nodes "
                           f"{sorted(injected.minors)}; its claims hold {sorted(want)}"])
        self.report.real_nodes[node.name].pods_run += 1
        self._pod_running(pod)

    async def _wait_published(self, timeout: float) -> None:
        want = [f"gpu-{i}" for i in range(self.hardware_count)]

        async def published() -> list[Obj] | None:
            slices = [s async for s in self.kube.list(SLICE, field_selector=f"spec.driver={self.driver}")]
            if inv.slice_mismatch({n: want for n in self.nodes}, slices):
                return None
            return slices

        slices = await wait_for(published, timeout=timeout, what="every node's GPUs published")
        self.hardware = {n: want for n in self.nodes}
        for slice_ in slices:
            pool = slice_["spec"]["pool"]["name"]
            for device in slice_["spec"]["devices"]:
                self.gpu_uuids.setdefault(pool, []).append(device["attributes"]["uuid"]["string"])
                self.gpu_ids[(pool, device["name"])] = (device["attributes"]["uuid"]["string"],
                                                        device["attributes"]["minor"]["int"])
                self.capacities[(pool, device["name"])] = {
                    name: int(parse_quantity(c["value"])) for name, c in (device.get("capacity") or {}).items()}

    async def _create_templates(self) -> None:
        for name, exactly in (("plain", {"deviceClassName": "gpu.gpudra.io"}),
                              ("consumable", {"deviceClassName": "gpu-shared.gpudra.io",
                                              "capacity": {"requests": {"memory": "4Gi"}}})):
            await self.kube.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                                    "metadata": {"name": name, "namespace": WORKLOAD_NAMESPACE},
                                    "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}}})

    # --- the chaos: load, faults and checks at once -----------------------------------------
    async def _chaos(self) -> None:
        s = self.settings
        schedule = make_schedule(s.seed, s.duration, nodes=sorted(self.nodes), replicas=s.replicas, mean_gap=s.mean_gap,
                                 real_nodes=sorted(n.name for n in self.nodes.values() if n.real is not None))
        self.say(f"{len(schedule)} faults scheduled: " + "; ".join(f.describe() for f in schedule))
        self.chaos_began = time.monotonic()
        stop = asyncio.Event()
        tasks = [asyncio.create_task(self._workload(stop), name="workload"),
                 asyncio.create_task(self._checker(stop), name="checker"),
                 asyncio.create_task(self._ready_monitor(stop), name="ready monitor")]
        try:
            for fault in schedule:
                delay = self.chaos_began + fault.at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)  # the schedule's clock, not a synchronisation
                await self._inject(fault)
            remaining = self.chaos_began + s.duration - time.monotonic()
            if remaining > 0:
                await asyncio.sleep(remaining)
        finally:
            stop.set()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            for task, result in zip(tasks, results):
                if isinstance(result, BaseException):
                    self._violate([f"chaos driver: {task.get_name()} failed: {type(result).__name__}: {result}"])
        self.chaos_ended = time.monotonic()

    async def _inject(self, fault: Fault) -> None:
        record = FaultRecord(fault, time.monotonic())
        self.report.faults.append(record)
        self.say(f"fault {fault.describe()}")
        try:
            await asyncio.wait_for(self._apply(fault), timeout=180)
            record.done = time.monotonic()
        except Exception as error:
            record.error = f"{type(error).__name__}: {error}"
            self._violate([f"fault {fault.describe()} did not recover: {record.error}"])

    async def _apply(self, fault: Fault) -> None:
        if fault.kind in (APISERVER, ETCD):
            name = "kube-apiserver" if fault.kind == APISERVER else "etcd"
            # SIGTERM: the API server drains at once, then may linger; 10 s later it is SIGKILLed
            await asyncio.to_thread(self.plane.stop_component, name, getattr(signal, fault.signal), 10.0)
            self.plane.start_component(name)  # in place: same port and data; from the main thread

            async def healthy() -> bool:
                return await asyncio.to_thread(self.plane.healthy, name)

            await wait_for(healthy, timeout=120, what=f"{name} healthy again", interval=0.2)
        elif fault.kind == AGENT:
            await self._restart_agent(self.nodes[fault.target or ""])
        elif fault.kind == OPERATOR:
            index = int(fault.target or 0)
            old = self.replicas[index]
            old.operator.process.kill()
            old.operator.process.wait()
            new = self.operators.start(old.user)  # the Deployment's new pod
            self.replicas[index] = new

            async def answering() -> bool:
                if new.operator.process.poll() is not None:
                    raise AssertionError(f"{new.user} exited:\n{new.operator.log_tail()}")
                return await asyncio.to_thread(new.role) is not None

            await wait_for(answering, timeout=120, what=f"{new.user} to answer as active or standby", interval=0.2)
        elif fault.kind == KUBELET and self.nodes[fault.target or ""].real is not None:
            await self._restart_real_kubelet(self.nodes[fault.target or ""], fault.signal)
        elif fault.kind == KUBELET:
            node = self.nodes[fault.target or ""]
            node.kubelet.cancel()
            await asyncio.gather(node.kubelet, return_exceptions=True)
            node.kubelet = self._start_kubelet(node)
        else:  # pragma: no cover - the schedule makes only FAULT_KINDS
            raise ValueError(f"unknown fault kind {fault.kind!r} (known: {', '.join(FAULT_KINDS)})")

    async def _restart_real_kubelet(self, node: Node, sig: str) -> None:
        """The kubelet process stopped by ``sig`` and started again on the same root directory;
        back once it reports its Node Ready and has registered the agent again."""
        assert node.real is not None
        log_text = node.agent.log_path.read_text(errors="replace")
        registrations = log_text.count(REGISTERED)
        node.kubelet_stopped = True
        try:
            code = await asyncio.to_thread(node.real.stop_kubelet, sig)
            log.info("kubelet on %s stopped by %s: exit %s", node.name, sig, code)
            node.real.start_kubelet()  # from the main thread: it dies with the run
        finally:
            node.kubelet_stopped = False
        self.report.real_nodes[node.name].kubelet_restarts += 1
        await node.real.wait_ready(self.kube)

        async def registered_again() -> bool:
            assert node.real is not None
            node.real.assert_kubelet_running()
            return node.agent.log_path.read_text(errors="replace").count(REGISTERED) > registrations

        await wait_for(registered_again, timeout=60, what=f"the kubelet on {node.name} to register the agent again",
                       interval=0.2)

    async def _restart_agent(self, node: Node) -> None:
        """SIGKILL, the DaemonSet pod not ready meanwhile (as its kubelet reports a dead container),
        started again, ready again once registered and published."""
        node.agent.process.kill()
        node.agent.process.wait()
        node.agent = self._start_agent(node)  # at once: the supervisor never finds it dead
        await self._agent_pod_ready(node, False)

        async def ready() -> bool:
            if node.agent.process.poll() is not None:
                raise AssertionError(f"agent on {node.name} exited:\n{node.agent.log_tail()}")
            return node.ready_file.exists()

        await wait_for(ready, timeout=120, what=f"the agent on {node.name} ready again", interval=0.2)
        await self._agent_pod_ready(node, True)

    async def _agent_pod_ready(self, node: Node, ready: bool) -> None:
        async def patch() -> None:
            async for pod in self.kube.list(POD, AGENT_NAMESPACE, field_selector=f"spec.nodeName={node.name}"):
                if not pod["metadata"]["name"].startswith("gpudra-agent"):
                    continue
                now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                status = running_status(pod, now)
                if not ready:
                    for condition in status["status"]["conditions"]:
                        if condition["type"] in ("ContainersReady", "Ready"):
                            condition["status"] = "False"
                    for container in status["status"]["containerStatuses"]:
                        container["ready"] = False
                await self.kube.patch(POD, pod["metadata"]["name"], status, namespace=AGENT_NAMESPACE,
                                      subresource="status")

        await retrying(patch, f"the agent pod on {node.name}")

    async def _supervise(self, stop: asyncio.Event) -> None:
        """Restart what exits on its own, as the operator's Deployment and the DaemonSets restart
        a container that exited. An operator replica fenced off by its Lease exits by design
        (LOST_LEASE_EXIT); any other exit is a crash, and a violation."""
        while not stop.is_set():
            for index, replica in enumerate(self.replicas):
                code = replica.operator.process.poll()
                if code is not None:
                    self._exited(f"operator replica {replica.user}", code, replica.operator.log_tail(5),
                                 expected=code == LOST_LEASE_EXIT)
                    self.replicas[index] = self.operators.start(replica.user)
            for node in self.nodes.values():
                kubelet = node.real.runtime.kubelet.process if node.real is not None else None
                if kubelet is not None and not node.kubelet_stopped and kubelet.poll() is not None:
                    assert node.real is not None
                    self._exited(f"kubelet on {node.name}", kubelet.returncode, node.real.kubelet_log(5))
                    node.real.start_kubelet()
                code = node.agent.process.poll()
                if code is not None:
                    self._exited(f"agent on {node.name}", code, node.agent.log_tail(5))
                    node.agent = self._start_agent(node)
                code = node.supervisor.process.poll()
                if code is not None:
                    self._exited(f"MPS supervisor on {node.name}", code, node.supervisor.log_tail(5))
                    node.supervisor = self._start_supervisor(node)
            try:
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass

    def _exited(self, what: str, code: int, log_tail: str, *, expected: bool = False) -> None:
        at = time.monotonic() - getattr(self, "chaos_began", self.started)
        self.report.exits.append(f"t+{at:.1f}s {what} exited with {code}")
        self.say(f"{what} exited with {code}; restarting it:\n{log_tail}")
        if not expected:
            self._violate([f"crash: {what} exited with {code} at t+{at:.0f}s"])

    # --- the workload ---------------------------------------------------------------------
    async def _workload(self, stop: asyncio.Event) -> None:
        capacity = sum(len(d) for d in self.hardware.values())
        while not stop.is_set():
            try:
                if len(self.units) < capacity and (not self.units or self.rng.random() < 0.6):
                    await self._create_unit(self.rng.choice(UNIT_KINDS))
                elif self.units:
                    await self._delete_unit(self.rng.choice(sorted(self.units)))
            except Exception as error:
                if not transient(error):
                    raise
                log.info("workload: %s (the API server is away; next step)", error)
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.rng.uniform(0.3, 2.0))
            except asyncio.TimeoutError:
                pass

    async def _create_unit(self, kind: str) -> None:
        self._unit_counter += 1
        name = f"{kind}-{self._unit_counter}"
        claim = name if kind in ("shared", "mps") else None
        if claim is not None:
            await retrying(lambda: self.kube.create(self._claim(claim, mps=kind == "mps")), f"claim {claim}")
        pod_names = [f"{name}-{p}" for p in ("a", "b")] if claim else [f"{name}-a"]
        unit = Unit(kind, name, [], claim)
        self.units[name] = unit
        self.report.units[kind] += 1
        for pod_name in pod_names:
            source = {"resourceClaimName": claim} if claim else {"resourceClaimTemplateName": kind}
            await retrying(lambda: self._create_pod(pod_name, source), f"pod {pod_name}")
            unit.pods.append(pod_name)
            self.pods[pod_name] = inv.PodRecord(WORKLOAD_NAMESPACE, pod_name, time.monotonic())
            self.report.pods_created += 1

    async def _create_pod(self, name: str, source: dict[str, str]) -> None:
        try:
            await self.kube.create({
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": WORKLOAD_NAMESPACE},
                # Runnable on a real node as on a stand-in: the host network (a real node runs no
                # CNI plugin), no ServiceAccount token, its taints tolerated.
                "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 30, "hostNetwork": True,
                         "automountServiceAccountToken": False, "enableServiceLinks": False,
                         "tolerations": pod_tolerations(), "resourceClaims": [{"name": "gpu", **source}],
                         "containers": [container_spec()]}})
        except Exception as error:
            if not is_status(error, 409):  # a retry of a create that went through
                raise

    def _claim(self, name: str, *, mps: bool) -> Obj:
        spec: Obj = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.gpudra.io"}}]}}
        if mps:
            spec["devices"]["config"] = [{"requests": ["gpu"], "opaque": {"driver": self.driver, "parameters": {
                "apiVersion": "gpudra.io/v1alpha1", "kind": "GpuConfig",
                "sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 50, "pinnedMemoryLimit": "4Gi"}}}}}]
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": WORKLOAD_NAMESPACE}, "spec": spec}

    async def _delete_unit(self, name: str) -> None:
        unit = self.units.pop(name)
        for pod_name in unit.pods:
            await retrying(lambda: self.kube.delete(POD, pod_name, WORKLOAD_NAMESPACE), f"deleting pod {pod_name}")
            record = self.pods.get(pod_name)
            if record is not None:
                self.pods[pod_name] = replace(record, deleted=time.monotonic())
            self.report.pods_deleted += 1
        if unit.claim is not None:
            await retrying(lambda: self.kube.delete(CLAIM, unit.claim or "", WORKLOAD_NAMESPACE), f"claim {unit.claim}")

    # --- the invariants -------------------------------------------------------------------
    async def _observe(self) -> tuple[list[inv.NodeState], dict[str, inv.ClaimState]]:
        claims = {}
        async for claim in self.kube.list(CLAIM):
            uid = claim["metadata"]["uid"]
            status = claim.get("status") or {}
            results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
            claims[uid] = inv.ClaimState(uid, claim["metadata"]["namespace"], claim["metadata"]["name"],
                                         tuple(inv.holding_from_result(r, uid) for r in results if r["driver"] == self.driver),
                                         frozenset(r["uid"] for r in status.get("reservedFor") or []))
        # Read after the claims: a claim prepared since is at worst "not yet listed", never missed as live.
        return [self._node_state(node) for node in self.nodes.values()], claims

    def _node_state(self, node: Node) -> inv.NodeState:
        path = node.kubelet_dir / "plugins" / self.driver / CHECKPOINT_FILE
        try:
            checkpoint = decode(path.read_bytes())
        except FileNotFoundError:
            entries: dict[str, tuple[str, tuple[inv.Holding, ...]]] = {}
        else:
            entries = {uid: (entry.state, tuple(inv.Holding(uid, d.pool, d.device, d.share_id, d.consumed)
                                                for d in entry.claim.devices if not d.admin_access))
                       for uid, entry in checkpoint.claims.items()}
        cdi = frozenset(m.group(1) for p in (node.cdi_dir.iterdir() if node.cdi_dir.is_dir() else ())
                        if (m := CLAIM_UID.search(p.name)))
        mps = frozenset(d.pipe_dir.parent.name for d in mockstate.mps_daemons(node.driver_root))
        if node.real is not None:  # what the real kubelet had prepared, and unprepared since
            stats = self.report.real_nodes[node.name]
            prepared = frozenset(uid for uid, (state, _) in entries.items() if state == COMPLETED)
            stats.claims_prepared |= prepared
            stats.claims_unprepared |= self._prepared_seen.get(node.name, frozenset()) - set(entries)
            self._prepared_seen[node.name] = prepared
        return inv.NodeState(node.name, entries, cdi, mps)

    async def _check(self, *, final: bool = False) -> set[tuple[str, str, str]]:
        nodes, claims = await self._observe()
        self.report.checks += 1
        self._violate(inv.check_state(nodes, claims, self.capacities))
        now = time.monotonic()
        orphans = inv.orphans(nodes, claims)
        self._violate(self.tracker.update(now, orphans))
        if not final:
            self._violate(inv.pods_not_run(self.pods.values(), now, self.settings.pod_deadline))
        for stats in self.report.kubelets.values():
            self._violate(stats.problems)
        return orphans

    async def _checker(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self._check()
            except Exception as error:
                if not transient(error):
                    raise
                # The API server is away: what the nodes hold must still never overlap.
                nodes = [self._node_state(node) for node in self.nodes.values()]
                self._violate(inv.overcommitted(inv.prepared_holdings(nodes), self.capacities,
                                                where="prepared on the nodes"))
                self.report.checks += 1
            try:
                await asyncio.wait_for(stop.wait(), timeout=2.0)
            except asyncio.TimeoutError:
                pass

    async def _ready_monitor(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self._note_ready()
            try:
                await asyncio.wait_for(stop.wait(), timeout=0.5)
            except asyncio.TimeoutError:
                pass

    async def _note_ready(self) -> bool:
        """Record whether the config is Ready now (unknown while the API server is away: no change)."""
        try:
            config = await self.kube.get(CONFIG, self.config_name)
        except Exception as error:
            if transient(error):
                return False
            raise
        ready = _is_ready(config)
        now = time.monotonic()
        if ready and self._not_ready_since is not None:
            self.report.longest_not_ready = max(self.report.longest_not_ready, now - self._not_ready_since)
            self._not_ready_since = None
        elif not ready and self._not_ready_since is None:
            self._not_ready_since = now
        return ready

    async def _wait_ready(self, timeout: float, what: str) -> None:
        await wait_for(self._note_ready, timeout=timeout, what=what, interval=0.5)

    # --- the end: everything converges, then everything is released --------------------------
    async def _settle(self) -> None:
        s = self.settings
        self.say("chaos over: waiting for the cluster to converge")
        deadline = self.chaos_ended + s.settle_timeout

        async def within(probe: Callable[[], Awaitable[Any]], what: str) -> bool:
            try:
                await wait_for(probe, timeout=max(deadline - time.monotonic(), 1.0), what=what, interval=0.5)
                return True
            except ConditionTimeout as error:
                self._violate([f"after the chaos: {error}"])
                return False

        if await within(self._note_ready, f"GpuDraConfig {self.config_name} Ready"):
            self.report.ready_after_chaos = time.monotonic() - self.chaos_ended

        async def all_running() -> bool:
            waiting = [p for p in self.pods.values() if p.running is None and p.deleted is None]
            return not waiting

        if not await within(all_running, "every pod of the workload running with its devices"):
            for record in self.pods.values():
                if record.running is None and record.deleted is None:
                    self._violate([f"pod-not-run: {record.namespace}/{record.name}: "
                                   f"{await self._pod_whereabouts(record)}"])

        async def converged() -> bool:
            slices = [s async for s in self.kube.list(SLICE, field_selector=f"spec.driver={self.driver}")]
            return not inv.slice_mismatch(self.hardware, slices)

        if not await within(converged, "every node's slices to match its GPUs"):
            slices = [s async for s in self.kube.list(SLICE, field_selector=f"spec.driver={self.driver}")]
            self._violate(inv.slice_mismatch(self.hardware, slices))

        async def no_orphans() -> bool:
            return not await self._check(final=True)

        if not await within(no_orphans, "no CDI spec, checkpoint entry or MPS daemon without its claim"):
            nodes, claims = await self._observe()
            self._violate([f"outlived-claim: {n}: {what} of claim {uid}" for n, what, uid in sorted(inv.orphans(nodes, claims))])

    async def _pod_whereabouts(self, record: inv.PodRecord) -> str:
        """Where a pod that never ran is, and why (for the report): its node, phase and containers'
        states; on a real node, the kubelet's last words about it."""
        pod = await self.kube.get(POD, record.name, record.namespace)
        if pod is None:
            return "gone"
        node_name = pod["spec"].get("nodeName")
        status = pod.get("status") or {}
        text = (f"on {node_name or 'no node'}, {status.get('phase')}, conditions "
                f"{[(c['type'], c['status'], c.get('reason')) for c in status.get('conditions') or []]}, "
                f"containers {[c.get('state') for c in status.get('containerStatuses') or []]}")
        node = self.nodes.get(node_name or "")
        if node is not None and node.real is not None:
            said = [line for line in node.real.kubelet_log(4000).splitlines() if record.name in line][-5:]
            text += "; kubelet: " + " | ".join(said)
        return text

    async def _drain(self) -> None:
        """Delete the whole workload: every claim must be unprepared on its node and nothing left."""
        self.say("deleting the workload: every claim must be released")
        for name in sorted(self.units):
            await self._delete_unit(name)

        async def empty() -> bool:
            pods = [p async for p in self.kube.list(POD, WORKLOAD_NAMESPACE)]
            claims = [c async for c in self.kube.list(CLAIM, WORKLOAD_NAMESPACE)]
            nodes = [self._node_state(n) for n in self.nodes.values()]
            return (not pods and not claims and not self._changed_gpus()
                    and not any(n.checkpoint or n.cdi_claims or n.mps_claims for n in nodes))

        try:
            await wait_for(empty, timeout=120, what="the workload gone and every node released", interval=0.5)
        except ConditionTimeout:
            for node in (self._node_state(n) for n in self.nodes.values()):
                for what, uids in (("checkpoint entry", node.checkpoint), ("CDI spec", node.cdi_claims),
                                   ("MPS daemon", node.mps_claims)):
                    self._violate([f"left after the workload was deleted: {node.node}: {what} of claim {uid}"
                                   for uid in sorted(uids)])
            self._violate([f"left after the workload was deleted: {gpu}" for gpu in self._changed_gpus()])
            pods = [p["metadata"]["name"] async for p in self.kube.list(POD, WORKLOAD_NAMESPACE)]
            if pods:
                self._violate([f"pods never deleted: {', '.join(sorted(pods))}"])
        for stats in self.report.kubelets.values():
            self._violate(stats.problems)

    def _changed_gpus(self) -> list[str]:
        """GPUs whose compute mode or time slice (what MPS and time-slicing set) is not the default."""
        return [f"{name}: GPU {uuid} compute mode {mockstate.compute_mode(node.driver_root, uuid)}, "
                f"time slice {mockstate.timeslice(node.driver_root, uuid)}"
                for name, node in self.nodes.items() for uuid in self.gpu_uuids.get(name, ())
                if mockstate.compute_mode(node.driver_root, uuid) or mockstate.timeslice(node.driver_root, uuid)]

    async def _teardown(self) -> None:
        for node in self.nodes.values():
            if node.kubelet is not None:
                node.kubelet.cancel()
                await asyncio.gather(node.kubelet, return_exceptions=True)
        for node in self.nodes.values():
            if node.real is not None:  # before its agent: the kubelet may still call it
                node.kubelet_stopped = True
                self._violate([f"the real node {node.name} left, torn down: {problem}" for problem in node.real.stop()])
        for replica in self.replicas:
            replica.operator.stop()
        for node in self.nodes.values():
            if node.agent is not None:
                node.agent.stop()
            if node.supervisor is not None:
                node.supervisor.stop()
            leftover = mockstate.kill_mps_daemons(node.driver_root)
            if leftover:
                self._violate([f"MPS daemons left running on {node.name}: {leftover}"])
        if getattr(self, "api", None) is not None:
            await self.api.close()
        self.plane.stop()
        mounts = _mounts_under(self.workdir)
        if mounts:
            self._violate([f"mounts left under the run's directory: {', '.join(mounts)}"])
        if os.environ.get("CHAOS_KEEP"):
            self.say(f"kept {self.workdir} (CHAOS_KEEP)")
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)


async def _exists(path: Path) -> bool:
    return path.exists()


def _is_ready(config: Obj | None) -> bool:
    if not config:
        return False
    return any(c["type"] == "Ready" and c["status"] == "True" and c.get("observedGeneration") == config["metadata"]["generation"]
               for c in (config.get("status") or {}).get("conditions") or [])


def _mounts_under(directory: Path) -> list[str]:
    prefix = str(directory.resolve())
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mount_point = line.split()[4]
        if mount_point == prefix or mount_point.startswith(prefix + "/"):
            found.append(mount_point)
    return found


def settings_from_environment(default_duration: float) -> Settings:
    """CHAOS_SEED (default: a new random one, printed), CHAOS_DURATION (seconds), CHAOS_NODES,
    CHAOS_REAL_NODES (of those, how many are real: the kubelet on containerd + runc; default 1)."""
    seed_text = os.environ.get("CHAOS_SEED", "")
    seed = int(seed_text) if seed_text else random.SystemRandom().randrange(1, 2**31)
    duration = float(os.environ.get("CHAOS_DURATION", "") or default_duration)
    nodes = int(os.environ.get("CHAOS_NODES", "") or 3)
    real_nodes = int(os.environ.get("CHAOS_REAL_NODES", "") or 1)
    if not 0 <= real_nodes <= nodes:
        raise ValueError(f"CHAOS_REAL_NODES={real_nodes}: between 0 and CHAOS_NODES={nodes}")
    return Settings(seed=seed, duration=duration, nodes=nodes, real_nodes=real_nodes)
