"""The seed scenario's objects for tests on the shared session cluster, and waiting for a node's
published devices."""

from __future__ import annotations

from pathlib import Path

import yaml

from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_dev.localcluster.waiting import wait_for

SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
SEED = Path(__file__).resolve().parents[2] / "manifests" / "samples" / "seed-workload.yaml"


def seed_objects(driver: str, namespace: str) -> tuple[Obj, Obj]:
    """The seed manifest's claim template and a Pod from its Job's pod template, in ``namespace``
    and for this test's own driver: the session cluster is shared, so gpu.gpudra.io is renamed."""
    template, job = yaml.safe_load_all(SEED.read_text().replace("gpu.gpudra.io", driver))
    assert (template["kind"], job["kind"]) == ("ResourceClaimTemplate", "Job")
    template["metadata"]["namespace"] = namespace
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": job["metadata"]["name"], "namespace": namespace},
           "spec": job["spec"]["template"]["spec"]}
    return template, pod


async def published_devices(kube: Kube, driver: str, node: str, count: int) -> dict[str, Obj]:
    async def probe() -> dict[str, Obj] | None:
        slices = [s async for s in kube.list(SLICE, field_selector=f"spec.driver={driver},spec.nodeName={node}")]
        devices = {d["name"]: d for s in slices for d in s["spec"].get("devices") or []}
        return devices if len(devices) == count else None

    return await wait_for(probe, timeout=30, what=f"{count} devices of {node}")
