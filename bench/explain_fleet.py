"""`gpudra explain`'s functional core at fleet size: 2,000 nodes x 8 H100s (dgx-h100 slices as the
agent builds them), a quarter of the GPUs held by other claims; the time to explain an 8-GPU claim
no node can hold (every node's allocation tried, every device counted) and a 2-GPU claim that fits.
No control plane: the objects are what `gpudra explain` reads, the cost is the verdict."""

from __future__ import annotations

import copy
import time
from typing import Any

from bench import Context, Result, at_most, median
from gpudra_driver.discovery import discover
from gpudra_driver.nvml.fake import FakeNvml, load_profile
from gpudra_driver.slices import build_slices
from gpudra_operator.deviceclasses import render_device_class
from gpudra_operator.explain.verdict import explain

DRIVER = "gpu.gpudra.io"
NODES = 2000
MEMORY = f'device.capacity["{DRIVER}"].memory.compareTo(quantity("64Gi")) >= 0'


def _fleet() -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    (template,) = build_slices(DRIVER, "template", None, 1, discover(FakeNvml(load_profile("dgx-h100"))))
    slices, nodes, held = [], [], []
    for i in range(NODES):
        name = f"node-{i}"
        slice_ = copy.deepcopy(template)
        slice_["metadata"]["name"] = f"{name}-{DRIVER}-0"
        slice_["spec"].update(nodeName=name, pool={"name": name, "generation": 1, "resourceSliceCount": 1})
        slices.append(slice_)
        nodes.append({"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}})
        held.append({"metadata": {"name": f"job-{i}", "namespace": "team", "uid": f"u{i}"}, "status": {"allocation": {
            "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": name, "device": f"gpu-{d}"}
                                    for d in range(2)]}}}})
    return slices, nodes, held


def _claim(count: int) -> dict[str, Any]:
    return {"metadata": {"name": "c", "namespace": "team", "uid": "c"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": DRIVER, "count": count, "selectors": [{"cel": {"expression": MEMORY}}]}}]}}}


async def run(ctx: Context) -> list[Result]:
    slices, nodes, held = _fleet()
    classes = {DRIVER: render_device_class(DRIVER, DRIVER, template="all")}
    timings: dict[int, list[float]] = {8: [], 2: []}
    for _ in range(ctx.repeat):
        for count in timings:
            started = time.perf_counter()
            verdict = explain("claim team/c", [_claim(count)], pod=None, classes=classes, slices=slices,
                              nodes=nodes, other_claims=held, namespace=None, driver=DRIVER)
            timings[count].append(time.perf_counter() - started)
            assert verdict.satisfiable == (count == 2), verdict.conclusion
    return [at_most(f"explain, {NODES} nodes x 8 GPUs, no node fits (8 of 6 free)", median(timings[8]), "s", 15),
            at_most(f"explain, {NODES} nodes x 8 GPUs, fits everywhere (2 GPUs)", median(timings[2]), "s", 15)]
