"""Preparing a dynamic MIG claim against a whole-GPU claim, in one run (issue 34): the agent's own
state (``DeviceState``: the checkpoint on the work directory's disk, CDI specs on tmpfs) on the
simulated NVML (its profile parsed once; its instance state file is still written and fsync'd per
change, a few hundred microseconds: on a GPU, NVML's own create takes far longer), so the ratio is
mostly gpudra's own cost of a MIG claim: its two checkpoint writes (the placement recorded before NVML is asked),
the NVML session, the profile lookup, the GPU and compute instance made and found again as a MIG
device; and at unprepare, the instance destroyed.

A third kind, the whole GPU of a dynamic GPU, turns its MIG mode off at prepare (the GPU's MIG
profiles read first, for the record) and on at unprepare. Rounds alternate the kinds (``ctx.repeat`` x 40 each, after a warm-up), 3 ms apart as calls
come from a kubelet; p50 of prepare and of unprepare for each, and the ratios (no target)."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import Context, Result, median
from gpudra_driver.discovery import scan
from gpudra_driver.driverroot import DriverRoot
from gpudra_driver.nvml.fake import FakeNvml, load_profile, mig_catalog_names
from gpudra_driver.plugin.cdi import CdiDir
from gpudra_driver.plugin.devicenodes import mig_cap_minor_fallback, node_devices
from gpudra_driver.plugin.driverfiles import DriverFilesCache
from gpudra_driver.plugin.miginstances import MigInstances
from gpudra_driver.plugin.model import ClaimRef
from gpudra_driver.plugin.state import DeviceState
from gpudra_driver.publishing.slices import build_slices
from gpudra_dev.localcluster.fakedriverroot import make_driver_root
from gpudra_dev.migcatalogs import catalog_nvml

DRIVER, NODE = "gpu.gpudra.io", "bench-node"
UID = "0c1d2e3f-0000-4000-8000-00000000b001"
KINDS = {"whole GPU": ("dgx-h100", "static", "gpu-0"),
         "dynamic MIG 1g.10gb": ("h100-dynamic-mig", "dynamic", "gpu-0-mig-1g10gb-at3"),
         # its MIG mode turned off at prepare, on again at unprepare
         "dynamic MIG whole GPU": ("h100-dynamic-mig", "dynamic", "gpu-0")}


def allocated(device: str) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "bench", "namespace": "bench", "uid": UID}, "spec": {},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}]}}}}


def agent_state(work: Path, cdi: Path, profile: str, mig: str) -> DeviceState:
    root = make_driver_root(work / "driver-root", profile)

    parsed = load_profile(profile)  # once: parsing the YAML is the simulator's cost, not gpudra's

    def nvml() -> FakeNvml:
        return FakeNvml(parsed, work / "nvml-state")

    state = DeviceState(work / "plugin", CdiDir(cdi, DRIVER, DriverFilesCache(DriverRoot.at(str(root)))),
                        driver=DRIVER, node=NODE, boot_id="bench",
                        mig=MigInstances(nvml, mig_cap_minor_fallback))
    state.recover()
    state.set_devices(node_devices(scan(nvml(), mig=mig).devices))  # type: ignore[arg-type]
    return state


async def measure(work: Path, rounds: int) -> dict[str, tuple[list[float], list[float]]]:
    states = {kind: agent_state(work / str(i), Path(tempfile.mkdtemp(dir="/dev/shm")), profile, mig)
              for i, (kind, (profile, mig, _)) in enumerate(KINDS.items())}
    times: dict[str, tuple[list[float], list[float]]] = {kind: ([], []) for kind in KINDS}
    ref = ClaimRef("bench", "bench", UID)
    for i in range(rounds + 20):
        for kind in (KINDS if i % 2 == 0 else reversed(list(KINDS))):
            state, device = states[kind], KINDS[kind][2]
            started = time.perf_counter()
            out = await state.prepare([(ref, allocated(device))])
            prepared = time.perf_counter()
            assert out[UID].error is None, out[UID].error
            await asyncio.sleep(0.003)
            before = time.perf_counter()
            assert await state.unprepare([ref]) == {UID: None}
            done = time.perf_counter()
            if i >= 20:  # the warm-up: imports, caches, the first files
                times[kind][0].append(prepared - started)
                times[kind][1].append(done - before)
            await asyncio.sleep(0.003)
    return times


async def run(ctx: Context) -> list[Result]:
    times = await measure(ctx.workdir("mig_prepare"), 40 * ctx.repeat)
    (whole_p, whole_u), (mig_p, mig_u) = times["whole GPU"], times["dynamic MIG 1g.10gb"]
    ms = {kind: (median(p) * 1e3, median(u) * 1e3) for kind, (p, u) in times.items()}
    rows = [Result(f"{kind} prepare p50", p, "ms", note=f"unprepare {u:.2f} ms") for kind, (p, u) in ms.items()]
    rows.append(Result("dynamic MIG claim vs whole-GPU claim, prepare p50", median(mig_p) / median(whole_p), "x",
                       note="in-process, simulated NVML (its fsync'd state writes are most of it; no target)"))
    rows.append(Result("dynamic MIG claim vs whole-GPU claim, unprepare p50", median(mig_u) / median(whole_u), "x",
                       note="the instance destroyed; no target"))
    off_p, off_u = times["dynamic MIG whole GPU"]
    rows.append(Result("dynamic MIG whole GPU vs whole-GPU claim, prepare p50", median(off_p) / median(whole_p), "x",
                       note=f"MIG mode off, the GPU's MIG profiles read first; unprepare (on again) "
                            f"{median(off_u) / median(whole_u):.2f}x; no target"))
    return rows + slice_sizes()


NODE_GPUS = 8


def slice_sizes() -> list[Result]:
    """What a node of eight dynamic GPUs of each model publishes: its slices and their bytes, as
    the API server stores them (JSON), from discovery on the simulated NVML of each catalog."""
    rows = []
    for model in mig_catalog_names():
        devices = scan(catalog_nvml(model, NODE_GPUS), mig="dynamic").devices
        slices = build_slices(DRIVER, NODE, None, 1, devices)
        sizes = [len(json.dumps(s, separators=(",", ":"))) for s in slices]
        counter_slices = sum(1 for s in slices if s["spec"].get("sharedCounters"))
        rows.append(Result(f"{model} x{NODE_GPUS}: slices", len(slices), "slices",
                           note=f"{counter_slices} of counters, {len(devices)} devices; {sum(sizes) / 1024:.0f} KiB "
                                f"in all, the largest {max(sizes) / 1024:.1f} KiB (JSON); no target"))
    return rows
