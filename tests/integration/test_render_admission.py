"""What render() produces is what the real apiserver accepts: every built-in DeviceClass (CEL
compiled against the typed DRA device environment, cost checked), a class carrying hostile
parameter values, and the agent DaemonSet. Server-side dry runs: nothing is stored."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from gpudra_core.kubeapi import Kube, error_message
from gpudra_operator.render import render

pytestmark = pytest.mark.cluster

HOSTILE = '") || true || ("\n\\ é 🎉 \x00'
CLASSES: list[dict[str, Any]] = [
    {"name": "all.gpudra.io", "template": "all"},
    {"name": "full.gpudra.io", "template": "full-gpu"},
    {"name": "mig.gpudra.io", "template": "mig"},
    {"name": "mig-3g.gpudra.io", "template": "mig", "parameters": {"profile": "3g.40gb"}},
    {"name": "mem.gpudra.io", "template": "min-memory", "parameters": {"memory": "64Gi"}},
    {"name": "h100.gpudra.io", "template": "product", "parameters": {"productName": "NVIDIA H100 80GB HBM3"}},
    {"name": "sm80.gpudra.io", "template": "min-compute-capability", "parameters": {"version": "8.0"}},
    {"name": "hopper.gpudra.io", "template": "architecture", "parameters": {"architecture": "Hopper"}},
    {"name": "hostile.gpudra.io", "template": "product", "parameters": {"productName": HOSTILE}},
]


def config(namespace: str) -> dict[str, Any]:
    return {"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig",
            "metadata": {"name": "dry-run", "uid": "00000000-0000-0000-0000-000000000001"},
            "spec": {"agent": {"namespace": namespace,
                               "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
                               "resources": {"requests": {"cpu": "50m"}}},
                     "deviceClasses": CLASSES}}


async def test_rendered_objects_pass_apiserver_validation(kube: Kube, namespace: str) -> None:
    rendered = render(config(namespace))
    assert rendered.errors == []
    assert len(rendered.device_classes) == len(CLASSES)
    failures = []
    for obj in rendered.objects:
        try:
            await kube.create(obj, dry_run=True)
        except ApiException as error:
            failures.append(f"{obj['kind']} {obj['metadata']['name']}: {error_message(error)}")
    assert failures == []
