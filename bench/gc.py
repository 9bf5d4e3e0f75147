"""ResourceSlice GC at fleet size: 2,000 fake Nodes, each with one 8-device slice and one agent pod,
plus 500 stale slices (no owner, their Node gone: rule node-gone), on this bench's own control
plane with the apiserver's audit log on.

- pass: wall time of one GC pass (``SliceCollector.run_pass``: three paginated lists, the decision,
  500 preconditioned deletes, the status.gc patch, the Event) with the delete rate limit off
- baseline: a bare loop issuing the same 500 preconditioned deletes (uid + resourceVersion) one
  after another, in the same run on fresh copies of the stale slices; also a bare loop with the
  GC's own delete concurrency (8), for reference
- the ratio (target <= 1.0x) is the median over the rounds of each pass over the bare loop of
  its own round. The two run back to back, in turns (even rounds the pass first, odd rounds the
  loop first), after one unmeasured warm-up round of both (50 slices each: the collector's client
  opens its connections, the API server serves its first lists and deletes), so load on the
  machine, which comes and goes, falls on both sides of a ratio alike. The CPU seconds of both
  sides (this process, etcd, kube-apiserver, the controller manager and the scheduler) are given
  for reference: the pass's deletes are 8 in flight, so it wins on time only while a core is free
- requests: counted exactly from the audit log (one ResponseComplete line per request, matched by
  the pass's own User-Agent), in every round, cross-checked with a count in the adapter
  (Kube.request); target: stale deletions + list pages, plus the two visibility writes (status.gc
  patch, Event)
- rss: the real operator (`gpudra operator` subprocess) at that size — its peak RSS (VmHWM) after its
  own first GC pass over the same 2,500 slices, 2,000 Nodes (here with all 2,000 slices pending:
  its config selects none of the Nodes, grace 168h) and 500 fresh stale slices it deletes
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any

from bench import Context, Result, at_most
from gpudra_core.kubeapi import Kube, Obj, connect, resource_type
from gpudra_operator.events import EventRecorder
from gpudra_dev.localcluster.audit import AuditLog
from gpudra_dev.localcluster.controlplane import ControlPlane, find_binaries
from gpudra_dev.localcluster.fleet import CREATE_CONCURRENCY, add_gpu_nodes, bounded, node_names
from gpudra_dev.localcluster.objects import FAKE_NODE_LABEL, fake_slice, install_crd
from gpudra_dev.localcluster.operatorproc import start_operator
from gpudra_dev.localcluster.waiting import wait_for
from gpudra_operator.slicegc.apply import SliceCollector

NODES = int(os.environ.get("BENCH_GC_NODES", "2000"))
STALE = int(os.environ.get("BENCH_GC_STALE", "500"))
DEVICES = 8
PAGE = 500
DELETE_CONCURRENCY = 8  # SliceCollector's default
DRIVER = "gpu.gpudra.io"
NAMESPACE = "gpudra-system"
CONFIG_NAME = "bench-gc"
OPERATOR_CONFIG = "bench-gc-operator"
GC_AGENT = "gpudra-gc-bench"
RATIO_TARGET = 1.0
WARM_UP = 50  # stale slices of the unmeasured round
MAX_ROUNDS = 5
RSS_TARGET_MIB = 200
CONFIG = resource_type("gpudra.io/v1alpha1", "GpuDraConfig")
SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
SERVICE_ACCOUNT = resource_type("v1", "ServiceAccount")


class CountingKube(Kube):
    """Counts the requests that pass through the adapter, by HTTP verb."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counts: dict[str, int] = {}

    async def request(self, method: str, path: str, **kwargs: Any) -> Obj:  # type: ignore[override]
        self.counts[method] = self.counts.get(method, 0) + 1
        return await super().request(method, path, **kwargs)


async def populate(kube: Kube) -> None:
    await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    await wait_for(lambda: kube.get(SERVICE_ACCOUNT, "default", NAMESPACE), timeout=60, what="default SA")
    await add_gpu_nodes(kube, node_names(0, NODES), driver=DRIVER, devices=DEVICES, agent_namespace=NAMESPACE,
                        config_name=CONFIG_NAME)


async def make_stale(kube: Kube, tag: str, count: int = STALE) -> list[tuple[str, str, str]]:
    """``count`` ownerless slices on Nodes that do not exist; (name, uid, resourceVersion) each."""
    created = await bounded([functools.partial(kube.create, fake_slice(f"gone-{tag}-{i:04d}", DRIVER,
                                                                       f"gone-{tag}-{i:04d}", devices=DEVICES))
                             for i in range(count)])
    return [(s["metadata"]["name"], s["metadata"]["uid"], s["metadata"]["resourceVersion"]) for s in created]


def config_body(name: str, namespace: str, node_selector: dict[str, str]) -> Obj:
    return {"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig", "metadata": {"name": name},
            "spec": {"driverName": DRIVER, "agent": {"namespace": namespace, "nodeSelector": node_selector},
                     "resourceSliceGC": {"gracePeriod": "168h", "interval": "24h"}}}


async def reconciled_config(kube: Kube) -> Obj:
    created = await kube.create(config_body(CONFIG_NAME, NAMESPACE, {FAKE_NODE_LABEL: "true"}))
    # No operator runs in this phase: write what its reconciler would (reconciled, no conflict).
    await kube.patch(CONFIG, CONFIG_NAME, {"status": {
        "observedGeneration": created["metadata"]["generation"],
        "conditions": [{"type": "Degraded", "status": "False", "reason": "AsExpected", "message": "",
                        "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}, subresource="status")
    config = await kube.get(CONFIG, CONFIG_NAME)
    assert config is not None
    return config


class CpuMeter:
    """CPU seconds (user + system) of this process and of the control plane's processes."""

    def __init__(self, plane: ControlPlane) -> None:
        self.pids = [c.process.pid for c in plane.components if c.process is not None]

    def read(self) -> float:
        return time.process_time() + sum(proc_cpu_s(pid) for pid in self.pids)


def proc_cpu_s(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "; utime, stime are fields 14, 15
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def status_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


async def operator_rss(plane: ControlPlane, kube: Kube, workdir: Path) -> dict[str, float]:
    await kube.delete(CONFIG, CONFIG_NAME)
    await make_stale(kube, "op")
    await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "bench-gc-op"}})
    log_path = workdir / "operator.log"
    operator = start_operator(kubeconfig=plane.kubeconfig, log_path=log_path,
                              env={"GPUDRA_DRIFT_INTERVAL": "3600", "GPUDRA_GC_TICK": "0.2",
                                   "GPUDRA_GC_DELETE_RATE": "0"})
    try:
        await kube.create(config_body(OPERATOR_CONFIG, "bench-gc-op", {"bench": "none"}))

        async def passed() -> Obj | None:
            gc = ((await kube.get(CONFIG, OPERATOR_CONFIG) or {}).get("status") or {}).get("gc") or {}
            return gc if gc.get("lastRun") else None

        gc = await wait_for(passed, timeout=300, what="the operator's first GC pass", interval=0.2)
        memory = status_kib(operator.process.pid)
        match = re.search(r"GC pass over (\d+) slice\(s\), (\d+) node\(s\).* in ([0-9.]+)s", log_path.read_text())
        return {"rss_mib": memory["VmRSS"] / 1024, "peak_rss_mib": memory["VmHWM"] / 1024,
                "deleted": gc.get("deleted", 0), "pending": gc.get("pending", 0),
                "pass_s": float(match.group(3)) if match else math.nan}
    finally:
        operator.stop()


async def run(ctx: Context) -> list[Result]:
    workdir = ctx.workdir("gc")
    plane = ControlPlane(find_binaries(), workdir / "cluster", audit_log=True)
    await asyncio.to_thread(plane.start)
    api = await connect(str(plane.kubeconfig))
    gc_api = await connect(str(plane.kubeconfig))
    gc_api.user_agent = GC_AGENT
    kube = Kube(api, "bench")
    audit = AuditLog(plane.audit_log_path)
    rounds = max(1, min(ctx.repeat, MAX_ROUNDS))
    try:
        await install_crd(kube)
        started = time.perf_counter()
        await populate(kube)
        populate_s = time.perf_counter() - started
        body = await reconciled_config(kube)

        meter = CpuMeter(plane)

        async def gc_pass(tag: str, count: int = STALE) -> tuple[float, float, dict[str, int], dict[str, int]]:
            """One pass over ``count`` fresh stale slices: seconds, CPU seconds, requests (audit, adapter)."""
            await make_stale(kube, tag, count)
            counting = CountingKube(gc_api, "gpudra-operator")
            collector = SliceCollector(counting, EventRecorder(counting), delete_rate=0)
            audit.mark()
            cpu, started = meter.read(), time.perf_counter()
            result = await collector.run_pass(body)
            elapsed, cpu = time.perf_counter() - started, meter.read() - cpu
            assert result is not None and len(result.deleted) == count and not result.errors, result
            assert result.slices == NODES + count and result.nodes == NODES and result.agent_pods == NODES
            return elapsed, cpu, audit.verbs(user_agent=GC_AGENT), counting.counts

        async def bare_loop(tag: str, count: int = STALE) -> tuple[float, float]:
            stale = await make_stale(kube, tag, count)
            cpu, started = meter.read(), time.perf_counter()
            for name, uid, version in stale:
                await kube.delete(SLICE, name, uid=uid, resource_version=version)
            return time.perf_counter() - started, meter.read() - cpu

        # Unmeasured: both sides' first lists and deletes, the collector's client's connections.
        await gc_pass("warm", WARM_UP)
        await bare_loop("warmseq", WARM_UP)

        passes, loops, ratios, concurrent_loops = [], [], [], []
        pass_cpu, loop_cpu = [], []
        audited_rounds: list[dict[str, int]] = []
        adapter: dict[str, int] = {}
        for round_ in range(rounds):
            if round_ % 2 == 0:
                gc_s, gc_cpu, audited, adapter = await gc_pass(f"gc{round_}")
                loop_s, cpu = await bare_loop(f"seq{round_}")
            else:
                loop_s, cpu = await bare_loop(f"seq{round_}")
                gc_s, gc_cpu, audited, adapter = await gc_pass(f"gc{round_}")
            passes.append(gc_s)
            loops.append(loop_s)
            ratios.append(gc_s / loop_s)
            pass_cpu.append(gc_cpu)
            loop_cpu.append(cpu)
            audited_rounds.append(audited)

            stale = await make_stale(kube, f"par{round_}")
            started = time.perf_counter()
            await bounded([functools.partial(kube.delete, SLICE, s[0], uid=s[1], resource_version=s[2])
                           for s in stale], DELETE_CONCURRENCY)
            concurrent_loops.append(time.perf_counter() - started)

        pages = math.ceil((NODES + STALE) / PAGE) + 2 * math.ceil(NODES / PAGE)  # slices, nodes, agent pods
        expected = STALE + pages + 2  # + the status.gc patch and the Event
        totals = [sum(a.values()) for a in audited_rounds]
        total = max(totals, key=lambda t: abs(t - expected))  # the one furthest off, if any is
        rss = await operator_rss(plane, kube, workdir)
    finally:
        await api.close()
        await gc_api.close()
        await asyncio.to_thread(plane.stop)

    gc_s, loop_s, par_s = statistics.median(passes), statistics.median(loops), statistics.median(concurrent_loops)
    size = f"{NODES} nodes x {DEVICES} devices + {STALE} stale, median of {rounds}"
    return [
        Result("setup_s", populate_s, "s", note=f"{NODES} Nodes + slices + agent pods, {CREATE_CONCURRENCY} at a time"),
        Result("pass_s", gc_s, "s", note=size + "; delete rate limit off, 8 deletes in flight"),
        Result("bare_delete_loop_s", loop_s, "s", note=f"{STALE} preconditioned deletes, one after another"),
        at_most("pass_vs_bare_loop", statistics.median(ratios), "x", RATIO_TARGET,
                f"median of {rounds} rounds' pass / their own bare loop, in turns after a warm-up "
                f"({', '.join(f'{r:.2f}' for r in ratios)}); issue target: <= 1.0x"),
        Result("pass_vs_bare_loop_cpu", statistics.median(pass_cpu) / statistics.median(loop_cpu), "x",
               note=f"reference: CPU s of this process + the control plane, pass {statistics.median(pass_cpu):.2f}, "
                    f"loop {statistics.median(loop_cpu):.2f} (medians)"),
        Result("pass_vs_concurrent_loop", gc_s / par_s, "x",
               note=f"reference: the same deletes {DELETE_CONCURRENCY} in flight took {par_s:.3f}s"),
        Result("requests", total, "", f"== {expected}", all(t == expected for t in totals),
               f"audit log by User-Agent, each of {rounds} rounds: {totals}, the last {audited_rounds[-1]}; = {STALE} "
               f"deletes + {pages} list pages + status patch + Event; adapter counted {adapter}"),
        at_most("operator_peak_rss_mib", rss["peak_rss_mib"], "MiB", RSS_TARGET_MIB,
                f"VmHWM of `gpudra operator` after its pass (VmRSS {rss['rss_mib']:.0f} MiB): deleted "
                f"{rss['deleted']}, pending {rss['pending']}, pass {rss['pass_s']:.2f}s"),
    ]
