"""docs/mig.md's per-GPU tables are what the agent publishes for each shipped MIG catalog: read
through the simulated NVML (profile info and placements, as discovery reads them), partitioned and
built into slices as the agent does. Regenerate with
``.venv/bin/python -c 'import sys; sys.path.insert(0, "tests/unit"); import test_mig_docs as t; print(t.tables())'``."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from gpudra_core.devicemodel import Device
from gpudra_core.migpartitions import MigGeometry
from gpudra_driver.discovery import read_mig_geometry, scan
from gpudra_driver.nvml.fake import mig_catalog_names
from gpudra_dev.migcatalogs import PRODUCTS, catalog_nvml
from gpudra_driver.publishing.slices import build_slices

DOC = Path(__file__).resolve().parents[2] / "docs" / "mig.md"
BEGIN, END = "<!-- mig tables: begin (tests/unit/test_mig_docs.py) -->", "<!-- mig tables: end -->"
def discovered(model: str) -> tuple[MigGeometry, list[Device]]:
    """The model's profiles as discovery reads them from NVML (the simulator, on its catalog), and
    the devices dynamic MIG publishes for one such GPU."""
    nvml = catalog_nvml(model)
    nvml.nvmlInit()
    try:
        found = read_mig_geometry(nvml, nvml.nvmlDeviceGetHandleByIndex(0))
    finally:
        nvml.nvmlShutdown()
    result = scan(catalog_nvml(model), mig="dynamic")
    assert result.warnings == [], result.warnings
    return found, result.devices


def tables() -> str:
    parts = []
    for model in mig_catalog_names():
        found, devices = discovered(model)
        counters = devices[0].provides_counters
        assert counters is not None
        slices = build_slices("gpu.gpudra.io", "node-a", None, 1, devices)
        size = len(json.dumps(slices[-1], separators=(",", ":")))
        whole = [d for d in devices if d.type == "gpu"]
        lines = [f"### {PRODUCTS[model]} (`{model}`)", "",
                 f"{found.memory_slices} memory slices, {found.compute_slices} compute slices; "
                 f"{len(devices) - len(whole)} placements"
                 + (" and the whole GPU" if whole else " (no whole GPU: its MIG mode switches only at a reset)")
                 + ", all in one slice of "
                 f"{size:,} bytes (JSON); {len(counters.counters)} counters: "
                 + ", ".join(f"`{k}` {v}" for k, v in counters.counters.items() if not k.startswith("memory-slice-"))
                 + f", `memory-slice-0..{found.memory_slices - 1}` 1 each.", "",
                 "| profile | NVML id | compute slices | memory (MiB) | SMs | CE / NVDEC / NVENC / JPEG / OFA | "
                 "placements (start: memory slices) |",
                 "|---|---|---|---|---|---|---|"]
        for p in found.profiles:
            lines.append(f"| `{p.name}` | {p.profile_id} | {p.compute_slices} | {p.memory_mib} | {p.multiprocessors} | "
                         f"{p.copy_engines} / {p.decoders} / {p.encoders} / {p.jpeg_engines} / {p.ofa_engines} | "
                         + ", ".join(f"{s}: {s}-{s + p.placement_size - 1}" if p.placement_size > 1 else f"{s}"
                                     for s in p.starts) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def test_the_docs_tables_are_what_the_agent_publishes() -> None:
    text = DOC.read_text()
    assert BEGIN in text and END in text, f"{DOC} lacks the table markers"
    documented = text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()
    assert documented == tables(), "docs/mig.md's tables are stale: regenerate them (see this module's docstring)"


def admitted_layouts(devices: list[Device]) -> list[list[Device]]:
    """Every set of placements the scheduler can allocate together on one GPU: what fits its
    counters, added up as the allocator does (depth first, each set once)."""
    placements = devices
    assert placements[0].provides_counters is not None
    total = dict(placements[0].provides_counters.counters)
    found: list[list[Device]] = []

    def grow(chosen: list[Device], left: dict[str, int], start: int) -> None:
        found.append(chosen)
        for i in range(start, len(placements)):
            need = placements[i].consumes_counters[0].counters
            if all(left[k] >= v for k, v in need.items()):
                grow(chosen + [placements[i]], {k: left[k] - need.get(k, 0) for k in left}, i + 1)

    grow([], total, 0)
    return found


def test_every_layout_the_counters_admit_is_one_the_hardware_holds_and_no_more() -> None:
    """For each shipped GPU: every set of placements the counters let the scheduler allocate obeys
    NVML's rules (disjoint memory slices, compute slices and engines within the GPU's, at most
    ``instanceCount`` of a profile); and every single placement fits."""
    for model in mig_catalog_names():
        found, devices = discovered(model)
        profiles = {p.name: p for p in found.profiles}
        layouts = admitted_layouts(devices)
        assert len(layouts) > len(devices), model
        catalog = {p["name"]: p for p in yaml.safe_load(
            (Path(__file__).resolve().parents[2] / "driver/gpudra_driver/profiles/mig" / f"{model}.yaml").read_text())["profiles"]}
        for layout in layouts:
            if any(d.type == "gpu" for d in layout):  # the whole GPU takes every counter: alone or not at all
                assert len(layout) == 1, (model, [d.name for d in layout])
                continue
            slices: list[int] = []
            for device in layout:
                profile = profiles[str(device.attr("profile"))]
                start = int(device.name.rpartition("-at")[2])
                slices += range(start, start + profile.placement_size)
            assert len(slices) == len(set(slices)), (model, [d.name for d in layout])
            used = [profiles[str(d.attr("profile"))] for d in layout]
            assert sum(p.compute_slices for p in used) <= found.compute_slices
            for field_name in ("copy_engines", "decoders", "encoders", "jpeg_engines", "ofa_engines"):
                assert sum(int(getattr(p, field_name)) for p in used) <= found.engine_total(field_name)
            for name in {p.name for p in used}:
                assert sum(p.name == name for p in used) <= catalog[name]["instances"], (model, name)
