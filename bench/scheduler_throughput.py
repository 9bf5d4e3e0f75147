"""The kube-scheduler's throughput with gpudra's ResourceSlices and DeviceClasses (issue 37), in the
manner of upstream's scheduler_perf: the release's own kube-scheduler, 1,000 fake Nodes x 8 GPUs
(Ready, no kubelet), pods whose claims the controller-manager makes from ResourceClaimTemplates.
What gpudra's slice shape and classes cost the scheduler is a ratio to the same run with minimal
slices.

Variants, on the same Nodes in turn (only one variant's slices exist at a time):

- ``minimal``: one slice per Node of 8 devices, each a name and one attribute; one DeviceClass that
  matches the driver; every claim one device of it.
- ``gpudra``: the slices ``gpudra discover --nvml fake:dgx-h100`` shows (its discovery, health probe
  and ``build_slices``, per Node), the DeviceClasses the operator renders from
  manifests/samples/gpudraconfig.yaml, and claims from four templates of the kind the README and
  docs/devices.md tell users to write, in turn: any GPU; memory >= 40Gi; the product on the
  full-GPU class; compute capability >= 9.0 on the 64Gi class.
- ``consumable``: the same slices with ``--consumable-memory-step 1Gi --consumable-shares 8`` (what
  manifests/samples/gpudraconfig-sharing.yaml has the agents publish), that sample's classes too,
  and claims as docs/sharing.md shows, in turn: 10Gi of any GPU, 20Gi of a shared one, 40Gi of a
  shared H100, a whole GPU. DRAConsumableCapacity is beta and on from 1.36, so this variant runs
  against ``minimal`` on a second control plane of ``BENCH_SCHED_NEXT_VERSION`` (v1.36.3; its
  binaries from hack/kube-bin.sh's cache or ``BENCH_SCHED_NEXT_KUBE_BIN``; none: a failed row).
- ``shape`` (a diagnostic, not run by default): gpudra's slices with the minimal claims (one device
  of gpu.gpudra.io, whose one selector matches the driver as the minimal class does): the slice
  shape's cost without the selectors. ``BENCH_SCHED_VARIANTS`` (``minimal,gpudra``) and
  ``BENCH_SCHED_NEXT_VARIANTS`` (``minimal,consumable``) choose each plane's variants.

A round: the variant's slices replace the last one's; ``BENCH_SCHED_PODS`` (500) pods are created
in a fresh namespace while no scheduler runs, and the controller-manager makes their claims; then
a kube-scheduler starts, and a watch on the pods times the first and the last binding: pods/s =
(pods - 1) / (last - first binding), the scheduler's steady state without its start and cache sync.
The scheduler process's CPU seconds over the same window give pods per CPU second: the same ratio
where the scheduler's CPU is the limit (as here), and far steadier when other work shares the
machine. Its own metrics (schedule attempts, the scheduling algorithm's mean duration) are logged.
The first claims are checked to be allocated from the variant's driver (with consumable capacity:
some holding a share). Then the scheduler stops and the namespace is deleted (the pods at once:
grace 0); the next round sets up meanwhile and starts its scheduler once that namespace, and so
every allocation of it, is gone. Rounds run ABBA, ``BENCH_SCHED_ROUNDS`` (1) times; medians.

This bench's control planes raise the client rate limits of the scheduler (``--kube-api-qps`` 50 ->
5000) and of the controller-manager (200 -> 2000): every pod costs the scheduler two writes (the
claim's allocation, the binding), so at 50 QPS its client, not its work, would set the pace and
the ratio would say nothing about slices or classes.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from bench import Context, Result, median
from gpudra_core.consumable import ConsumableCapacity, keeps_sharing, share_devices
from gpudra_core.devicemodel import Device
from gpudra_core.kubeapi import Deadlines, Kube, Obj, connect, resource_type
from gpudra_driver.devicehealth.apply import snapshot
from gpudra_driver.devicehealth.plan import Moment, Policy
from gpudra_driver.discovery import MigMode, scan
from gpudra_driver.nvml import load_nvml
from gpudra_driver.publishing.slices import build_slices
from gpudra_dev.localcluster.controlplane import Component, ControlPlane, find_binaries
from gpudra_dev.localcluster.fleet import bounded
from gpudra_dev.localcluster.objects import create_fake_node, create_scratch_namespace
from gpudra_dev.localcluster.waiting import wait_for
from gpudra_operator.render import render

POD = resource_type("v1", "Pod")
NAMESPACE = resource_type("v1", "Namespace")
SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")

NODES = int(os.environ.get("BENCH_SCHED_NODES", "1000"))
PODS = int(os.environ.get("BENCH_SCHED_PODS", "500"))
ROUNDS = int(os.environ.get("BENCH_SCHED_ROUNDS", "1"))
NEXT_VERSION = os.environ.get("BENCH_SCHED_NEXT_VERSION", "v1.36.3")
GPUS = 8
PROFILE = "fake:dgx-h100"
DRIVER = "gpu.gpudra.io"  # the samples' driver name
MINIMAL_DRIVER = "minimal.bench.gpudra.io"
TARGET = 0.9
SCHEDULER_QPS, SCHEDULER_BURST = 5000, 10000
KCM_QPS, KCM_BURST = 2000, 4000
SAMPLES = Path(__file__).resolve().parents[1] / "manifests" / "samples"
PROFILES = Path(__file__).resolve().parents[1] / "driver" / "gpudra_driver" / "profiles"
MEMORY = f'device.capacity["{DRIVER}"]'
ATTRIBUTES = f'device.attributes["{DRIVER}"]'


# --- what the scheduler is given ---------------------------------------------------------------

def exactly(device_class: str, *selectors: str, memory: str | None = None) -> Obj:
    """A claim's one request, ``gpu``: one device of ``device_class`` (``memory`` of it, shared)."""
    request: Obj = {"deviceClassName": device_class}
    if selectors:
        request["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    if memory:
        request["capacity"] = {"requests": {"memory": memory}}
    return {"name": "gpu", "exactly": request}


@dataclass(frozen=True)
class Variant:
    """One way of publishing the same 8 GPUs per Node, with the classes and claims that go with it."""

    name: str
    driver: str
    templates: dict[str, Obj]  # ResourceClaimTemplate name -> its one request
    sharing: ConsumableCapacity | None = None
    mig: MigMode = "static"  # dynamic: 8 MIG-enabled H100s per Node, every placement over counters


MINIMAL = Variant("minimal", MINIMAL_DRIVER, {"one": exactly(MINIMAL_DRIVER)})
GPUDRA = Variant("gpudra", DRIVER, {
    "gpu": exactly("gpu.gpudra.io"),
    "gpu-40gi": exactly("gpu.gpudra.io", f'{MEMORY}.memory.compareTo(quantity("40Gi")) >= 0'),
    "h100": exactly("gpu-full.gpudra.io", f'{ATTRIBUTES}.productName == "NVIDIA H100 80GB HBM3"'),
    "hopper-64gi": exactly("gpu-64gi.gpudra.io",
                           f'{ATTRIBUTES}.cudaComputeCapability.compareTo(semver("9.0.0")) >= 0'),
})
CONSUMABLE = Variant("consumable", DRIVER, {
    "gpu-10gi": exactly("gpu.gpudra.io", memory="10Gi"),
    "shared-20gi": exactly("gpu-shared.gpudra.io", memory="20Gi"),
    "h100-40gi": exactly("gpu-shared.gpudra.io", f'{ATTRIBUTES}.productName == "NVIDIA H100 80GB HBM3"',
                         memory="40Gi"),
    "gpu": exactly("gpu.gpudra.io"),
}, sharing=ConsumableCapacity.parse("1Gi", 8))
SHAPE = Variant("shape", DRIVER, {"gpu": exactly("gpu.gpudra.io")})
# Dynamic MIG (issue 34), on the same cluster: the whole GPU as one instance (7g.80gb), or one
# 1g.10gb placement per claim (the mig class selects type "mig": the whole GPU devices, published
# too on these H100s, are candidates of neither)
DYNAMIC_WHOLE = Variant("dynamic-7g", DRIVER, {"mig-7g": exactly("mig.gpudra.io", f'{ATTRIBUTES}.profile == "7g.80gb"')},
                        mig="dynamic")
DYNAMIC_MIG = Variant("dynamic-mig", DRIVER, {"mig-1g": exactly("mig.gpudra.io", f'{ATTRIBUTES}.profile == "1g.10gb"')},
                      mig="dynamic")
VARIANTS = {v.name: v for v in (MINIMAL, GPUDRA, CONSUMABLE, SHAPE, DYNAMIC_WHOLE, DYNAMIC_MIG)}
# 9 slices per Node (counters, then 26 devices per GPU): kube-scheduler 1.36 is far slower per pod on
# partitionable devices, so this plane is smaller (bench/README.md, "Dynamic MIG")
MIG_NODES = int(os.environ.get("BENCH_SCHED_MIG_NODES", "20"))
MIG_PODS = int(os.environ.get("BENCH_SCHED_MIG_PODS", "100"))
TARGETS = ("gpudra", "consumable")  # the variants with the target; the others are diagnostics


def variants_from(variable: str, default: str) -> list[Variant]:
    """The variants ``$variable`` names, the baseline first."""
    names = os.environ.get(variable, default).split(",")
    if names[0] != default.split(",")[0] or any(n not in VARIANTS for n in names):
        raise ValueError(f"${variable}={','.join(names)}: {default.split(',')[0]} first, then any of "
                         f"{', '.join(VARIANTS)}")
    return [VARIANTS[n] for n in names]


def gpudra_devices(sharing: ConsumableCapacity | None, mig: MigMode = "static") -> list[Device]:
    """What ``gpudra discover --nvml fake:dgx-h100`` publishes (its discovery, sharing and health
    probe; ``--consumable-*`` as ``sharing`` says); with ``mig`` dynamic, what ``--mig dynamic``
    publishes for 8 MIG-enabled H100s (h100-dynamic-mig's GPU, eight times)."""
    with tempfile.TemporaryDirectory() as tmp:
        if mig == "static":
            nvml = load_nvml(PROFILE)
        else:
            profile = yaml.safe_load((PROFILES / "h100-dynamic-mig.yaml").read_text())
            first = profile["gpus"][0]
            profile["gpus"] = [dict(first, uuid=f"GPU-{i:08x}-0000-4000-8000-000000000000",
                                    busId=f"00000000:{0x18 + i:02x}:00.0") for i in range(GPUS)]
            path = Path(tmp) / "h100-dynamic-mig-x8.yaml"
            path.write_text(yaml.safe_dump(profile))
            nvml = load_nvml(f"fake:{path}")
        found = scan(nvml, mig=mig)
        assert not found.warnings, found.warnings
        devices, unshared = share_devices(found.devices, sharing)
        assert not unshared, unshared
        return snapshot(nvml, devices, Policy(driver=DRIVER), Moment.now())


def slices_of(variant: Variant, nodes: dict[str, str], generation: int) -> list[Obj]:
    """One pool per Node (``nodes``: name -> uid) at ``generation``."""
    if variant is MINIMAL:
        return [{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                 "metadata": {"name": f"{node}-minimal"},
                 "spec": {"driver": MINIMAL_DRIVER, "nodeName": node,
                          "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
                          "devices": [{"name": f"gpu-{i}", "attributes": {"index": {"int": i}}}
                                      for i in range(GPUS)]}} for node in nodes]
    devices = gpudra_devices(variant.sharing, variant.mig)
    assert len(devices) == (GPUS if variant.mig == "static" else GPUS * 26)  # 25 placements and the whole GPU
    return [s for node, uid in nodes.items() for s in build_slices(DRIVER, node, uid, generation, devices)]


def device_classes(sharing: bool) -> list[Obj]:
    """The minimal class, and the classes the operator renders from the default sample and, with
    ``sharing``, the sharing sample (its gpu-shared.gpudra.io reads device.allowMultipleAllocations,
    which CEL knows only with DRAConsumableCapacity on; gpu.gpudra.io is the same in both); without
    an owner: no GpuDraConfig exists here."""
    classes = {MINIMAL_DRIVER: {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                                "metadata": {"name": MINIMAL_DRIVER},
                                "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{MINIMAL_DRIVER}"'}}]}}}
    for sample in ("gpudraconfig.yaml", *(("gpudraconfig-sharing.yaml",) if sharing else ())):
        rendered = render(yaml.safe_load((SAMPLES / sample).read_text()))
        assert not rendered.errors, rendered.errors
        for device_class in rendered.device_classes:
            device_class["metadata"].pop("ownerReferences", None)
            classes[device_class["metadata"]["name"]] = device_class
    return list(classes.values())


def claim_template(name: str, namespace: str, request: Obj) -> Obj:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"spec": {"devices": {"requests": [request]}}}}


def pod(name: str, namespace: str, template: str) -> Obj:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
            "spec": {"automountServiceAccountToken": False, "terminationGracePeriodSeconds": 0,
                     "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
                     "containers": [{"name": "main", "image": "example.com/bench:1",
                                     "resources": {"claims": [{"name": "gpu"}]}}]}}


# --- the control plane -----------------------------------------------------------------------

class SchedulerBench(ControlPlane):
    """A control plane whose kube-scheduler the bench starts and stops itself (one fresh scheduler
    per round), with the client rate limits raised (see the module's docstring)."""

    scheduler: Component

    def _prepare(self) -> None:
        super()._prepare()
        for component in self.components:
            if component.name == "kube-controller-manager":
                component.argv = [a for a in component.argv if not a.startswith("--kube-api-")]
                component.argv += [f"--kube-api-qps={KCM_QPS}", f"--kube-api-burst={KCM_BURST}"]
            if component.name == "kube-scheduler":
                component.argv += [f"--kube-api-qps={SCHEDULER_QPS}", f"--kube-api-burst={SCHEDULER_BURST}"]
                self.scheduler = component
        self.components.remove(self.scheduler)

    def start_scheduler(self) -> int:
        """Start the kube-scheduler (from the event loop's thread, which outlives it); its PID."""
        self._spawn(self.scheduler)
        assert self.scheduler.process is not None
        return self.scheduler.process.pid

    def stop_scheduler(self) -> None:
        process = self.scheduler.process
        if process is None or process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def scheduler_metrics(self) -> str:
        """The scheduler's /metrics, read as the admin user (delegated authentication)."""
        context = ssl._create_unverified_context()  # noqa: S323 - its self-signed loopback cert
        context.load_cert_chain(f"{self.pki_dir / 'admin'}.crt", f"{self.pki_dir / 'admin'}.key")
        url = self.scheduler.health_url.replace("/healthz", "/metrics")
        with urllib.request.urlopen(url, timeout=10, context=context) as response:
            return str(response.read().decode())

    def stop(self, grace: float = 10.0) -> None:
        if getattr(self, "scheduler", None) is not None:
            self.stop_scheduler()
        super().stop(grace)


def next_release_binaries(version: str) -> Path:
    """The cached binaries of ``version`` (hack/kube-bin.sh's cache), or a RuntimeError naming the
    command that makes them: building them takes minutes, which a bench run must not start."""
    binaries = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
    override = os.environ.get("BENCH_SCHED_NEXT_KUBE_BIN")
    root = Path(os.environ["GPUDRA_CACHE"]) if os.environ.get("GPUDRA_CACHE") else \
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpudra"
    for directory in [Path(override)] if override else sorted((root / "kube").glob(f"{version}-etcd*")):
        if all(os.access(directory / b, os.X_OK) for b in binaries):
            return directory
    where = f"$BENCH_SCHED_NEXT_KUBE_BIN={override}" if override else str(root / "kube")
    raise RuntimeError(f"no Kubernetes {version} binaries in {where}: run `KUBE_VERSION={version} make kube-bin` "
                       "(or set BENCH_SCHED_NEXT_KUBE_BIN to the directory it prints last)")


# --- one round --------------------------------------------------------------------------------

def cpu_seconds(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


class PodTracker:
    """One watch on a round's namespace: when its pods got their claims (the controller-manager)
    and their Nodes (the scheduler), and the scheduler's CPU seconds at the first and last binding."""

    def __init__(self, kube: Kube, namespace: str, pods: int) -> None:
        self.kube, self.namespace, self.pods = kube, namespace, pods
        self.claimed: set[str] = set()
        self.bound: dict[str, float] = {}
        self.all_claimed, self.all_bound = asyncio.Event(), asyncio.Event()
        self.scheduler_pid: int | None = None
        self.cpu_at_first = self.cpu_at_last = 0.0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        listed = await self.kube.request("GET", POD.path(self.namespace), query={"limit": 1})
        self._task = asyncio.create_task(self._follow(listed["metadata"]["resourceVersion"]))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def wait(self, event: asyncio.Event, timeout: float, what: str) -> None:
        """``event`` set, or the watch's own error, or a TimeoutError naming ``what``."""
        assert self._task is not None
        waiter = asyncio.create_task(event.wait())
        done, _ = await asyncio.wait({waiter, self._task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if self._task in done:
            self._task.result()
            raise RuntimeError("the pod watch ended")
        if waiter not in done:
            raise TimeoutError(f"{what} within {timeout:.0f}s: {len(self.claimed)} pods with a claim, "
                               f"{len(self.bound)} bound of {self.pods}")

    async def _follow(self, resource_version: str) -> None:
        while True:
            async for kind, obj in self.kube.watch(POD, self.namespace, resource_version=resource_version,
                                                   timeout_seconds=600):
                if kind == "ERROR":
                    raise RuntimeError(f"pod watch: {obj.get('message')}")
                resource_version = obj["metadata"]["resourceVersion"]
                if kind in ("ADDED", "MODIFIED"):
                    self._saw(obj)

    def _saw(self, obj: Obj) -> None:
        name = obj["metadata"]["name"]
        if (obj.get("status") or {}).get("resourceClaimStatuses") and name not in self.claimed:
            self.claimed.add(name)
            if len(self.claimed) == self.pods:
                self.all_claimed.set()
        if obj["spec"].get("nodeName") and name not in self.bound:
            self.bound[name] = time.perf_counter()
            if self.scheduler_pid is not None and len(self.bound) in (1, self.pods):
                cpu = cpu_seconds(self.scheduler_pid)
                self.cpu_at_first = cpu if len(self.bound) == 1 else self.cpu_at_first
                self.cpu_at_last = cpu
            if len(self.bound) == self.pods:
                self.all_bound.set()


def metric_values(text: str) -> dict[str, float]:
    """The few scheduler metrics the report uses, summed over their other labels."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "scheduler_schedule_attempts_total":
                key = f"attempts_{sample.labels.get('result')}"
            elif sample.name in ("scheduler_scheduling_algorithm_duration_seconds_sum",
                                 "scheduler_scheduling_algorithm_duration_seconds_count"):
                key = sample.name.rsplit("_", 1)[1]
            else:
                continue
            wanted[key] = wanted.get(key, 0.0) + sample.value
    return wanted


@dataclass
class Round:
    variant: str
    pods_per_s: float
    cpu_ms_per_pod: float
    algorithm_ms: float
    attempts: float
    create_s: float


async def collection_delete(kube: Kube, path: str) -> None:
    await kube.request("DELETE", path, body={"apiVersion": "v1", "kind": "DeleteOptions"})


async def gone(kube: Kube, namespace: str | None) -> None:
    """The last round's namespace deleted (its pods at once: grace 0; its claims once the
    controller-manager has dropped their reservations), so that no allocation of it is left."""
    if namespace is not None:
        async def absent() -> bool:
            return await kube.get(NAMESPACE, namespace) is None

        await wait_for(absent, timeout=300, what=f"namespace {namespace} deleted", interval=0.2)


async def check_allocations(kube: Kube, namespace: str, variant: Variant) -> None:
    """The first claims (every template's) allocated from the variant's driver; with consumable
    capacity, some holding a share of a GPU: the scheduler did the work the variant asks for."""
    claims = (await kube.request("GET", CLAIM.path(namespace), query={"limit": 40})).get("items") or []
    results = [r for c in claims for r in (((c.get("status") or {}).get("allocation") or {})
                                           .get("devices") or {}).get("results") or []]
    if not claims or len(results) != len(claims) or any(r["driver"] != variant.driver for r in results):
        raise RuntimeError(f"{namespace}: {len(claims)} claims, {len(results)} allocated from {variant.driver}")
    if variant.sharing is not None and not any(r.get("shareID") for r in results):
        raise RuntimeError(f"{namespace}: no claim holds a share of a GPU; consumable capacity went unused")


async def run_round(plane: SchedulerBench, kube: Kube, variant: Variant, nodes: dict[str, str],
                    generation: int, last_namespace: str | None, swap: bool, pods: int = PODS) -> tuple[Round, str]:
    """One round; the namespace to delete after it (the next round waits for that, after its own
    set-up: the deletion overlaps it)."""
    # The variant's slices replace the last round's (no scheduler runs: nothing is seen half-done).
    if swap:
        await collection_delete(kube, SLICE.path())
        created = await bounded([functools.partial(kube.create, s) for s in slices_of(variant, nodes, generation)])
        if variant.sharing is not None and not keeps_sharing(created[0]):
            raise RuntimeError("the API server dropped allowMultipleAllocations: DRAConsumableCapacity is off")
    namespace = await create_scratch_namespace(kube, f"sched-{variant.name}")
    for name, request in variant.templates.items():
        await kube.create(claim_template(name, namespace, request))
    tracker = PodTracker(kube, namespace, pods)
    await tracker.start()
    try:
        names = list(variant.templates)
        started = time.perf_counter()
        await bounded([functools.partial(kube.create, pod(f"p-{i:05d}", namespace, names[i % len(names)]))
                       for i in range(pods)])
        await tracker.wait(tracker.all_claimed, 300, "every pod's claim made by the controller-manager")
        create_s = time.perf_counter() - started
        await gone(kube, last_namespace)
        tracker.scheduler_pid = plane.start_scheduler()
        try:
            await tracker.wait(tracker.all_bound, 120 + pods / 2, f"every pod bound ({variant.name})")
        except TimeoutError as error:
            raise RuntimeError(f"{error}\n--- kube-scheduler log tail ---\n{plane.scheduler.log_tail()}") from None
        metrics = metric_values(await asyncio.to_thread(plane.scheduler_metrics))
        plane.stop_scheduler()
    finally:
        await tracker.stop()
    await check_allocations(kube, namespace, variant)
    await kube.delete(NAMESPACE, namespace)
    times = sorted(tracker.bound.values())
    result = Round(variant.name, (pods - 1) / (times[-1] - times[0]),
                   1000 * (tracker.cpu_at_last - tracker.cpu_at_first) / (pods - 1),
                   1000 * metrics.get("sum", 0.0) / max(metrics.get("count", 0.0), 1.0),
                   sum(v for k, v in metrics.items() if k.startswith("attempts_")), create_s)
    print(f"[scheduler_throughput] {result}", file=sys.stderr, flush=True)
    return result, namespace


async def measure(ctx: Context, bin_dir: Path, variants: list[Variant], label: str,
                  nodes_count: int = NODES, pods: int = PODS) -> tuple[str, list[Round]]:
    """Every variant's rounds on one fresh control plane of ``bin_dir`` with ``nodes_count`` Nodes;
    its version and the rounds."""
    plane = SchedulerBench(bin_dir, ctx.workdir(f"scheduler_throughput-{label}") / "cluster")
    await asyncio.to_thread(plane.start)
    api = await connect(str(plane.kubeconfig))
    kube = Kube(api, "bench", Deadlines(request=120.0))  # a collection delete of 1,000 slices on a busy machine
    try:
        version = str((await kube.request("GET", "/version"))["gitVersion"])
        for device_class in device_classes(sharing=any(v.sharing for v in variants)):
            await kube.create(device_class)
        started = time.monotonic()
        created = await bounded([functools.partial(create_fake_node, kube, f"gpu-{i:05d}")
                                 for i in range(nodes_count)])
        nodes = {n["metadata"]["name"]: n["metadata"]["uid"] for n in created}
        print(f"[scheduler_throughput] {version}: {nodes_count} nodes in {time.monotonic() - started:.0f}s",
              file=sys.stderr, flush=True)
        rounds: list[Round] = []
        namespace: str | None = None
        order = [v for _ in range(ROUNDS) for v in (*variants, *reversed(variants))]  # ABBA
        for generation, variant in enumerate(order, start=1):
            swap = generation == 1 or order[generation - 2] is not variant
            result, namespace = await run_round(plane, kube, variant, nodes, generation, namespace, swap, pods)
            rounds.append(result)
        return version, rounds
    finally:
        await api.close()
        await asyncio.to_thread(plane.stop)


def summary(version: str, rounds: list[Round], variant: str, target: bool, base_name: str = "minimal",
            nodes_count: int = NODES, pods: int = PODS) -> list[Result]:
    """``variant`` against the baseline (minimal slices): pods/s (the issue's figure) and pods per
    scheduler CPU second (the same ratio where the scheduler's CPU is the limit, as on a small
    machine, and much steadier when other work shares the machine)."""
    def of(name: str, field: str) -> list[float]:
        return [getattr(r, field) for r in rounds if r.variant == name]

    def row(metric: str, ratio: float, note: str) -> Result:
        return Result(metric, ratio, "x", f">= {TARGET:g}" if target else "", ratio >= TARGET if target else None,
                      note)

    def listed(values: list[float]) -> str:
        return "/".join(f"{v:.1f}" for v in values)

    mine, base = of(variant, "pods_per_s"), of(base_name, "pods_per_s")
    mine_cpu, base_cpu = of(variant, "cpu_ms_per_pod"), of(base_name, "cpu_ms_per_pod")
    scale = f"{pods} pods a round, {nodes_count} nodes x {GPUS}"
    versus = "minimal slices" if base_name == "minimal" else base_name
    return [
        row(f"pods/s, {variant} vs {versus} ({version})", median(mine) / median(base),
            f"{listed(mine)} vs {listed(base)} pods/s by round; {scale}"),
        row(f"pods per scheduler CPU second, {variant} vs {versus} ({version})", median(base_cpu) / median(mine_cpu),
            f"scheduler CPU {listed(mine_cpu)} vs {listed(base_cpu)} ms/pod; its scheduling algorithm "
            f"{median(of(variant, 'algorithm_ms')):.1f} vs {median(of(base_name, 'algorithm_ms')):.1f} ms/pod"),
    ]


async def compare(ctx: Context, bin_dir: Path, variants: list[Variant], label: str,
                  nodes_count: int = NODES, pods: int = PODS) -> list[Result]:
    """The rows of one control plane: pods/s of each variant, and each variant against the first."""
    version, rounds = await measure(ctx, bin_dir, variants, label, nodes_count, pods)
    results = [Result(f"pods/s, {v.name} slices ({version})",
                      median([r.pods_per_s for r in rounds if r.variant == v.name]), "pods/s") for v in variants]
    for variant in variants[1:]:
        results += summary(version, rounds, variant.name, variant.name in TARGETS, variants[0].name, nodes_count,
                           pods)
    return results


async def run(ctx: Context) -> list[Result]:
    started = time.monotonic()
    results = await compare(ctx, find_binaries(), variants_from("BENCH_SCHED_VARIANTS", "minimal,gpudra"),
                            "current")
    try:
        next_bin = next_release_binaries(NEXT_VERSION)
    except RuntimeError as error:  # a failed row, never a skipped one
        results.append(Result(f"pods/s, consumable vs minimal slices ({NEXT_VERSION})", float("nan"), "x",
                              f">= {TARGET:g}", False, str(error)))
    else:
        results += await compare(ctx, next_bin, variants_from("BENCH_SCHED_NEXT_VARIANTS", "minimal,consumable"),
                                 "next")
        # Dynamic MIG (issue 34): a 1g.10gb placement against a 7g.80gb one, both over counters
        results += await compare(ctx, next_bin, variants_from("BENCH_SCHED_MIG_VARIANTS", "dynamic-7g,dynamic-mig"),
                                 "mig", MIG_NODES, MIG_PODS)
    results.append(Result("module runtime", time.monotonic() - started, "s"))
    return results
