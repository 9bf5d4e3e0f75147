"""Device health in pod status (KEP-4680) under the real kubelet of the release under test: the
agent streams every device's health (DRAResourceHealth.NodeWatchResources) and the kubelet puts
the health of a container's allocated devices into ``status.containerStatuses[].allocatedResourcesStatus``.

Health is injected at run time into the mock NVML of the agent's driver root (mockstate): a fatal
XID with a pending GPU reset (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION) makes the device Unhealthy; the
GPU reset done (recovery action none) and the quiet period over, it is Healthy again.

Per release (pkg/kubelet/cm/dra, pkg/features/kube_features.go):

* 1.37 streams v1.DRAResourceHealth, which the agent advertises (it would stream v1alpha1 from a
  plugin advertising only that);
* 1.36 streams v1alpha1.DRAResourceHealth (ResourceHealthStatus beta, on by default);
* 1.35 has the gate alpha and off: it never calls the service, the health entries in the
  registration's supported_versions must not disturb it, and its log stays free of health-stream
  errors.

CI runs this file on 1.35.4 with the whole suite and on 1.36.3 and 1.37.2 (.ci/run)."""

from __future__ import annotations

from pathlib import Path

from test_real_kubelet import KubeletNode, delete_and_wait_unprepared, kubelet_node, start_seed_pod  # noqa: F401
from seedobjects import published_devices

from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_dev.localcluster import mockstate
from gpudra_dev.localcluster.waiting import ConditionTimeout, wait_for

POD = resource_type("v1", "Pod")
NODE = resource_type("v1", "Node")
# a probe every half second, an event's fault gone one second after it (once the GPU needs no reset)
HEALTH_FLAGS = ("--health-probe-interval", "0.5", "--health-quiet-period", "1")
XID = 79  # GPU has fallen off the bus: fatal
GPU_RESET = 1  # NVML_GPU_RECOVERY_ACTION_GPU_RESET
# What a kubelet logs when a plugin's health stream fails (pkg/kubelet/cm/dra/manager.go,
# plugin/dra_plugin.go): each would repeat every 5 s against a plugin that lacks the service.
STREAM_ERRORS = ("Error receiving from WatchResources stream", "NodeWatchResources RPC call failed",
                 "Failed to establish WatchResources stream")


async def kubelet_minor(kube: Kube, node: KubeletNode) -> int:
    got = await kube.get(NODE, node.name)
    assert got is not None
    return int(got["status"]["nodeInfo"]["kubeletVersion"].lstrip("v").split(".")[1])


def device_status(pod: Obj, resource_id: str) -> Obj | None:
    """What the kubelet reports for ``resource_id`` in the pod's container statuses, or None."""
    for container in (pod.get("status") or {}).get("containerStatuses") or []:
        for status in container.get("allocatedResourcesStatus") or []:
            for resource in status.get("resources") or []:
                if resource.get("resourceID") == resource_id:
                    return {"claim": status.get("name"), **resource}
    return None


async def until_status(kube: Kube, node: KubeletNode, pod: Obj, resource_id: str, health: str, agent_log: Path,
                       message: tuple[str, ...] = ()) -> Obj:
    """The device's status once it has ``health`` and a message containing each of ``message``."""
    meta = pod["metadata"]

    async def probe() -> Obj | None:
        node.kubelet.assert_running()
        got = await kube.get(POD, meta["name"], meta["namespace"])
        status = device_status(got, resource_id) if got is not None else None
        if status is None or status.get("health") != health:
            return None
        return status if all(part in status.get("message", "") for part in message) else None

    try:
        return await wait_for(probe, timeout=60, what=f"pod {meta['name']} to show {resource_id} {health} {message}")
    except ConditionTimeout as error:
        got = await kube.get(POD, meta["name"], meta["namespace"])
        statuses = [c.get("allocatedResourcesStatus") for c in ((got or {}).get("status") or {}).get(
            "containerStatuses") or []]
        raise ConditionTimeout(f"{error}\nallocatedResourcesStatus: {statuses}\nkubelet log:\n"
                               f"{node.kubelet.log_tail(40)}\nagent log:\n"
                               f"{agent_log.read_text(errors='replace')[-4000:]}") from None


async def test_a_device_turning_unhealthy_and_back_shows_in_the_pods_status(
        kube: Kube, namespace: str, kubelet_node: KubeletNode) -> None:
    node = kubelet_node
    agent = await node.serving_agent(extra_args=HEALTH_FLAGS)
    devices = await published_devices(kube, node.driver, node.name, 8)
    pod, claim = await start_seed_pod(kube, node, namespace, "watched")
    uid = claim["metadata"]["uid"]
    (allocated,) = claim["status"]["allocation"]["devices"]["results"]
    gpu = devices[allocated["device"]]["attributes"]["uuid"]["string"]
    # The kubelet names a device in pod status by its first CDI device ID.
    resource_id = f"k8s.{node.driver}/claim={uid}-{allocated['device']}"
    minor = await kubelet_minor(kube, node)
    agent_log = agent.agent.log_path

    if minor < 36:
        # 1.35: ResourceHealthStatus is off; the agent is registered (the pod runs), never asked
        # for health, and the kubelet has nothing to complain about.
        got = await kube.get(POD, "watched", namespace)
        assert got is not None and device_status(got, resource_id) is None
        assert "watches device health" not in agent_log.read_text(errors="replace")
        log = node.kubelet.log_path.read_text(errors="replace")
        assert not [line for line in log.splitlines() if any(e in line for e in STREAM_ERRORS)]
        await delete_and_wait_unprepared(kube, node, pod, uid)
        return

    healthy = await until_status(kube, node, pod, resource_id, "Healthy", agent_log)
    assert healthy["claim"] == "claim:gpu"  # the pod's claim, by its name in the pod
    service = "v1.DRAResourceHealth" if minor >= 37 else "v1alpha1.DRAResourceHealth"
    assert f"the kubelet watches device health through {service}" in agent_log.read_text(errors="replace")

    # A fatal XID, and the driver asks for a GPU reset: unhealthy until the reset is done, and
    # why, in the stream's message (ResourceHealthStatusMessage: beta, on, from 1.36).
    mockstate.inject_xid(node.driver_root, gpu, XID)
    mockstate.set_recovery_action(node.driver_root, gpu, GPU_RESET)
    await until_status(kube, node, pod, resource_id, "Unhealthy", agent_log,
                       message=(f"/xid={XID}:NoSchedule (XID {XID}: ", "/recovery-action=gpu-reset:NoSchedule"))

    mockstate.recover_gpu(node.driver_root, gpu)
    await until_status(kube, node, pod, resource_id, "Healthy", agent_log)

    log = node.kubelet.log_path.read_text(errors="replace")
    assert not [line for line in log.splitlines() if any(e in line for e in STREAM_ERRORS)]
    await delete_and_wait_unprepared(kube, node, pod, uid)
