"""The agent image follows the operator: no image is frozen into the GpuDraConfig (the CRD has no
default), so an operator upgrade that brings a new agent image (its GPUDRA_AGENT_IMAGE, set by the
kustomize base's `images:` or the Helm chart) rolls the agent DaemonSet; a config that pins
spec.agent.image keeps it."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_dev.localcluster.controlplane import ControlPlane
from gpudra_dev.localcluster.operatorproc import start_operator
from gpudra_dev.localcluster.waiting import wait_for

CONFIG = resource_type("gpudra.io/v1alpha1", "GpuDraConfig")
DAEMONSET = resource_type("apps/v1", "DaemonSet")


def agent_image(kube: Kube, namespace: str, image: str):
    async def probe() -> Obj | None:
        ds = await kube.get(DAEMONSET, "gpudra-agent", namespace)
        containers = (((ds or {}).get("spec") or {}).get("template") or {}).get("spec", {}).get("containers") or []
        return ds if containers and containers[0]["image"] == image else None
    return probe


async def test_an_operator_upgrade_with_a_new_agent_image_rolls_the_agents(
        kube: Kube, cluster: ControlPlane, crd_installed: Obj, namespace: str, tmp_path: Path) -> None:
    name, driver = f"img-{secrets.token_hex(3)}", f"img{secrets.token_hex(3)}.gpudra.io"
    await kube.create({"apiVersion": "v1", "kind": "ServiceAccount",
                       "metadata": {"name": "gpudra-agent", "namespace": namespace}})
    body: dict[str, Any] = {"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig", "metadata": {"name": name},
                            "spec": {"driverName": driver, "agent": {"namespace": namespace}}}
    created = await kube.create(body)
    assert "image" not in created["spec"]["agent"]  # nothing defaulted into the stored object
    old, new = "registry.example.com/gpudra/gpudra:1.0", "registry.example.com/gpudra/gpudra:1.1"
    operator = start_operator(kubeconfig=cluster.kubeconfig, log_path=tmp_path / "operator-1.0.log",
                              env={"GPUDRA_AGENT_IMAGE": old})
    try:
        first = await wait_for(agent_image(kube, namespace, old), timeout=60, what=f"the DaemonSet on {old}")
    finally:
        operator.stop()
    upgraded = start_operator(kubeconfig=cluster.kubeconfig, log_path=tmp_path / "operator-1.1.log",
                              env={"GPUDRA_AGENT_IMAGE": new})
    try:
        rolled = await wait_for(agent_image(kube, namespace, new), timeout=60, what=f"the DaemonSet on {new}")
        assert rolled["metadata"]["generation"] > first["metadata"]["generation"]  # a new pod template: a rollout
        # A config that pins its agents keeps them where it says, whatever the operator's default.
        await kube.patch(CONFIG, name, {"spec": {"agent": {"image": "registry.local/gpudra:pinned"}}})
        await wait_for(agent_image(kube, namespace, "registry.local/gpudra:pinned"), timeout=60,
                       what="the pinned image")
    finally:
        await kube.delete(CONFIG, name)

        async def gone() -> bool:
            return await kube.get(CONFIG, name) is None

        await wait_for(gone, timeout=60, what=f"GpuDraConfig {name} to go")
        upgraded.stop()
