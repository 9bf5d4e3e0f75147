"""The seed scenario on a LocalGpuCluster: a claim template for a GPU with >= 64Gi of memory and a
Job using it, scheduled by the real scheduler, then prepared through the node agent's kubelet
plugin socket the way the kubelet does before it starts the container."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpudra_core.kubeapi import Obj, resource_type

from .gpucluster import LocalGpuCluster
from .waiting import wait_for

POD = resource_type("v1", "Pod")
CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")
SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")


@dataclass(frozen=True)
class SeedResult:
    pod: Obj
    claim: Obj
    node_name: str
    claim_name: str
    device: str
    memory: str
    uuid: str
    cdi_device_ids: list[str]
    cdi_spec_path: Path


async def scheduled_pod(cluster: LocalGpuCluster, namespace: str, job: str, timeout: float = 60) -> Obj:
    async def probe() -> Obj | None:
        pods = [p async for p in cluster.kube.list(POD, namespace, label_selector=f"job-name={job}")]
        return next((p for p in pods if p["spec"].get("nodeName") and p.get("status", {}).get("resourceClaimStatuses")),
                    None)

    return await wait_for(probe, timeout=timeout, what=f"a pod of Job {job} to be scheduled with its claim")


async def published_device(cluster: LocalGpuCluster, pool: str, name: str) -> Obj:
    async for slice_ in cluster.kube.list(SLICE, field_selector=f"spec.driver={cluster.driver},spec.nodeName={pool}"):
        for device in slice_["spec"].get("devices") or []:
            if device["name"] == name:
                return device
    raise LookupError(f"device {name} is not published in pool {pool}")


async def prepare_claim(cluster: LocalGpuCluster, node_name: str, claim: Obj) -> list[str]:
    """Play the kubelet: register with the node's agent, then NodePrepareResources for ``claim``."""
    from gpudra_dev.kubelet_client import DraClient, register

    registration = cluster.registration_socket(node_name)
    await wait_for(lambda: _is_socket(registration), timeout=30, what=f"the agent's registration socket on {node_name}")
    registered = await register(registration, driver=cluster.driver)
    meta = claim["metadata"]
    async with DraClient(registered.endpoint, registered.version) as kubelet:
        response = await kubelet.prepare([(meta["namespace"], meta["name"], meta["uid"])])
    result = response.claims[meta["uid"]]
    if result.error:
        raise RuntimeError(f"NodePrepareResources for claim {meta['namespace']}/{meta['name']}: {result.error}")
    return [cdi_id for device in result.devices for cdi_id in device.cdi_device_ids]


async def _is_socket(path: Path) -> bool:
    return path.is_socket()


async def run_seed(cluster: LocalGpuCluster, manifest: Path, *, job: str = "train", namespace: str = "default",
                   say: Callable[[str], None] = print) -> SeedResult:
    await cluster.apply_file(manifest)
    say("waiting for the scheduler to allocate a GPU and bind the Job's pod")
    pod = await scheduled_pod(cluster, namespace, job)
    node_name = pod["spec"]["nodeName"]
    claim_name = pod["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    claim = await cluster.kube.get(CLAIM, claim_name, namespace)
    assert claim is not None
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    device = await published_device(cluster, result["pool"], result["device"])
    say(f"pod {pod['metadata']['name']} bound to {node_name}; claim {claim_name} allocated {result['device']}")
    say(f"playing the kubelet on {node_name}: registration handshake, then NodePrepareResources")
    cdi_ids = await prepare_claim(cluster, node_name, claim)
    spec_path = cluster.cdi_dir(node_name) / f"k8s.{cluster.driver}-claim_{claim['metadata']['uid']}.json"
    say(f"claim prepared: CDI device IDs {', '.join(cdi_ids)}; the container can start")
    await cluster.kubelet.start_pod(pod)
    return SeedResult(pod=pod, claim=claim, node_name=node_name, claim_name=claim_name, device=result["device"],
                      memory=device["capacity"]["memory"]["value"], uuid=device["attributes"]["uuid"]["string"],
                      cdi_device_ids=cdi_ids, cdi_spec_path=spec_path)
