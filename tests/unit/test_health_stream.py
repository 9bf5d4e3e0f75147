"""The plugin's DRAResourceHealth service (KEP-4680) in-process, over its real unix socket: what a
kubelet reads from NodeWatchResources through v1 and v1alpha1, fed from the health feed the way
the monitor feeds it (taints computed by health.core). The real kubelets read it in
tests/integration/test_pod_health_status.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from plugin_fixtures import DRIVER, NODE, fake_root

from gpudra_core.devicemodel import DeviceTaint
from gpudra_driver.discovery import scan
from gpudra_driver.devicehealth.plan import Moment, Policy, Probe, Unmonitored, Xid, observe, taints
from gpudra_driver.devicehealth.feed import MESSAGE_MAX, HealthFeed, device_health
from gpudra_driver.nvml.fake import FakeNvml, load_profile
from gpudra_driver.plugin.gen import (dra_health_v1_pb2, dra_health_v1_pb2_grpc, dra_health_v1alpha1_pb2,
                                      dra_health_v1alpha1_pb2_grpc)
from gpudra_dev.kubelet_client import register
from gpudra_driver.plugin.plugin import KubeletPlugin
from gpudra_driver.plugin.sockets import SocketAddress

POLICY = Policy(driver=DRIVER)
API = {"v1": (dra_health_v1_pb2, dra_health_v1_pb2_grpc), "v1alpha1": (dra_health_v1alpha1_pb2, dra_health_v1alpha1_pb2_grpc)}


def l4_devices() -> list:
    return scan(FakeNvml(load_profile("l4x2"))).devices


def computed(state: dict, devices: list) -> dict:
    return {d.name: taints(state, d, POLICY) for d in devices}


@pytest.fixture
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("h")


def test_health_follows_the_taints_and_the_message_says_why() -> None:
    gpu0, gpu1 = l4_devices()
    uuid0 = str(gpu0.attributes["uuid"].value)
    uuid1 = str(gpu1.attributes["uuid"].value)
    state = observe({}, [Xid(uuid0, 79), Unmonitored(uuid1, "no XID events")], POLICY, Moment(100.0, 100.0))
    broken = device_health(NODE, gpu0, taints(state, gpu0, POLICY), DRIVER, 100.0)
    assert (broken.pool, broken.device, broken.health, broken.updated) == (NODE, gpu0.name, "UNHEALTHY", 100.0)
    assert broken.message == f"{DRIVER}/xid=79:NoSchedule (XID 79: GPU has fallen off the bus)"
    # no events to watch: only a lost GPU would be noticed, so the health is not known
    assert device_health(NODE, gpu1, taints(state, gpu1, POLICY), DRIVER, 100.0).health == "UNKNOWN"
    # an informational XID leaves the device healthy, and says so
    state = observe({}, [Xid(uuid0, 13)], POLICY, Moment(100.0, 100.0))
    ok = device_health(NODE, gpu0, taints(state, gpu0, POLICY), DRIVER, 100.0)
    assert ok.health == "HEALTHY" and ok.message.startswith(f"{DRIVER}/xid=13:None (XID 13: ")
    assert device_health(NODE, gpu0, (), DRIVER, 1.0).message == ""
    many = [DeviceTaint(f"{DRIVER}/xid", str(n), "NoSchedule", "2026-12-02T09:00:00Z") for n in range(100)]
    assert len(device_health(NODE, gpu0, many, DRIVER, 1.0).message) == MESSAGE_MAX

async def test_node_watch_resources_streams_the_complete_list_in_both_versions(root: Path) -> None:
    devices = l4_devices()
    uuid0 = str(devices[0].attributes["uuid"].value)
    feed = HealthFeed(NODE, timeout=30)
    plugin = KubeletPlugin(driver=DRIVER, node=NODE, kubelet_dir=root / "kubelet", cdi_dir=root / "cdi",
                           get_claim=lambda namespace, name: asyncio.sleep(0), instance="pod-1", boot_id="boot-1",
                           driver_root=fake_root("l4x2"), health=feed)
    await plugin.start()
    try:
        plugin.set_devices(devices)
        await plugin._register_task  # type: ignore[misc]
        registered = await register(plugin.registration_socket, driver=DRIVER)
        assert list(registered.info.supported_versions) == [
            "v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"]
        assert registered.version == "v1"  # the health entries do not disturb the DRAPlugin choice

        with SocketAddress(plugin.dra_socket) as address:
            async with grpc.aio.insecure_channel(address.target) as channel:
                streams = {version: grpc_mod.DRAResourceHealthStub(channel).NodeWatchResources(
                    pb.NodeWatchResourcesRequest()) for version, (pb, grpc_mod) in API.items()}
                # the first probe round: all healthy
                await feed.set(devices, computed({}, devices), DRIVER, 1000.0)
                for version, stream in streams.items():
                    pb = API[version][0]
                    first = await asyncio.wait_for(stream.read(), 5)
                    assert [(d.device.pool_name, d.device.device_name, d.health, d.last_updated_time,
                             d.health_check_timeout_seconds, d.message) for d in first.devices] == [
                        (NODE, d.name, pb.HEALTHY, 1000, 30, "") for d in devices]

                state = observe({}, [Probe(uuid0, lost=True)], POLICY, Moment(1001.0, 1001.0))
                await feed.set(devices, computed(state, devices), DRIVER, 1001.5)
                for version, stream in streams.items():
                    pb = API[version][0]
                    second = await asyncio.wait_for(stream.read(), 5)
                    assert [(d.device.device_name, d.health, d.last_updated_time) for d in second.devices] == [
                        (devices[0].name, pb.UNHEALTHY, 1001), (devices[1].name, pb.HEALTHY, 1001)]
                    assert second.devices[0].message == f"{DRIVER}/gpu-lost:NoSchedule"

                # a watcher that comes late gets the latest list at once
                late = dra_health_v1_pb2_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
                    dra_health_v1_pb2.NodeWatchResourcesRequest())
                assert (await asyncio.wait_for(late.read(), 5)).devices[0].health == dra_health_v1_pb2.UNHEALTHY

                # stopping ends the streams (the server does not wait out its grace for them)
                loop = asyncio.get_running_loop()
                started = loop.time()
                await plugin.stop(grace=10)
                assert loop.time() - started < 5
                for stream in (*streams.values(), late):
                    assert await asyncio.wait_for(stream.read(), 5) is grpc.aio.EOF
    finally:
        await plugin.stop()


async def test_without_health_monitoring_the_service_is_neither_served_nor_advertised(root: Path) -> None:
    plugin = KubeletPlugin(driver=DRIVER, node=NODE, kubelet_dir=root / "kubelet", cdi_dir=root / "cdi",
                           get_claim=lambda namespace, name: asyncio.sleep(0), instance="pod-1", boot_id="boot-1",
                           driver_root=fake_root("l4x2"))
    await plugin.start()
    try:
        plugin.set_devices(l4_devices())
        await plugin._register_task  # type: ignore[misc]
        registered = await register(plugin.registration_socket, driver=DRIVER)
        assert list(registered.info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
        with SocketAddress(plugin.dra_socket) as address:
            async with grpc.aio.insecure_channel(address.target) as channel:
                stream = dra_health_v1alpha1_pb2_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
                    dra_health_v1alpha1_pb2.NodeWatchResourcesRequest())
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await asyncio.wait_for(stream.read(), 5)
                assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await plugin.stop()
