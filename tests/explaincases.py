"""Random, seedable cases for the differential test of `gpudra explain` against the real scheduler
(tests/integration/test_explain_differential.py): inventories from the shipped GPU profiles,
DeviceClasses from the operator's templates, claims with random selectors over the published
attributes and capacities (some of which fail on some devices: a missing attribute is a CEL
error), counts, ``allocationMode: All``, ``firstAvailable`` and ``matchAttribute`` constraints.

Pure: :func:`generate` returns plain API objects; the test applies them."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from gpudra_driver.discovery import discover
from gpudra_driver.nvml.fake import FakeNvml, load_profile
from gpudra_driver.slices import build_slices
from gpudra_operator.deviceclasses import render_device_class

PROFILES = ("dgx-a100-40gb", "dgx-h100", "l4x2", "a100-80gb-mig", "h200")
CLASS_TEMPLATES: tuple[tuple[str, dict[str, str]], ...] = (
    ("all", {}), ("full-gpu", {}), ("mig", {}), ("mig", {"profile": "1g.10gb"}),
    ("min-memory", {"memory": "24Gi"}), ("min-memory", {"memory": "40Gi"}), ("min-memory", {"memory": "80Gi"}),
    ("min-compute-capability", {"version": "8.9"}), ("architecture", {"architecture": "Hopper"}),
)


def _selectors(domain: str) -> list[str]:
    """Selectors over what the agent publishes; the ones naming numaNode or profile fail on
    devices without that attribute (l4x2 and h200 publish no numaNode, whole GPUs no profile)."""
    a, c = f'device.attributes["{domain}"]', f'device.capacity["{domain}"]'
    return [
        f'{c}.memory.compareTo(quantity("40Gi")) >= 0',
        f'{c}.memory.isLessThan(quantity("30Gi"))',
        f'{c}.memory.isGreaterThan(quantity("80G"))',
        f'{a}.index <= 3',
        f'{a}.index == 1',
        f'{a}.productName.startsWith("NVIDIA H")',
        f'{a}.cudaComputeCapability.isGreaterThan(semver("8.5.0"))',
        f'{a}.cudaComputeCapability.compareTo(semver("8.0.0")) == 0',
        f'{a}.type == "mig"',
        f'{a}.numaNode == 0',  # error on l4x2 and h200
        f'{a}.numaNode == 0 || {a}.type == "gpu"',  # error absorbed where type is gpu
        f'has({a}.numaNode) && {a}.numaNode < 4',
        f'{a}.profile == "3g.40gb"',  # error on whole GPUs
        f'"numaNode" in {a} && {a}.numaNode == 1',
        f'cel.bind(g, {a}, g.index % 2 == 0 && g.type == "gpu")',
        f'{a}.architecture in ["Ampere", "Ada Lovelace"]',
        f'device.driver == "{domain}" && {c}.memory.asApproximateFloat() > 2e10',
        # two-variable comprehensions and ordering across numeric types (cel-go extensions)
        f'{a}.exists(k, v, k == "profile" && v == "3g.40gb")',
        f'{c}.transformList(k, v, v.isGreaterThan(quantity("20Gi"))).exists(b, b)',
        f'{a}.transformMap(k, v, k == "index", v).all(k, v, v < 1.5)',
        f'{a}.transformMapEntry(k, v, {{"x": v}}).size() == 1',  # error: key "x" twice
    ]


@dataclass
class Case:
    index: int
    driver: str
    nodes: dict[str, str]  # node name -> profile
    slices: list[dict[str, Any]]
    device_class: dict[str, Any]
    claim_spec: dict[str, Any]  # spec of the claim (one copy per node in the test)
    holder_spec: dict[str, Any] | None = None  # a claim allocated on each node beforehand
    description: str = ""


def _request(rng: random.Random, name: str, class_name: str, selectors: list[str]) -> dict[str, Any]:
    body: dict[str, Any] = {"deviceClassName": class_name}
    chosen = rng.sample(selectors, k=rng.choice((0, 0, 0, 1, 1, 2)))
    if chosen:
        body["selectors"] = [{"cel": {"expression": e}} for e in chosen]
    if rng.random() < 0.12:
        body["allocationMode"] = "All"
    else:
        body["count"] = rng.choice((1, 1, 1, 1, 2, 2, 4, 8))
    return body


def generate(seed: int, count: int, run_id: str) -> list[Case]:
    """``count`` cases from ``seed``; names carry ``run_id`` so runs on one cluster never meet."""
    rng = random.Random(seed)
    inventories = {p: discover(FakeNvml(load_profile(p))) for p in PROFILES}
    cases = []
    for index in range(count):
        driver = f"c{index}-{run_id}.gpudra.io"
        nodes = {f"x{run_id}-{index}-{n}": rng.choice(PROFILES) for n in range(rng.choice((1, 2, 2, 3)))}
        slices = [s for node, profile in nodes.items() for s in build_slices(driver, node, None, 1, inventories[profile])]
        template, params = rng.choice(CLASS_TEMPLATES)
        class_name = f"{template}-{index}-{run_id}.gpudra.io"
        device_class = render_device_class(class_name, driver, template=template, params=params)
        selectors = _selectors(driver)
        requests: list[dict[str, Any]] = []
        for r in range(rng.choice((1, 1, 1, 2))):
            if rng.random() < 0.2:
                requests.append({"name": f"r{r}", "firstAvailable": [
                    {"name": f"s{s}", **_request(rng, f"s{s}", class_name, selectors)} for s in range(2)]})
            else:
                requests.append({"name": f"r{r}", "exactly": _request(rng, f"r{r}", class_name, selectors)})
        spec: dict[str, Any] = {"devices": {"requests": requests}}
        if len(requests) > 1 and rng.random() < 0.5:
            attribute = rng.choice(("numaNode", "productName", "type"))
            spec["devices"]["constraints"] = [{"requests": [r["name"] for r in requests],
                                               "matchAttribute": f"{driver}/{attribute}"}]
        # Some devices already held by another claim: explain must count them as in use.
        holder = None
        if rng.random() < 0.4:
            holder = {"devices": {"requests": [{"name": "held", "exactly": {
                "deviceClassName": class_name, "count": rng.choice((1, 1, 2, 4))}}]}}
        cases.append(Case(index, driver, nodes, slices, device_class, spec, holder,
                          description=f"{template}{params or ''} on {list(nodes.values())}"
                                      + (f", {holder['devices']['requests'][0]['exactly']['count']} held on each" if holder else "")))
    return cases
