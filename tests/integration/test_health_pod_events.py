"""A device that turns unhealthy or recovers is an Event on the pods holding it (through their
claim's reservedFor), next to the Node event: the agent with the real pynvml on the mock
libnvidia-ml, an XID injected at run time, the claim prepared over the kubelet's gRPC API."""

from __future__ import annotations

from pathlib import Path

from seedobjects import published_devices
from test_kubelet_plugin import allocated_claim, driver, plugin_agents, ref  # noqa: F401 (fixtures)

from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_dev.kubelet_client import DraClient
from gpudra_dev.localcluster import mockstate
from gpudra_dev.localcluster.fakedriverroot import make_driver_root
from gpudra_dev.localcluster.objects import events_about
from gpudra_dev.localcluster.waiting import wait_for

CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")


async def test_the_pods_holding_a_device_are_told_when_it_turns_unhealthy_and_recovers(
        kube: Kube, namespace: str, fake_nodes, plugin_agents, driver: str, tmp_path: Path) -> None:
    root = make_driver_root(tmp_path / "driver-root", "dgx-h100")
    node = (await fake_nodes("h100"))["metadata"]["name"]
    plugin = plugin_agents(node, driver, nvml="mock:dgx-h100", driver_root=root,
                           extra_args=("--health-probe-interval", "0.5", "--health-quiet-period", "1"))
    devices = await published_devices(kube, driver, node, 8)
    gpu = devices["gpu-3"]["attributes"]["uuid"]["string"]
    claim = await allocated_claim(kube, namespace, "held", driver, node, ["gpu-3"])
    # the pod (bound by hand: a fake node runs nothing) and what the scheduler writes for it, the
    # claim reserved for it (the claim controller drops a reservation for a pod that does not exist)
    pod = await kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "trainer", "namespace": namespace},
                             "spec": {"nodeName": node, "resourceClaims": [{"name": "gpu", "resourceClaimName": "held"}],
                                      "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                                                      "resources": {"claims": [{"name": "gpu"}]}}]}})
    pod_uid = pod["metadata"]["uid"]
    reserved = await kube.patch(CLAIM, "held", {"status": {
        "allocation": claim["status"]["allocation"],
        "reservedFor": [{"resource": "pods", "name": "trainer", "uid": pod_uid}]}},
        namespace=namespace, subresource="status")
    assert reserved["status"].get("reservedFor"), reserved["status"]
    async with DraClient((await plugin.registered()).endpoint) as kubelet:
        assert (await plugin.prepare(kubelet, [ref(claim)])).claims[claim["metadata"]["uid"]].error == ""

        mockstate.inject_xid(root, gpu, 79)  # fell off the bus: fatal

        def told(reason: str):
            async def probe() -> list[Obj]:
                return [e for e in await events_about(kube, "trainer", namespace) if e["reason"] == reason]
            return probe

        [event] = await wait_for(told("DeviceUnhealthy"), timeout=20, what="a DeviceUnhealthy event on the pod")
        assert event["type"] == "Warning" and event["involvedObject"]["uid"] == pod_uid
        assert event["message"].startswith("ResourceClaim held: gpu-3") and "XID 79" in event["message"]
        # the device of no claim of this node: only the Node hears of it
        other = devices["gpu-5"]["attributes"]["uuid"]["string"]
        mockstate.inject_xid(root, other, 48)
        await wait_for(lambda: _node_heard(kube, node, "gpu-5"), timeout=20, what="the Node event for gpu-5")
        assert len(await told("DeviceUnhealthy")()) == 1

        mockstate.recover_gpu(root, gpu)
        [recovered] = await wait_for(told("DeviceRecovered"), timeout=30, what="a DeviceRecovered event on the pod")
        assert recovered["type"] == "Normal"
        assert (await kubelet.unprepare([ref(claim)])).claims[claim["metadata"]["uid"]].error == ""


async def _node_heard(kube: Kube, node: str, device: str) -> bool:
    return any(e["reason"] == "DeviceUnhealthy" and e["message"].startswith(device)
               for e in await events_about(kube, node))
