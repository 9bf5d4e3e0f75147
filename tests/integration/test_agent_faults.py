"""The node agent under faults and bad input, as a subprocess against the real control plane:
NVML that cannot start, one GPU failing mid-scan, an unreachable API server, a slice someone else
wrote for our driver on our node, and SIGTERM during a rolling update."""

from __future__ import annotations

import asyncio
import re
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml

from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_dev.localcluster.agents import AgentProcess
from gpudra_dev.localcluster.controlplane import ControlPlane
from gpudra_dev.localcluster.fakedriverroot import make_driver_root, make_pci_sysfs
from gpudra_dev.localcluster.objects import events_about
from gpudra_dev.localcluster.waiting import wait_for

SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
NODE = resource_type("v1", "Node")
PROFILES = Path(__file__).resolve().parents[2] / "driver" / "gpudra_driver" / "profiles"


@pytest.fixture
def driver() -> str:
    return f"f{secrets.token_hex(4)}.gpudra.io"


@pytest.fixture(autouse=True)
def debug_logs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUDRA_LOG_LEVEL", "DEBUG")  # the agents count their quiet retries at DEBUG


def write_profile(path: Path, doc: dict[str, Any]) -> Path:
    """Atomically: the agent may read the file at any moment."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(doc))
    tmp.replace(path)
    return path


def profile(name: str) -> dict[str, Any]:
    return yaml.safe_load((PROFILES / f"{name}.yaml").read_text())


async def node_slices(kube: Kube, driver: str, node: str) -> list[Obj]:
    return [s async for s in kube.list(SLICE, field_selector=f"spec.driver={driver},spec.nodeName={node}")]


def published(kube: Kube, driver: str, node: str, names: list[str], agent: AgentProcess,
              generation: int | None = None):
    async def probe() -> list[Obj] | None:
        assert agent.process.poll() is None, f"agent exited:\n{agent.log_tail()}"
        slices = await node_slices(kube, driver, node)
        found = sorted(d["name"] for s in slices for d in s["spec"].get("devices") or [])
        if found != sorted(names):
            return None
        if generation is not None and {s["spec"]["pool"]["generation"] for s in slices} != {generation}:
            return None
        return slices
    return probe


def log_lines(agent: AgentProcess, pattern: str) -> list[str]:
    return [line for line in agent.log_path.read_text(errors="replace").splitlines() if re.search(pattern, line)]


def logged(agent: AgentProcess, pattern: str, count: int = 1):
    async def probe() -> list[str] | None:
        assert agent.process.poll() is None, f"agent exited:\n{agent.log_tail()}"
        lines = log_lines(agent, pattern)
        return lines if len(lines) >= count else None
    return probe


async def test_nvml_failing_at_init_is_one_clear_line_then_publishes_once_nvml_works(
        kube: Kube, fake_nodes, agents, driver: str, tmp_path: Path) -> None:
    node = (await fake_nodes("nodrv"))["metadata"]["name"]
    doc = profile("l4x2")
    path = write_profile(tmp_path / "nvml.yaml", {**doc, "initError": "DriverNotLoaded"})
    agent = agents(node, f"fake:{path}", driver, rescan_interval=0.1)

    # Several failed scans, one ERROR line, the process alive, nothing published.
    await wait_for(logged(agent, r"DEBUG .*GPU discovery still failing \(\d+ consecutive", 3),
                   timeout=30, what="three repeated NVML failures")
    (error,) = log_lines(agent, r" ERROR ")
    assert "GPU discovery failed: NVML unavailable: the NVIDIA kernel driver is not loaded" in error
    assert "check `nvidia-smi` and `lsmod | grep nvidia` on the node" in error  # the fix
    assert "retries every 0.1s" in error
    assert agent.process.poll() is None
    assert await node_slices(kube, driver, node) == []

    write_profile(path, doc)  # the driver got loaded
    await wait_for(published(kube, driver, node, ["gpu-0", "gpu-1"], agent, generation=1), timeout=15,
                   what="the L4s once NVML works")
    (recovered,) = log_lines(agent, r" INFO gpudra.agent: GPU discovery works again after \d+ failed scan")
    assert int(re.search(r"after (\d+) failed", recovered).group(1)) >= 3
    assert len(log_lines(agent, r" ERROR ")) == 1


async def test_a_driver_root_without_nvml_is_an_event_on_the_node_until_the_driver_arrives(
        kube: Kube, fake_nodes, agents, driver: str, short_dir: Path) -> None:
    """The GPU Operator's driver container starts after the agent: its root is there but empty of
    NVML. The agent (real pynvml) says so in its log and as a Warning event on its Node, naming the
    root and the paths it searched, stays up, and publishes once the library appears."""
    node = (await fake_nodes("drvctr"))["metadata"]["name"]
    root = short_dir / "run-nvidia-driver"
    (root / "etc").mkdir(parents=True)  # mounted, not yet populated
    agent = agents(node, "real", driver, rescan_interval=0.2, driver_root=root,
                   sysfs=make_pci_sysfs(short_dir / "sys", "l4x2"))  # a GPU node: its GPUs are on the bus

    async def node_event(reason: str) -> Obj | None:
        assert agent.process.poll() is None, f"agent exited:\n{agent.log_tail()}"
        found = [e for e in await events_about(kube, node) if e.get("reason") == reason]
        return found[0] if found else None

    failed = await wait_for(lambda: node_event("GpuDiscoveryFailed"), timeout=30, what="the Warning event")
    assert failed["type"] == "Warning" and failed["involvedObject"]["kind"] == "Node"
    assert f"libnvidia-ml.so.1 was not found in driver root {root}" in failed["message"]
    assert f"{root}/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1" in failed["message"]
    assert await node_slices(kube, driver, node) == []

    make_driver_root(root, "l4x2")  # the driver container is up
    await wait_for(published(kube, driver, node, ["gpu-0", "gpu-1"], agent), timeout=30,
                   what="the L4s once libnvidia-ml.so.1 is in the root")
    recovered = await wait_for(lambda: node_event("GpuDiscoveryRecovered"), timeout=15, what="the Normal event")
    assert recovered["type"] == "Normal"


async def test_no_gpu_is_published_where_nvidias_device_plugin_advertises_them(
        kube: Kube, fake_nodes, agents, driver: str) -> None:
    """The GPU Operator's device plugin still runs on the node: both would hand out the same GPUs.
    The agent publishes nothing while the Node advertises nvidia.com/gpu, says so on the Node, and
    publishes once the device plugin is gone (Node status patched, as the kubelet would)."""
    node = (await fake_nodes("devplug"))["metadata"]["name"]
    await kube.patch(NODE, node, {"status": {"allocatable": {"nvidia.com/gpu": "2"},
                                             "capacity": {"nvidia.com/gpu": "2"}}}, subresource="status")
    agent = agents(node, "fake:l4x2", driver, rescan_interval=0.2)  # the Node is read every 5 rescans

    async def node_event(reason: str) -> Obj | None:
        assert agent.process.poll() is None, f"agent exited:\n{agent.log_tail()}"
        return next((e for e in await events_about(kube, node) if e.get("reason") == reason), None)

    conflict = await wait_for(lambda: node_event("DevicePluginConflict"), timeout=30, what="the Warning event")
    assert conflict["type"] == "Warning" and conflict["source"]["component"] == f"gpudra-agent/{driver}"
    assert "advertises nvidia.com/gpu: 2 from NVIDIA's device plugin" in conflict["message"]
    await wait_for(logged(agent, r"DEBUG .*rescan: 2 device\(s\), unchanged", 3), timeout=15, what="rescans")
    assert [d for s in await node_slices(kube, driver, node) for d in s["spec"].get("devices") or []] == []

    await kube.patch(NODE, node, {"status": {"allocatable": {"nvidia.com/gpu": None},
                                             "capacity": {"nvidia.com/gpu": None}}}, subresource="status")
    await wait_for(published(kube, driver, node, ["gpu-0", "gpu-1"], agent), timeout=30,
                   what="the L4s once the device plugin is gone")
    assert await wait_for(lambda: node_event("DevicePluginConflictResolved"), timeout=15, what="the Normal event")


async def test_allow_device_plugin_publishes_anyway(kube: Kube, fake_nodes, agents, driver: str) -> None:
    node = (await fake_nodes("devplugok"))["metadata"]["name"]
    await kube.patch(NODE, node, {"status": {"allocatable": {"nvidia.com/gpu": "2"}}}, subresource="status")
    agent = agents(node, "fake:l4x2", driver, rescan_interval=0.2, extra_args=("--allow-device-plugin",))
    await wait_for(published(kube, driver, node, ["gpu-0", "gpu-1"], agent), timeout=30, what="the L4s")


async def test_a_product_name_past_the_api_limit_holds_up_nothing(
        kube: Kube, fake_nodes, agents, driver: str, tmp_path: Path) -> None:
    """NVML product names reach 96 characters; attribute strings 64. The node publishes every GPU,
    the long name cut to 64, and says so in its log and a Node event (the review's defect: one
    value made the whole pool fail, retried every 30 s, forever)."""
    node = (await fake_nodes("longname"))["metadata"]["name"]
    doc = profile("l4x2")
    doc["gpus"][1]["name"] = "NVIDIA L4 " + "Extended Edition " * 5
    agent = agents(node, f"fake:{write_profile(tmp_path / 'nvml.yaml', doc)}", driver, rescan_interval=0.2)
    slices = await wait_for(published(kube, driver, node, ["gpu-0", "gpu-1"], agent), timeout=30, what="both L4s")
    names = {d["name"]: d["attributes"]["productName"]["string"] for s in slices for d in s["spec"]["devices"]}
    assert names["gpu-1"] == doc["gpus"][1]["name"][:64] and names["gpu-0"] == "NVIDIA L4"

    async def warned() -> Obj | None:
        return next((e for e in await events_about(kube, node) if e.get("reason") == "DiscoveryWarning"), None)

    event = await wait_for(warned, timeout=15, what="the Node event")
    assert "device gpu-1 attribute productName" in event["message"] and "cut to 64 characters" in event["message"]
    assert len(log_lines(agent, r" WARNING .*cut to 64 characters")) == 1  # once, not every rescan


async def test_a_gpu_failing_mid_scan_is_skipped_with_one_warning_and_the_others_are_published(
        kube: Kube, fake_nodes, agents, driver: str, tmp_path: Path) -> None:
    node = (await fake_nodes("badgpu"))["metadata"]["name"]
    doc = profile("dgx-h100")
    broken = yaml.safe_load(yaml.safe_dump(doc))
    broken["gpus"][3]["fail"] = True
    path = write_profile(tmp_path / "nvml.yaml", broken)
    agent = agents(node, f"fake:{path}", driver, rescan_interval=0.1)
    healthy = [f"gpu-{i}" for i in range(8) if i != 3]
    await wait_for(published(kube, driver, node, healthy, agent), timeout=30, what="the 7 healthy H100s")
    await wait_for(logged(agent, r"DEBUG .*rescan: 7 device\(s\), unchanged", 3), timeout=15,
                   what="three more rescans")
    (warning,) = log_lines(agent, r" WARNING ")
    assert "GPU 3 skipped: nvmlDeviceGetUUID failed" in warning
    assert log_lines(agent, r" ERROR ") == []

    write_profile(path, doc)  # the GPU came back (e.g. after a reset)
    await wait_for(published(kube, driver, node, [f"gpu-{i}" for i in range(8)], agent, generation=2),
                   timeout=15, what="all 8 H100s at generation 2")


class FlakyProxy:
    """A TCP proxy to the API server that drops connections while ``down`` or while ``drop_next``
    is positive, and otherwise forwards bytes both ways (TLS passes through untouched)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.down = False
        self.drop_next = 0
        self.dropped = 0
        self.forwarded = 0
        self._open: set[asyncio.StreamWriter] = set()
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    def cut(self) -> None:
        """Go down and reset every forwarded connection (open watches included)."""
        self.down = True
        for writer in list(self._open):
            writer.transport.abort()

    async def close(self) -> None:
        self.cut()
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.down or self.drop_next > 0:
            self.drop_next = max(0, self.drop_next - 1)
            self.dropped += 1
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.transport.abort()
            return
        self.forwarded += 1
        self._open.update((writer, up_writer))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.transport.abort()

        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            self._open.difference_update((writer, up_writer))


@pytest_asyncio.fixture(loop_scope="session")
async def proxied(cluster: ControlPlane, tmp_path: Path) -> AsyncIterator[tuple[FlakyProxy, Path]]:
    proxy = FlakyProxy(cluster.apiserver_port)
    port = await proxy.start()
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    for entry in config["clusters"]:
        entry["cluster"]["server"] = f"https://127.0.0.1:{port}"  # the serving cert has SAN 127.0.0.1
    kubeconfig = tmp_path / "proxied.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(config))
    try:
        yield proxy, kubeconfig
    finally:
        await proxy.close()


def retry_delays(agent: AgentProcess) -> list[float]:
    return [float(m.group(1)) for line in log_lines(agent, r"failed \(.*\); retrying in")
            if (m := re.search(r"retrying in ([\d.]+)s", line))]


async def test_unreachable_api_server_is_retried_with_backoff_and_published_when_back(
        kube: Kube, fake_nodes, agents, driver: str, proxied: tuple[FlakyProxy, Path]) -> None:
    proxy, kubeconfig = proxied
    node = (await fake_nodes("netsplit"))["metadata"]["name"]
    proxy.drop_next = 4  # the API server is unreachable when the agent starts
    agent = agents(node, "fake:l4x2", driver, kubeconfig=kubeconfig)
    first = await wait_for(published(kube, driver, node, ["gpu-0", "gpu-1"], agent), timeout=30,
                           what="publishing once the API server is reachable")
    assert proxy.dropped == 4 and proxy.forwarded >= 1
    delays = retry_delays(agent)
    assert len(delays) >= 3, agent.log_tail()
    assert delays[:3] == sorted(delays[:3]) and delays[2] > delays[0], f"no backoff: {delays}"

    # An outage while running: the watch is cut, and meanwhile our slice disappears.
    proxy.cut()
    await kube.delete(SLICE, first[0]["metadata"]["name"])
    before = len(retry_delays(agent))
    await wait_for(logged(agent, r"failed \(.*\); retrying in", before + 2), timeout=30,
                   what="the agent to retry during the outage")
    assert await node_slices(kube, driver, node) == []  # it could not write: we really were down
    proxy.down = False
    restored = await wait_for(published(kube, driver, node, ["gpu-0", "gpu-1"], agent), timeout=30,
                              what="the slice restored after the outage")
    assert restored[0]["metadata"]["uid"] != first[0]["metadata"]["uid"]
    assert restored[0]["spec"]["pool"]["generation"] > first[0]["spec"]["pool"]["generation"]
    assert agent.process.poll() is None


async def test_a_foreign_slice_for_our_driver_on_our_node_is_converged_to_ours(
        kube: Kube, fake_nodes, agents, driver: str) -> None:
    node = (await fake_nodes("foreign"))["metadata"]["name"]
    agent = agents(node, "fake:l4x2", driver)
    (ours,) = await wait_for(published(kube, driver, node, ["gpu-0", "gpu-1"], agent, generation=1),
                             timeout=30, what="the L4s")
    foreign = await kube.create({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-impostor"},
        "spec": {"driver": driver, "nodeName": node,
                 "pool": {"name": node, "generation": 7, "resourceSliceCount": 1},
                 "devices": [{"name": "gpu-9", "attributes": {"productName": {"string": "NVIDIA H200"}},
                              "capacity": {"memory": {"value": "141Gi"}}}]},
    })
    # Above the impostor's generation, so no scheduler cache can prefer its pool contents.
    (after,) = await wait_for(published(kube, driver, node, ["gpu-0", "gpu-1"], agent, generation=8),
                              timeout=5, what="only our slice, at generation 8")
    assert after["metadata"]["name"] == ours["metadata"]["name"]
    assert after["metadata"]["uid"] == ours["metadata"]["uid"]  # updated in place
    assert foreign["metadata"]["uid"] not in {s["metadata"]["uid"] for s in await node_slices(kube, driver, node)}
    assert "deleting obsolete ResourceSlice " + foreign["metadata"]["name"] in agent.log_path.read_text()


async def test_sigterm_exits_zero_and_leaves_the_slices_in_place(kube: Kube, fake_nodes, agents,
                                                                driver: str) -> None:
    node = (await fake_nodes("rolling"))["metadata"]["name"]
    agent = agents(node, "fake:dgx-h100", driver)
    before = await wait_for(published(kube, driver, node, [f"gpu-{i}" for i in range(8)], agent), timeout=30,
                            what="the H100s")
    assert agent.stop() == 0, agent.log_tail()
    assert "ResourceSlices left in place" in agent.log_tail(3)
    after = await node_slices(kube, driver, node)
    key = [(s["metadata"]["uid"], s["metadata"]["resourceVersion"]) for s in before]
    assert [(s["metadata"]["uid"], s["metadata"]["resourceVersion"]) for s in after] == key

    # The next instance (the rolling update's new pod) adopts them without a write.
    successor = agents(node, "fake:dgx-h100", driver)
    await wait_for(logged(successor, r"DEBUG .*pool \S+ generation 1 is up to date"), timeout=30,
                   what="the successor to find its pool up to date")
    assert log_lines(successor, r"published \d+ device") == []
    assert successor.stop() == 0
    final = await node_slices(kube, driver, node)
    assert [(s["metadata"]["uid"], s["metadata"]["resourceVersion"]) for s in final] == key
