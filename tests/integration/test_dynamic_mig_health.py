"""Device health on dynamic MIG, the real agent process end to end: ``--mig dynamic`` on two
simulated MIG-enabled H100s (the NVML simulator with its state in the agent's driver root),
claims prepared over the kubelet's gRPC, XIDs injected on the instance NVML made for a claim, and
what the API server stores in the node's ResourceSlices and what the agent's DRAResourceHealth
stream (KEP-4680) tells the kubelet.

A contained XID (94) on a claim's 1g.10gb instance at memory slice 0 taints exactly the devices
that would use that memory: the seven placements over slice 0 (and the whole GPU where it is
published), nothing on the other slices or the other GPU. Its taint outlives the claim. The same
XID on the next claim's instance, at slice 6, adds the placements over slice 6. An XID that is not
contained (79, off the bus) taints every device of the GPU.

Placements need partitionable devices (1.36+), taints a server that keeps them (1.36+); on 1.35
the agent publishes static MIG, which test_dynamic_mig.py covers."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from test_kubelet_plugin import allocated_claim, plugin_agents, ref  # noqa: F401 - a fixture

from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_dev.kubelet_client import DraClient
from gpudra_dev.localcluster import mockstate
from gpudra_dev.localcluster.waiting import ConditionTimeout, wait_for
from gpudra_driver.nvml.fake import FakeNvml, load_profile
from gpudra_driver.plugin.gen import dra_health_v1_pb2, dra_health_v1_pb2_grpc
from gpudra_driver.plugin.sockets import SocketAddress

SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
PROFILE = "fake:h100-dynamic-mig"  # two H100 80GB HBM3, MIG enabled, no MIG devices
HEALTH_FLAGS = ("--health-probe-interval", "0.5", "--health-quiet-period", "300")
AT0 = {"gpu-0-mig-1g10gb-at0", "gpu-0-mig-1g10gbme-at0", "gpu-0-mig-1g20gb-at0", "gpu-0-mig-2g20gb-at0",
       "gpu-0-mig-3g40gb-at0", "gpu-0-mig-4g40gb-at0", "gpu-0-mig-7g80gb-at0"}  # every user of memory slice 0
AT6 = {"gpu-0-mig-1g10gb-at6", "gpu-0-mig-1g10gbme-at6", "gpu-0-mig-1g20gb-at6", "gpu-0-mig-3g40gb-at4",
       "gpu-0-mig-7g80gb-at0"}  # of slice 6


async def devices_of(kube: Kube, driver: str, node: str) -> dict[str, Obj]:
    return {d["name"]: d async for s in kube.list(SLICE, field_selector=f"spec.driver={driver},spec.nodeName={node}")
            for d in s["spec"].get("devices") or []}


def tainted(devices: dict[str, Obj]) -> dict[str, set[tuple[str, str, str]]]:
    return {n: {(t["key"], t.get("value", ""), t["effect"]) for t in d["taints"]}
            for n, d in devices.items() if d.get("taints")}


def mig_uuid(state: Path) -> str:
    """The UUID of the one MIG device on GPU 0 (the prepared claim's instance), as the agent's NVML has it now."""
    nvml = FakeNvml(load_profile(PROFILE.split(":", 1)[1]), state)
    nvml.nvmlInit()
    try:
        gpu = nvml.nvmlDeviceGetHandleByIndex(0)
        found = []
        for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(gpu)):
            try:
                found.append(str(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, slot))))
            except nvml.NVMLError:
                continue
        (uuid,) = found
        return uuid
    finally:
        nvml.nvmlShutdown()


async def test_a_contained_xid_on_a_claims_instance_taints_the_placements_on_its_memory_and_no_other(
        kube: Kube, namespace: str, fake_nodes: Any, plugin_agents: Callable[..., Any]) -> None:  # noqa: F811
    from test_consumable_capacity import minor_version

    if await minor_version(kube) < 36:  # static MIG there: no placements (test_dynamic_mig.py)
        return
    driver = f"mh{secrets.token_hex(3)}.gpudra.io"
    node = (await fake_nodes("mighealth"))["metadata"]["name"]
    plugin = plugin_agents(node, driver, nvml=PROFILE, extra_args=("--mig", "dynamic", *HEALTH_FLAGS))
    root = plugin.workdir / "driver-root"
    state = root / "run" / "gpudra-mock"

    async def until(check: Callable[[dict[str, Obj]], bool], what: str) -> dict[str, Obj]:
        async def probe() -> tuple[dict[str, Obj]] | None:
            found = await devices_of(kube, driver, node)
            return (found,) if check(found) else None

        try:
            (devices,) = await wait_for(probe, timeout=30, what=what)
        except ConditionTimeout as error:
            raise ConditionTimeout(f"{error}\nagent log:\n{plugin.agent.log_tail(60)}") from None
        return devices

    devices = await until(lambda d: len([n for n in d if "-mig-" in n]) == 50, "every placement of both GPUs")
    assert tainted(devices) == {}
    whole = {n for n in devices if n == "gpu-0"}  # the whole GPU, where it is published, holds every slice
    gpu0 = {n for n in devices if n == "gpu-0" or n.startswith("gpu-0-")}
    parent = devices["gpu-0-mig-1g10gb-at0"]["attributes"]["parentUUID"]["string"]
    registered = await plugin.registered()
    first = await allocated_claim(kube, namespace, "first", driver, node, ["gpu-0-mig-1g10gb-at0"])
    second = await allocated_claim(kube, namespace, "second", driver, node, ["gpu-0-mig-1g10gb-at6"])
    xid94 = {(f"{driver}/xid", "94", "NoSchedule")}

    with SocketAddress(plugin.dra_socket) as address:
        async with DraClient(registered.endpoint) as kubelet, grpc.aio.insecure_channel(address.target) as channel:
            health = dra_health_v1_pb2_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
                dra_health_v1_pb2.NodeWatchResourcesRequest())

            async def unhealthy_for_the_kubelet(expected: set[str]) -> None:
                """Read the agent's health stream until it lists exactly ``expected`` as UNHEALTHY."""
                async def probe() -> bool:
                    listed = await health.read()
                    return {d.device.device_name for d in listed.devices
                            if d.health == dra_health_v1_pb2.UNHEALTHY} == expected

                await wait_for(probe, timeout=30, what=f"the kubelet told {sorted(expected)} are unhealthy")

            assert (await plugin.prepare(kubelet, [ref(first)])).claims[first["metadata"]["uid"]].error == ""
            mockstate.inject_xid(root, mig_uuid(state), 94)
            devices = await until(lambda d: set(tainted(d)) == AT0 | whole, "slice 0's devices tainted")
            assert all(found == xid94 for found in tainted(devices).values()), tainted(devices)
            await unhealthy_for_the_kubelet(AT0 | whole)

            # the claim goes; the next one's instance, at slice 6, may get the same IDs from NVML
            assert (await kubelet.unprepare([ref(first)])).claims[first["metadata"]["uid"]].error == ""
            assert (await plugin.prepare(kubelet, [ref(second)])).claims[second["metadata"]["uid"]].error == ""
            mockstate.inject_xid(root, mig_uuid(state), 94)
            devices = await until(lambda d: set(tainted(d)) == AT0 | AT6 | whole,
                                  "slice 6's devices tainted too, slice 0's still")
            assert all(found == xid94 for found in tainted(devices).values()), tainted(devices)

            # off the bus: not contained, the whole GPU; the other GPU untouched
            mockstate.inject_xid(root, parent, 79)
            devices = await until(lambda d: set(tainted(d)) == gpu0, "every device of gpu-0 tainted")
            assert tainted(devices)["gpu-0-mig-1g10gb-at3"] == {(f"{driver}/xid", "79", "NoSchedule")}
            assert tainted(devices)["gpu-0-mig-1g10gb-at0"] == {(f"{driver}/xid", "79", "NoSchedule")}
            await unhealthy_for_the_kubelet(gpu0)
            assert (await kubelet.unprepare([ref(second)])).claims[second["metadata"]["uid"]].error == ""
            health.cancel()
