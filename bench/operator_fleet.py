"""The operator at fleet scale: 500, 2,000 and 5,000 fake Nodes x 8 GPUs (one slice per Node,
written directly, owned by its Node; an agent pod bound to each Node), on this bench's own
control plane with the audit log on and without the DaemonSet controller: the bench writes the
agent DaemonSet's status as that controller would (it has no kubelets to count). One
`gpudra operator` as deployed (leader election on, `--namespace gpudra-system`, a user of its own
so the audit log counts its requests), started afresh at each size; drift ticks off (one hour),
so that nothing but the step measured makes requests.

Per size:
- start -> devices counted: operator start to status.devices == nodes x 8 (its slice watch listed)
- spec change -> converged: ten DeviceClasses and the DaemonSet's image changed; the time to Ready
  at the new generation with every child updated (the stand-in DaemonSet controller answers the new
  generation at once), against `kubectl apply --server-side` of the same objects (target <= 2x)
- requests per reconcile: the operator's requests for that change, from the audit log (no Lease
  renewals, no watches); the same at every size is the target
- GC pass: the list pages of one pass (slices, Nodes, agent pods; 500 a page) and its duration
- rollout: one DaemonSet status write per agent updated (nodes writes, as fast as the bench
  makes them); the operator's requests per write, its CPU seconds, and the lag from the last
  write to status.agents.updated == nodes
- RSS: VmRSS once converged; VmHWM (peak) after all of the above (target <= 300 MiB); and the
  peak of the operator's gpudra-allocator child, which matches the devices against the classes
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from bench import Context, Result, at_most
from gpudra_core.kubeapi import Kube, Obj, connect, resource_type
from gpudra_operator.crd import default_object
from gpudra_dev.localcluster.audit import AuditLog
from gpudra_dev.localcluster.controlplane import CONTROLLERS, ControlPlane, find_binaries
from gpudra_dev.localcluster.fleet import add_gpu_nodes, node_names
from gpudra_dev.localcluster.objects import install_crd
from gpudra_dev.localcluster.replicas import Replica, Replicas
from gpudra_dev.localcluster.waiting import wait_for
from gpudra_operator.render import render

CONFIG = resource_type("gpudra.io/v1alpha1", "GpuDraConfig")
DEVICE_CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")
DAEMONSET = resource_type("apps/v1", "DaemonSet")
SIZES = [int(n) for n in os.environ.get("BENCH_FLEET_SIZES", "500,2000,5000").split(",")]
ROUNDS = int(os.environ.get("BENCH_FLEET_ROUNDS", "3"))
DEVICES = 8
NAME, DRIVER, NAMESPACE = "fleet", "gpu.gpudra.io", "gpudra-system"
BASELINE_NAME, BASELINE_NAMESPACE = "kubectl", "kubectl-ns"
USER = "gpudra-operator-fleet"
RSS_TARGET_MIB, RATIO_TARGET = 300, 2.0
MEMORY = itertools.count(65)  # every change of the bench sets a memory not used before: all ten classes change


def config_spec(memory: str, image: str, namespace: str = NAMESPACE) -> Obj:
    return {"driverName": DRIVER,
            "agent": {"namespace": namespace, "image": image, "nodeSelector": {"gpudra.io/fake-node": "true"}},
            "deviceClasses": [{"name": f"fleet-c{i}.gpudra.io" if namespace == NAMESPACE else f"kc-c{i}.gpudra.io",
                               "template": "min-memory", "parameters": {"memory": memory}} for i in range(10)],
            "resourceSliceGC": {"interval": "1h", "gracePeriod": "168h"}}


class DaemonSetController:
    """What the DaemonSet controller would write for the fleet's agents: every new generation of
    the DaemonSet rolled out at once (for a spec change), or one agent at a time (a rollout)."""

    def __init__(self, kube: Kube, nodes: int) -> None:
        self.kube, self.nodes = kube, nodes
        self._task: asyncio.Task[None] | None = None

    def status(self, generation: int, updated: int) -> Obj:
        n = self.nodes
        return {"observedGeneration": generation, "desiredNumberScheduled": n, "currentNumberScheduled": n,
                "updatedNumberScheduled": updated, "numberReady": n, "numberAvailable": n,
                "numberUnavailable": 0, "numberMisscheduled": 0}

    async def write(self, generation: int, updated: int) -> None:
        await self.kube.patch(DAEMONSET, "gpudra-agent", {"status": self.status(generation, updated)},
                              namespace=NAMESPACE, subresource="status")

    def start(self) -> None:
        self._task = asyncio.create_task(self._follow())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _follow(self) -> None:
        while True:
            async for kind, ds in self.kube.watch(DAEMONSET, NAMESPACE, field_selector="metadata.name=gpudra-agent"):
                if kind in ("ADDED", "MODIFIED"):
                    generation = ds["metadata"]["generation"]
                    if (ds.get("status") or {}).get("observedGeneration") != generation:
                        await self.write(generation, self.nodes)


def proc_status(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM in MiB, CPU seconds (user + system)."""
    fields: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon"):
            fields[key] = int(value.split()[0]) / 1024
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    fields["cpu_s"] = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    return fields


def helper_status(pid: int) -> dict[str, float] | None:
    """:func:`proc_status` of the operator's gpudra-allocator child (the class counts' CEL), None
    when it has none. Its VmHWM is that process's peak: a helper restarted after a crash starts
    counting again."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm, _, rest = (entry / "stat").read_text().partition(") ")
            if int(rest.split()[1]) == pid and comm.endswith("(gpudra-allocato"):  # comm: 15 characters
                return proc_status(int(entry.name))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return None


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (every thread's, from /proc)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


class CombinedPeak:
    """The largest sums of the operator's and its children's VmRSS, and of their RssAnon (what is
    theirs alone: no pages of executables and libraries, which the page cache shares), seen
    sampled every 100 ms: the memory the operator pod holds at once (the gpudra-allocator child
    comes and goes)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak_mib, self.peak_anon_mib = pid, 0.0, 0.0
        self.trace = os.environ.get("BENCH_RSS_TRACE")  # a file for every sample: seconds, MiB per process
        self._task = asyncio.create_task(self._sample(), name="rss sampler")

    async def _sample(self) -> None:
        started = time.monotonic()
        while True:
            try:
                status = [proc_status(p) for p in [self.pid, *children(self.pid)]]
                if self.trace:
                    with open(self.trace, "a") as trace:
                        trace.write(f"{time.monotonic() - started:.1f} " + " ".join(
                            f"{s['VmRSS']:.1f}/{s.get('RssAnon', 0.0):.1f}" for s in status) + "\n")
                self.peak_mib = max(self.peak_mib, sum(s["VmRSS"] for s in status))
                self.peak_anon_mib = max(self.peak_anon_mib, sum(s.get("RssAnon", 0.0) for s in status))
            except (FileNotFoundError, ProcessLookupError, KeyError):
                pass
            await asyncio.sleep(0.1)

    async def stop(self) -> tuple[float, float]:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        return self.peak_mib, self.peak_anon_mib


def counts(entry: Obj) -> bool:
    """One of the operator's requests that a step costs: not the Lease's renewals (they go on
    whatever else happens) and not a watch (logged only when it ends)."""
    return entry["user"]["username"] == USER and entry["verb"] != "watch" \
        and (entry.get("objectRef") or {}).get("resource") != "leases"


async def quiet(audit: AuditLog, seconds: float = 1.0, timeout: float = 60) -> Counter[str]:
    """The operator's requests since the mark (by "verb resource") once it has made none for
    ``seconds``: the end of a measurement window (the echoes of its own writes come in after the
    state a probe sees). Reads only what the log gained since the last look."""
    deadline, since = time.monotonic() + timeout, time.monotonic()
    seen: Counter[str] = Counter()
    with audit.path.open("rb") as log:
        log.seek(audit.offset)
        while time.monotonic() < deadline:
            new = [json.loads(line) for line in log.readlines()]
            added = Counter(f"{e['verb']} {(e.get('objectRef') or {}).get('resource')}" for e in new
                            if e.get("stage") == "ResponseComplete" and counts(e))
            if added:
                seen += added
                since = time.monotonic()
            elif time.monotonic() - since >= seconds:
                break
            await asyncio.sleep(0.1)  # the polling period of the log file, not synchronisation
    return seen


def by_verb(requests: Counter[str]) -> Counter[str]:
    verbs: Counter[str] = Counter()
    for key, n in requests.items():
        verbs[key.split()[0]] += n
    return verbs


async def converged(kube: Kube, memory: str, image: str, nodes: int) -> bool:
    live = await kube.get(CONFIG, NAME)
    status = (live or {}).get("status") or {}
    ready = next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), None)
    if not live or not ready or ready["status"] != "True" or status.get("observedGeneration") != live["metadata"]["generation"] \
            or (status.get("agents") or {}).get("updated") != nodes:
        return False
    ds, *classes = await asyncio.gather(kube.get(DAEMONSET, "gpudra-agent", NAMESPACE),
                                        *(kube.get(DEVICE_CLASS, f"fleet-c{i}.gpudra.io") for i in range(10)))
    return bool(ds and ds["spec"]["template"]["spec"]["containers"][0]["image"] == image
                and all(c and f'quantity("{memory}")' in c["spec"]["selectors"][0]["cel"]["expression"] for c in classes))


def kubectl_apply(plane: ControlPlane, memory: str, image: str, workdir: Path) -> float:
    live = default_object({"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig",
                           "metadata": {"name": BASELINE_NAME, "uid": "00000000-0000-0000-0000-000000000000"},
                           "spec": config_spec(memory, image, BASELINE_NAMESPACE)})
    objects = []
    for obj in render(live).objects:
        obj["metadata"].pop("ownerReferences", None)  # no such owner: the garbage collector would delete them
        obj["metadata"].pop("labels", None)  # not the operator's: its child handlers ignore them
        objects.append(obj)
    path = workdir / f"kubectl-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump_all(objects))
    started = time.perf_counter()
    plane.kubectl("apply", "--server-side", "--field-manager=bench", "-f", str(path))
    return time.perf_counter() - started


async def measure_size(ctx: Context, plane: ControlPlane, kube: Kube, audit: AuditLog, replicas: Replicas,
                       nodes: int, workdir: Path, first: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"nodes": nodes}
    controller = DaemonSetController(kube, nodes)
    ds = await kube.get(DAEMONSET, "gpudra-agent", NAMESPACE)
    if ds is not None:  # the fleet grew: the controller would count the new Nodes' agents
        await controller.write(ds["metadata"]["generation"], nodes)
    controller.start()
    operator: Replica | None = None
    try:
        started = time.monotonic()
        operator = replicas.start(f"{USER}")  # the audit log knows it by this user
        combined = CombinedPeak(operator.operator.process.pid)
        if first:
            await kube.create({"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig", "metadata": {"name": NAME},
                               "spec": config_spec("64Gi", "example.com/gpudra:0")})

        async def counted_devices() -> bool:
            status = ((await kube.get(CONFIG, NAME)) or {}).get("status") or {}
            return status.get("devices") == nodes * DEVICES and (status.get("agents") or {}).get("desired") == nodes \
                and bool((status.get("gc") or {}).get("lastRun"))  # its first pass is not in what follows

        await wait_for(counted_devices, timeout=300, what=f"status.devices == {nodes * DEVICES}", interval=0.05)
        out["start_to_counted_s"] = time.monotonic() - started
        pid = operator.operator.process.pid
        audit.mark()
        await quiet(audit)
        out["rss_mib"] = proc_status(pid)["VmRSS"]

        operator_s, kubectl_s, requests = [], [], []
        for round_ in range(ROUNDS):
            memory, image = f"{next(MEMORY)}Gi", f"example.com/gpudra:{nodes}-{round_}"
            audit.mark()
            t0 = time.perf_counter()
            await kube.patch(CONFIG, NAME, {"spec": config_spec(memory, image)})
            await wait_for(lambda: converged(kube, memory, image, nodes), timeout=120, what="the change converged",
                           interval=0.01)
            operator_s.append(time.perf_counter() - t0)
            requests.append(await quiet(audit))
            kubectl_s.append(await asyncio.to_thread(kubectl_apply, plane, memory, image, workdir))
        out["change_s"], out["kubectl_s"] = statistics.median(operator_s), statistics.median(kubectl_s)
        out["change_ratio"] = out["change_s"] / out["kubectl_s"]
        out["reconcile_requests"] = dict(by_verb(requests[-1]))
        out["reconcile_requests_each_round"] = [sum(r.values()) for r in requests]
        out["reconcile_requests_detail"] = [dict(sorted(r.items())) for r in requests]
        # The agents' device-plugin Events are listed once per 10 s (REUSE_TTL), in a round or not.
        out["reconcile_requests_but_events"] = [sum(r.values()) - r["list events"] for r in requests]
        out["peak_rss_after_changes_mib"] = proc_status(pid)["VmHWM"]

        # One GC pass: the interval shortened until a pass has run (its lists by resource).
        gc_before = (((await kube.get(CONFIG, NAME)) or {}).get("status") or {}).get("gc", {}).get("lastRun")
        log_before = operator.operator.log()
        audit.mark()
        await kube.patch(CONFIG, NAME, {"spec": {"resourceSliceGC": {"interval": "10s"}}})

        async def passed() -> bool:
            gc = (((await kube.get(CONFIG, NAME)) or {}).get("status") or {}).get("gc") or {}
            return gc.get("lastRun") not in (None, gc_before)

        await wait_for(passed, timeout=120, what="a GC pass", interval=0.05)
        await kube.patch(CONFIG, NAME, {"spec": {"resourceSliceGC": {"interval": "1h"}}})
        pages = Counter(e["objectRef"]["resource"] for e in audit.entries(user=USER)
                        if e["verb"] == "list" and e["objectRef"]["resource"] in ("resourceslices", "nodes", "pods"))
        out["gc_pages"] = dict(pages)
        match = re.search(r"GC pass over (\d+) slice\(s\), (\d+) node\(s\).* in ([0-9.]+)s",
                          operator.operator.log()[len(log_before):])
        out["gc_pass_s"] = float(match.group(3)) if match else float("nan")
        out["peak_rss_after_gc_mib"] = proc_status(pid)["VmHWM"]
        audit.mark()
        await quiet(audit)

        # A rollout: one status write per agent updated, on a new generation of the DaemonSet.
        await controller.stop()
        ds = await kube.get(DAEMONSET, "gpudra-agent", NAMESPACE)
        assert ds is not None
        generation = ds["metadata"]["generation"]
        audit.mark()
        await controller.write(generation, 0)
        await quiet(audit)
        audit.mark()
        cpu_before = proc_status(pid)["cpu_s"]
        t0 = time.perf_counter()
        for updated in range(1, nodes + 1):
            await controller.write(generation, updated)
        writes_s = time.perf_counter() - t0
        t1 = time.perf_counter()

        async def caught_up() -> bool:
            status = ((await kube.get(CONFIG, NAME)) or {}).get("status") or {}
            return (status.get("agents") or {}).get("updated") == nodes

        await wait_for(caught_up, timeout=120, what="status.agents.updated == nodes", interval=0.01)
        out["rollout_lag_s"] = time.perf_counter() - t1
        rollout = await quiet(audit)
        out["rollout_writes_s"] = writes_s
        out["rollout_requests"] = dict(by_verb(rollout))
        out["rollout_requests_per_write"] = sum(rollout.values()) / nodes
        out["rollout_status_patches"] = rollout["patch gpudraconfigs"]
        out["rollout_cpu_s"] = proc_status(pid)["cpu_s"] - cpu_before
        out["peak_rss_mib"] = proc_status(pid)["VmHWM"]
        helper = helper_status(pid)
        out["helper_peak_rss_mib"] = helper["VmHWM"] if helper else 0.0
        out["helper_rss_mib"] = helper["VmRSS"] if helper else 0.0
        out["combined_peak_rss_mib"], out["combined_peak_anon_mib"] = await combined.stop()
        return out
    finally:
        await controller.stop()
        if operator is not None:
            operator.operator.stop()


async def run_bench(ctx: Context) -> list[dict[str, Any]]:
    workdir = ctx.workdir("operator_fleet")
    plane = ControlPlane(find_binaries(), workdir / "cluster", audit_log=True,
                         controllers=tuple(c for c in CONTROLLERS if c != "daemonset-controller"))
    await asyncio.to_thread(plane.start)
    api = await connect(str(plane.kubeconfig))
    kube = Kube(api, "bench")
    replicas = Replicas(plane, kube, workdir, "gpudra-operator", env={"GPUDRA_DRIFT_INTERVAL": "3600"},
                        args=("--namespace", NAMESPACE))
    try:
        await install_crd(kube)
        for namespace in ("gpudra-operator", NAMESPACE, BASELINE_NAMESPACE):
            await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        for namespace in (NAMESPACE, BASELINE_NAMESPACE):
            await kube.create({"apiVersion": "v1", "kind": "ServiceAccount",
                               "metadata": {"name": "gpudra-agent", "namespace": namespace}})
        audit = AuditLog(plane.audit_log_path)
        results: list[dict[str, Any]] = []
        have = 0
        for size in SIZES:
            started = time.monotonic()
            await add_gpu_nodes(kube, node_names(have, size), driver=DRIVER, devices=DEVICES,
                                agent_namespace=NAMESPACE, config_name=NAME)
            print(f"[operator_fleet] {size} nodes populated (+{size - have} in {time.monotonic() - started:.0f}s)",
                  file=sys.stderr, flush=True)
            have = size
            results.append(await measure_size(ctx, plane, kube, audit, replicas, size, workdir, first=not results))
            print(f"[operator_fleet] {results[-1]}", file=sys.stderr, flush=True)
        return results
    finally:
        replicas.stop_all()
        await api.close()
        await asyncio.to_thread(plane.stop)


def lean_allocator() -> str:
    """The operator image's gpudra-allocator (hack/allocator-bin.sh VARIANT=lean): the bench's
    operator runs what the image runs."""
    done = subprocess.run([str(Path(__file__).resolve().parents[1] / "hack" / "allocator-bin.sh")],
                          env={**os.environ, "VARIANT": "lean"}, capture_output=True, text=True, check=True, timeout=1800)
    return done.stdout.strip().splitlines()[-1]


async def run(ctx: Context) -> list[Result]:
    os.environ["GPUDRA_ALLOCATOR_DIR"] = await asyncio.to_thread(lean_allocator)  # the operator inherits it
    rows: list[Result] = []
    results = await run_bench(ctx)
    for r in results:
        n = f"{r['nodes']} nodes"
        rows += [
            at_most(f"{n}: peak RSS", r["peak_rss_mib"], "MiB", RSS_TARGET_MIB,
                    f"VmHWM after change, GC pass and rollout; VmRSS {r['rss_mib']:.0f} MiB once converged"),
            at_most(f"{n}: peak RSS, operator + gpudra-allocator at once", r["combined_peak_rss_mib"], "MiB",
                    RSS_TARGET_MIB, "the largest sum of both VmRSS, sampled every 100 ms from the operator's start"),
            Result(f"{n}: peak RssAnon, operator + gpudra-allocator at once", r["combined_peak_anon_mib"], "MiB",
                   note="the same, without pages of executables and libraries (shared, reclaimable page cache)"),
            Result(f"{n}: gpudra-allocator peak RSS", r["helper_peak_rss_mib"], "MiB",
                   note=f"VmHWM of the operator's helper child (the class counts' CEL) at the end; VmRSS "
                        f"{r['helper_rss_mib']:.0f} MiB; 0: none running"),
            Result(f"{n}: start -> devices counted", r["start_to_counted_s"], "s",
                   note=f"status.devices == {r['nodes'] * DEVICES}"),
            at_most(f"{n}: spec change -> converged", r["change_ratio"], "x kubectl", RATIO_TARGET,
                    f"operator {r['change_s']:.3f}s vs kubectl apply --server-side {r['kubectl_s']:.3f}s "
                    f"(10 classes + DaemonSet), median of {ROUNDS}"),
            Result(f"{n}: requests per reconcile", sum(r["reconcile_requests"].values()), "requests",
                   note=f"{r['reconcile_requests']} (last round); per round {r['reconcile_requests_each_round']}"),
            Result(f"{n}: GC pass list pages", sum(r["gc_pages"].values()), "requests",
                   note=f"{r['gc_pages']}; pass {r['gc_pass_s']:.2f}s"),
            Result(f"{n}: rollout requests per status write", r["rollout_requests_per_write"], "requests",
                   note=f"{r['nodes']} DaemonSet status writes in {r['rollout_writes_s']:.1f}s; operator "
                        f"{r['rollout_requests']}, {r['rollout_cpu_s']:.1f} CPU s; caught up "
                        f"{r['rollout_lag_s']:.2f}s after the last write"),
        ]
    per_size = [r["reconcile_requests_but_events"] for r in results]
    spread = max(max(p) for p in per_size) - min(min(p) for p in per_size)
    rows.append(Result("requests per reconcile: spread over fleet sizes and rounds", spread, "requests", "== 0",
                       spread == 0, f"{[r['nodes'] for r in results]}: {per_size} (without the device-plugin Events "
                                    "LIST, made once per 10 s whether a reconcile runs or not)"))
    return rows


if __name__ == "__main__":
    sys.exit(__import__("bench.__main__", fromlist=["main"]).main(["operator_fleet"]))
