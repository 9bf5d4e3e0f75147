"""On a cluster of amd64 and arm64 nodes, every gpudra pod may run on either: the images are
manifest lists of both (make images-multiarch), so nothing that ships may pin an architecture.

Checked over what is installed: the Helm chart (defaults, and with everything on), the kustomize
base and the objects the operator renders for the sample GpuDraConfigs (agent and MPS DaemonSets).
Needs helm and kubectl as tests/integration/test_chart.py does; no cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
import test_chart
from test_chart import kustomize, template

from gpudra_operator.render_cmd import render_documents

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "manifests" / "samples"
helm = test_chart.helm  # the fixture: the helm binary
ARCH_KEYS = {"kubernetes.io/arch", "beta.kubernetes.io/arch"}
ARCHES = {"amd64", "arm64"}
Obj = dict[str, Any]


def pod_specs(obj: Obj) -> Iterator[tuple[str, Obj]]:
    """(where, pod spec) of every pod the object makes: workloads' templates, CronJobs' too."""
    name = f"{obj['kind']}/{obj['metadata']['name']}"
    spec = obj.get("spec") or {}
    if obj["kind"] == "Pod":
        yield name, spec
    template = spec.get("jobTemplate", {}).get("spec", spec).get("template")
    if isinstance(template, dict) and "spec" in template:
        yield name, template["spec"]


def arch_pins(pod: Obj) -> list[str]:
    """What keeps the pod off amd64 or arm64 nodes: a nodeSelector on the architecture, a required
    node affinity term whose architecture expression leaves either out, a container image tagged
    for one architecture."""
    pins = [f"nodeSelector {k}={v}" for k, v in (pod.get("nodeSelector") or {}).items() if k in ARCH_KEYS]
    required = ((pod.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution") or {}
    for term in required.get("nodeSelectorTerms") or []:
        for expression in term.get("matchExpressions") or []:
            if expression.get("key") not in ARCH_KEYS:
                continue
            values, operator = set(expression.get("values") or []), expression.get("operator")
            if (operator == "In" and not ARCHES <= values) or (operator == "NotIn" and ARCHES & values) \
                    or operator not in ("In", "NotIn", "Exists"):
                pins.append(f"required node affinity {expression}")
    for container in [*pod.get("initContainers", []), *pod.get("containers", [])]:
        tag = container["image"].rpartition("/")[2].partition("@")[0].rpartition(":")[2]
        if any(tag.endswith(f"-{arch}") for arch in (*ARCHES, "x86_64", "aarch64")):
            pins.append(f"container {container['name']} image {container['image']} is one architecture's")
    return pins


def shipped_objects(helm_binary: str) -> list[tuple[str, Obj]]:
    sample_configs = [d for f in sorted(SAMPLES.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())
                      if d and d.get("kind") == "GpuDraConfig"]
    rendered, errors = render_documents(sample_configs)
    assert errors == []
    everything_on = template(helm_binary, "--set", "config.create=true", "--set", "metrics.serviceMonitor.enabled=true",
                             "--set", "metrics.podMonitor.enabled=true")
    chart_config = [o for o in everything_on if o["kind"] == "GpuDraConfig"]
    from_chart_config, errors = render_documents(chart_config)
    assert errors == []
    return [*(("helm template", o) for o in [*template(helm_binary), *everything_on]),
            *(("kubectl kustomize manifests/base", o) for o in kustomize()),
            *(("the operator's render of manifests/samples", o) for o in rendered),
            *(("the operator's render of the chart's GpuDraConfig", o) for o in from_chart_config)]


def test_no_shipped_pod_pins_an_architecture(helm: str) -> None:
    objects = shipped_objects(helm)
    pods = [(source, where, pod) for source, obj in objects for where, pod in pod_specs(obj)]
    kinds = {where.split("/")[0] for _, where, _ in pods}
    assert {"Deployment", "DaemonSet"} <= kinds, kinds  # the operator, the agents
    assert any(where == "DaemonSet/gpudra-mps" for _, where, _ in pods)  # the sharing sample's MPS supervisor
    pinned = [f"{source}: {where}: {pin}" for source, where, pod in pods for pin in arch_pins(pod)]
    assert pinned == []


def test_the_check_sees_a_pin() -> None:
    assert arch_pins({"containers": [{"name": "c", "image": "ghcr.io/gpudra/gpudra:0.1.0"}]}) == []
    assert arch_pins({"nodeSelector": {"kubernetes.io/arch": "amd64"}, "containers": []}) \
        == ["nodeSelector kubernetes.io/arch=amd64"]
    both = {"key": "kubernetes.io/arch", "operator": "In", "values": ["arm64", "amd64"]}
    one = {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}
    for expression, pins in ((both, 0), (one, 1), ({**one, "operator": "NotIn"}, 1)):
        pod = {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [expression]}]}}}, "containers": []}
        assert len(arch_pins(pod)) == pins, expression
    assert len(arch_pins({"containers": [{"name": "c", "image": "registry:5000/gpudra/gpudra:0.1.0-arm64"}]})) == 1

