"""`gpudra explain` at fleet size and on one node, as the command runs it: a fresh gpudra-allocator
(Kubernetes' own allocator and CEL of the release) started, the objects sent, the verdict built.
2,000 nodes x 8 H100s (dgx-h100 slices as the agent builds them), a quarter of the GPUs held by
other claims; the time to explain an 8-GPU claim no node can hold (every node's allocation tried,
every device's selectors run and counted) and a 2-GPU claim that fits; then the 8-GPU claim on a
one-node cluster; and the 8-GPU ask as a pod's extended resource (KEP-5004: the helper builds the
scheduler's claim for each node first), as a ratio to the same ask as a claim. No control plane:
the objects are what `gpudra explain` reads.

The baseline, in the same run, is the Python port this replaced (its own allocator and CEL, up to
commit 68fb70a): with ``BENCH_EXPLAIN_PORT_TREE`` naming a checkout of that commit (``git worktree
add /tmp/port 68fb70a``, whose ``.[operator]`` extra must be installed in this venv:
cel-expr-python, google-re2), its ``explain`` runs on the same objects in a subprocess and each
figure is also given as a ratio (target: no slower)."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import Context, Result, at_most, median
from gpudra_driver.discovery import discover
from gpudra_driver.nvml.fake import FakeNvml, load_profile
from gpudra_driver.publishing.slices import build_slices
from gpudra_operator.allocatorhelper import AllocatorHelper
from gpudra_operator.deviceclasses import render_device_class
from gpudra_operator.explain import explain_snapshot
from gpudra_operator.explain.gather import Snapshot

DRIVER = "gpu.gpudra.io"
NODES = 2000
MINOR = 36
MEMORY = f'device.capacity["{DRIVER}"].memory.compareTo(quantity("64Gi")) >= 0'
PORT_TREE = os.environ.get("BENCH_EXPLAIN_PORT_TREE")


def fleet(nodes: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Slices, Nodes and the claims holding 2 GPUs of each node."""
    (template,) = build_slices(DRIVER, "template", None, 1, discover(FakeNvml(load_profile("dgx-h100"))))
    slices, node_objects, held = [], [], []
    for i in range(nodes):
        name = f"node-{i}"
        slice_ = copy.deepcopy(template)
        slice_["metadata"]["name"] = f"{name}-{DRIVER}-0"
        slice_["spec"].update(nodeName=name, pool={"name": name, "generation": 1, "resourceSliceCount": 1})
        slices.append(slice_)
        node_objects.append({"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}})
        held.append({"metadata": {"name": f"job-{i}", "namespace": "team", "uid": f"u{i}"}, "status": {"allocation": {
            "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": name, "device": f"gpu-{d}"}
                                    for d in range(2)]}}}})
    return slices, node_objects, held


def claim(count: int) -> dict[str, Any]:
    """As the API server stores it (allocationMode defaulted)."""
    return {"metadata": {"name": "c", "namespace": "team", "uid": "c"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": DRIVER, "allocationMode": "ExactCount", "count": count,
                "selectors": [{"cel": {"expression": MEMORY}}]}}]}}}


RESOURCE = "nvidia.com/gpu"


async def explain_extended_once(nodes: int, count: int) -> tuple[float, bool, str]:
    """A pod asking ``count`` of the extended resource a DeviceClass maps (KEP-5004), no claim: the
    helper builds the scheduler's claim for every node, then the allocator runs as for a claim."""
    slices, node_objects, held = fleet(nodes)
    device_class = render_device_class(DRIVER, DRIVER, template="all")
    device_class["spec"]["extendedResourceName"] = RESOURCE
    selective = {**device_class, "metadata": {**device_class["metadata"], "name": "big"},
                 "spec": {**device_class["spec"], "selectors": [*device_class["spec"].get("selectors", []),
                                                                {"cel": {"expression": MEMORY}}]}}
    selective["spec"]["extendedResourceName"] = RESOURCE
    del device_class["spec"]["extendedResourceName"]
    pod = {"metadata": {"name": "p", "namespace": "team", "uid": "p"},
           "spec": {"containers": [{"name": "main", "resources": {"requests": {RESOURCE: str(count)},
                                                                  "limits": {RESOURCE: str(count)}}}]}}
    snapshot = Snapshot(target="pod team/p", pod=pod, claims=[], classes={DRIVER: device_class, "big": selective},
                        slices=slices, nodes=[{**n, "status": {"allocatable": {"cpu": "64"}}} for n in node_objects],
                        other_claims=held, namespace=None, server_minor=MINOR, extended=[RESOURCE])
    started = time.perf_counter()
    async with AllocatorHelper(MINOR) as helper:
        verdict = await explain_snapshot(snapshot, DRIVER, helper)
    return time.perf_counter() - started, verdict.satisfiable, verdict.conclusion


async def explain_once(nodes: int, count: int) -> tuple[float, bool, str]:
    slices, node_objects, held = fleet(nodes)
    snapshot = Snapshot(target="claim team/c", pod=None, claims=[claim(count)],
                        classes={DRIVER: render_device_class(DRIVER, DRIVER, template="all")}, slices=slices,
                        nodes=node_objects, other_claims=held, namespace=None, server_minor=MINOR)
    started = time.perf_counter()
    async with AllocatorHelper(MINOR) as helper:
        verdict = await explain_snapshot(snapshot, DRIVER, helper)
    return time.perf_counter() - started, verdict.satisfiable, verdict.conclusion


PORT_SCRIPT = """
import json, sys, time
started = time.perf_counter()
sys.path[:0] = [sys.argv[1] + "/operator", sys.argv[1] + "/driver"]
from gpudra_operator.explain.verdict import explain
from gpudra_operator.cel import compile_selector
compile_selector("device.driver == 'x'")  # the CEL environment is built on first use
out = {"import": [time.perf_counter() - started, None]}
for case, objects in json.load(open(sys.argv[2])).items():
    started = time.perf_counter()
    verdict = explain("claim team/c", objects["claims"], pod=None, classes=objects["classes"],
                      slices=objects["slices"], nodes=objects["nodes"], other_claims=objects["held"],
                      namespace=None, driver=objects["driver"], server_minor=objects["minor"])
    out[case] = [time.perf_counter() - started, verdict.satisfiable]
print(json.dumps(out))
"""


def port_timings(cases: list[tuple[int, int]], scratch: Path) -> dict[str, list[Any]]:
    """The Python port's explain on the same objects, timed in its own interpreter."""
    assert PORT_TREE is not None
    tree = Path(PORT_TREE).resolve()
    if not (tree / "operator" / "gpudra_operator" / "explain" / "allocator.py").is_file():
        raise RuntimeError(f"BENCH_EXPLAIN_PORT_TREE={tree}: not a checkout with the Python port "
                           "(git worktree add /tmp/port 68fb70a)")
    objects = {}
    for nodes, count in cases:
        slices, node_objects, held = fleet(nodes)
        objects[f"{nodes}x{count}"] = {"claims": [claim(count)], "slices": slices, "nodes": node_objects,
                                       "held": held, "driver": DRIVER, "minor": MINOR,
                                       "classes": {DRIVER: render_device_class(DRIVER, DRIVER, template="all")}}
    path = scratch / "explain-port-objects.json"
    path.write_text(json.dumps(objects))
    done = subprocess.run([sys.executable, "-c", PORT_SCRIPT, str(tree), str(path)], capture_output=True,
                          text=True, check=False, env={**os.environ, "PYTHONPATH": ""}, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the port's explain failed: {done.stderr.strip()[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def import_seconds() -> float:
    """What a fresh `gpudra explain` spends importing explain (its start, before any request)."""
    done = subprocess.run([sys.executable, "-c", "import time; t = time.perf_counter(); "
                           "import gpudra_operator.explain; print(time.perf_counter() - t)"],
                          capture_output=True, text=True, check=True, timeout=120)
    return float(done.stdout.strip())


async def run(ctx: Context) -> list[Result]:
    cases = [(NODES, 8), (NODES, 2), (1, 8)]
    timings: dict[tuple[int, int], list[float]] = {case: [] for case in cases}
    for _ in range(ctx.repeat):
        for nodes, count in cases:
            seconds, satisfiable, conclusion = await explain_once(nodes, count)
            timings[(nodes, count)].append(seconds)
            assert satisfiable == (count == 2), conclusion
    # The same 8-GPU ask as a pod's extended resource (the scheduler's claim built per node), in turn.
    extended: list[float] = []
    for _ in range(ctx.repeat):
        seconds, satisfiable, conclusion = await explain_extended_once(NODES, 8)
        extended.append(seconds)
        assert not satisfiable and "container-0-request-0" in conclusion, conclusion
    names = {(NODES, 8): f"explain, {NODES} nodes x 8 GPUs, no node fits (8 of 6 free)",
             (NODES, 2): f"explain, {NODES} nodes x 8 GPUs, fits everywhere (2 GPUs)",
             (1, 8): "explain, one node x 8 GPUs, does not fit (8 of 6 free)"}
    results = [at_most(names[case], median(timings[case]), "s", 15 if case[0] > 1 else 1,
                       "Kubernetes' allocator in gpudra-allocator 1.36, its start included")
               for case in cases]
    results.append(at_most(f"explain, {NODES} nodes x 8 GPUs, the same ask as an extended resource (KEP-5004): "
                           "vs as a claim", median(extended) / median(timings[(NODES, 8)]), "x", 1.25,
                           f"extended {median(extended):.3f}s, claim {median(timings[(NODES, 8)]):.3f}s; "
                           "the scheduler's claim built for each node by the helper"))
    if PORT_TREE:
        port: dict[tuple[int, int], list[float]] = {case: [] for case in cases}
        port_imports: list[float] = []
        for _ in range(max(1, ctx.repeat // 2)):
            answers = await asyncio.to_thread(port_timings, cases, ctx.root)
            port_imports.append(answers["import"][0])
            for case in cases:
                seconds, satisfiable = answers[f"{case[0]}x{case[1]}"]
                assert satisfiable == (case[1] == 2)
                port[case].append(seconds)
        imports = [import_seconds() for _ in range(max(1, ctx.repeat // 2))]
        # One node as a command: its imports (the port's: CEL too), then the verdict (the helper's start included).
        command, port_command = median(imports) + median(timings[(1, 8)]), median(port_imports) + median(port[(1, 8)])
        results.append(at_most("explain, one node, as a command (imports + verdict): vs the Python port",
                               command / port_command, "x", 1.0, f"port {port_command:.3f}s, helper {command:.3f}s"))
        for case in cases:
            ratio = median(timings[case]) / median(port[case])
            note = f"port {median(port[case]):.3f}s, helper {median(timings[case]):.3f}s"
            if case[0] == 1:  # the helper's ~20 ms start dominates here: the command-level ratio is the target
                results.append(Result(f"{names[case]}: vs the Python port (its start included)", ratio, "x",
                                      note=note + "; the port's CEL import is not counted here, see 'as a command'"))
            else:
                results.append(at_most(f"{names[case]}: vs the Python port", ratio, "x", 1.0, note))
    return results
