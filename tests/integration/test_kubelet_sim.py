"""The kubelet simulator makes DaemonSet status move on fake Nodes, as a kubelet would."""

from __future__ import annotations

import asyncio

from gpudra_core.kubeapi import Kube, resource_type
from gpudra_dev.localcluster.kubelet_sim import KubeletSimulator
from gpudra_dev.localcluster.waiting import wait_for

DAEMONSET = resource_type("apps/v1", "DaemonSet")
POD = resource_type("v1", "Pod")


async def test_daemonset_becomes_ready_and_pods_delete(kube: Kube, namespace: str, fake_nodes) -> None:
    nodes = [await fake_nodes("sim", labels={"sim-test": namespace}) for _ in range(2)]
    await kube.create({
        "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "ds", "namespace": namespace},
        "spec": {"selector": {"matchLabels": {"app": "ds"}}, "template": {
            "metadata": {"labels": {"app": "ds"}},
            "spec": {"nodeSelector": {"sim-test": namespace}, "terminationGracePeriodSeconds": 30,
                     "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}}},
    })
    simulator = asyncio.create_task(KubeletSimulator(kube).run())
    try:
        async def ready() -> dict | None:
            status = ((await kube.get(DAEMONSET, "ds", namespace)) or {}).get("status") or {}
            return status if status.get("desiredNumberScheduled") == 2 and status.get("numberReady") == 2 else None

        status = await wait_for(ready, timeout=30, what="DaemonSet ds to have 2 ready pods")
        assert status["numberAvailable"] == 2
        pods = [p async for p in kube.list(POD, namespace)]
        assert sorted(p["spec"]["nodeName"] for p in pods) == sorted(n["metadata"]["name"] for n in nodes)

        # A graceful delete completes because the simulator confirms it, as a kubelet does.
        victim = pods[0]["metadata"]["name"]
        await kube.delete(POD, victim, namespace)
        await wait_for(lambda: _gone(kube, victim, namespace), timeout=30, what=f"pod {victim} to be deleted")
    finally:
        simulator.cancel()


async def _gone(kube: Kube, name: str, namespace: str) -> bool:
    return await kube.get(POD, name, namespace) is None
