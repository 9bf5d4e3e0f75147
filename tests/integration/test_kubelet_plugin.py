"""The kubelet DRA plugin of a real agent subprocess, driven by a kubelet-side gRPC client (the
registration handshake, then NodePrepareResources / NodeUnprepareResources over v1 and v1beta1),
with claims allocated by the real scheduler or written into the real API server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import socket
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from cdispec import load_and_validate, validate_prepared
from nodestate import checkpoint_states
from seedobjects import published_devices, seed_objects

from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_driver.plugin.cdi import metadata_dir
from gpudra_driver.plugin.checkpoint import is_leftover
from gpudra_driver.plugin.state import CHECKPOINT_FILE
from gpudra_dev.kubelet_client import DraClient, Registered, probe_health, register
from gpudra_driver.plugin.plugin import socket_paths
from gpudra_dev.localcluster.agents import AGENT_RSS_BUDGET_MIB, AgentProcess, start_agent
from gpudra_dev.localcluster.controlplane import ControlPlane, free_port
from gpudra_dev.localcluster.objects import events_about
from gpudra_dev.localcluster.waiting import wait_for

SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
DEVICE_CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")
CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")
POD = resource_type("v1", "Pod")


@pytest.fixture
def driver() -> str:
    return f"k{secrets.token_hex(4)}.gpudra.io"


@dataclass
class PluginAgent:
    agent: AgentProcess
    workdir: Path
    driver: str
    pod_uid: str

    @property
    def registration_socket(self) -> Path:
        return socket_paths(self.workdir / "kubelet", self.driver, self.pod_uid)[1]

    @property
    def dra_socket(self) -> Path:
        return socket_paths(self.workdir / "kubelet", self.driver, self.pod_uid)[0]

    @property
    def cdi_dir(self) -> Path:
        return self.workdir / "cdi"

    def spec_path(self, claim_uid: str) -> Path:
        return self.cdi_dir / f"k8s.{self.driver}-claim_{claim_uid}.json"

    def checkpoint(self) -> dict[str, str]:
        return checkpoint_states(self.workdir / "kubelet", self.driver)

    async def prepare(self, kubelet: DraClient, claims: Iterable[tuple[str, str, str]]) -> Any:
        """NodePrepareResources; the spec of every claim it reports prepared is validated at once."""
        response = await kubelet.prepare(claims)
        validate_prepared(self.cdi_dir, response)
        return response

    async def registered(self) -> Registered:
        """Wait for the registration socket like the kubelet's inotify watcher, then register."""
        async def appeared() -> bool:
            assert self.agent.process.poll() is None, f"agent exited:\n{self.agent.log_tail()}"
            return self.registration_socket.is_socket()

        await wait_for(appeared, timeout=30, what=f"registration socket {self.registration_socket}")
        return await register(self.registration_socket, driver=self.driver)


@pytest_asyncio.fixture(loop_scope="session")
async def plugin_agents(cluster: ControlPlane, tmp_path: Path) -> AsyncIterator[Callable[..., PluginAgent]]:
    started: list[PluginAgent] = []

    def start(node_name: str, driver: str, nvml: str = "fake:dgx-h100", workdir: Path | None = None,
              extra_args: tuple[str, ...] = (), driver_root: Path | None = None) -> PluginAgent:
        pod_uid = str(uuid.uuid4())
        workdir = workdir or tmp_path / node_name
        agent = start_agent(kubeconfig=cluster.kubeconfig, node_name=node_name, nvml=nvml, driver=driver,
                            workdir=workdir, extra_args=("--pod-uid", pod_uid, *extra_args), driver_root=driver_root)
        started.append(PluginAgent(agent, workdir, driver, pod_uid))
        return started[-1]

    yield start
    for plugin in started:
        plugin.agent.stop()
    for plugin in started:  # every spec any test left behind must still be valid
        for path in plugin.cdi_dir.glob("*.json") if plugin.cdi_dir.is_dir() else []:
            load_and_validate(path)


async def allocated_claim(kube: Kube, namespace: str, name: str, driver: str, pool: str, devices: list[str],
                          *, result_driver: str | None = None, config: list[Obj] | None = None) -> Obj:
    """A ResourceClaim with ``status.allocation`` written directly (what the scheduler would write)."""
    await kube.create({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": driver, "allocationMode": "ExactCount", "count": len(devices)}}]}}})
    status: Obj = {"allocation": {"devices": {"results": [
        {"request": "gpu", "driver": result_driver or driver, "pool": pool, "device": d} for d in devices]}}}
    if config is not None:  # as the scheduler copies it from the class and the claim
        status["allocation"]["devices"]["config"] = config
    return await kube.patch(CLAIM, name, {"status": status}, namespace=namespace, subresource="status")


def ref(claim: Obj) -> tuple[str, str, str]:
    meta = claim["metadata"]
    return meta["namespace"], meta["name"], meta["uid"]


async def test_seed_pod_is_scheduled_prepared_and_unprepared(kube: Kube, namespace: str, fake_nodes,
                                                             plugin_agents, driver: str) -> None:
    node = (await fake_nodes("h100"))["metadata"]["name"]
    plugin = plugin_agents(node, driver)
    devices = await published_devices(kube, driver, node, 8)
    registered = await plugin.registered()
    assert (registered.version, registered.endpoint) == ("v1", str(plugin.dra_socket))
    # and the KEP-4680 health stream: the agent monitors device health by default
    assert list(registered.info.supported_versions) == [
        "v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"]

    await kube.create({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": driver},
                       "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]}})
    try:
        template, seed_pod = seed_objects(driver, namespace)
        await kube.create(template)
        await kube.create(seed_pod)

        async def scheduled() -> Obj | None:
            pod = await kube.get(POD, seed_pod["metadata"]["name"], namespace)
            return pod if pod and pod["spec"].get("nodeName") else None

        pod = await wait_for(scheduled, timeout=30, what="the seed pod to be scheduled")
        assert pod["spec"]["nodeName"] == node
        claim = await kube.get(CLAIM, pod["status"]["resourceClaimStatuses"][0]["resourceClaimName"], namespace)
        (allocated,) = claim["status"]["allocation"]["devices"]["results"]
        uid = claim["metadata"]["uid"]
        gpu = devices[allocated["device"]]
        minor, gpu_uuid = gpu["attributes"]["minor"]["int"], gpu["attributes"]["uuid"]["string"]

        async with DraClient(registered.endpoint, registered.version) as kubelet:
            response = await plugin.prepare(kubelet, [ref(claim)])
            out = response.claims[uid]
            assert out.error == ""
            (device,) = out.devices
            assert (list(device.request_names), device.pool_name, device.device_name) == (["gpu"], node,
                                                                                            allocated["device"])
            cdi_id = f"k8s.{driver}/claim={uid}-{allocated['device']}"
            # its own, and its request's device metadata mount (docs/kubelet-plugin.md#device-metadata)
            assert list(device.cdi_device_ids) == [cdi_id, f"k8s.{driver}/claim={uid}_gpu"]
            spec = load_and_validate(plugin.spec_path(uid))  # where the tests expect it, too
            assert [f"{spec['kind']}={d['name']}" for d in spec["devices"]] == list(device.cdi_device_ids)
            root = plugin.workdir / "driver-root"  # the agent's fake driver root, with real device nodes
            assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [
                {"path": f"/dev/nvidia{minor}", "hostPath": f"{root}/dev/nvidia{minor}"}]
            assert spec["containerEdits"]["env"][0] == f"NVIDIA_VISIBLE_DEVICES={gpu_uuid}"
            assert plugin.checkpoint() == {uid: "PrepareCompleted"}

            stat = plugin.spec_path(uid).stat()
            again = await plugin.prepare(kubelet, [ref(claim)])  # a kubelet retry: same answer, nothing rewritten
            assert again == response
            assert (plugin.spec_path(uid).stat().st_ino, plugin.spec_path(uid).stat().st_mtime_ns) == (
                stat.st_ino, stat.st_mtime_ns)

            unprepared = await kubelet.unprepare([ref(claim)])
            assert unprepared.claims[uid].error == ""
            assert not plugin.spec_path(uid).exists() and plugin.checkpoint() == {}
            assert (await kubelet.unprepare([ref(claim)])).claims[uid].error == ""  # unknown: success
        # as the DaemonSet runs it: the standard loop, PYTHONOPTIMIZE=2 from the process env the harness applies
        assert "event loop asyncio, Python optimization level 2" in plugin.agent.log_path.read_text()
    finally:
        await kube.delete(DEVICE_CLASS, driver)


async def test_bad_claims_get_their_own_errors_over_v1beta1(kube: Kube, namespace: str, fake_nodes,
                                                           plugin_agents, driver: str) -> None:
    node = (await fake_nodes("h100"))["metadata"]["name"]
    plugin = plugin_agents(node, driver)
    await published_devices(kube, driver, node, 8)
    await plugin.registered()
    registered = await register(plugin.registration_socket, prefer=["v1beta1.DRAPlugin"])  # a 1.32/1.33 kubelet
    assert registered.version == "v1beta1"
    good = await allocated_claim(kube, namespace, "good", driver, node, ["gpu-1", "gpu-2"])
    other_node = await allocated_claim(kube, namespace, "other-node", driver, "some-other-node", ["gpu-1"])
    other_driver = await allocated_claim(kube, namespace, "other-driver", driver, node, ["gpu-3"],
                                         result_driver="other.example.com")
    unknown = await allocated_claim(kube, namespace, "unknown", driver, node, ["gpu-99"])
    taken = await allocated_claim(kube, namespace, "taken", driver, node, ["gpu-2"])
    pending = await kube.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                "metadata": {"name": "pending", "namespace": namespace},
                                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                                    "deviceClassName": driver}}]}}})
    def files_outside_cdi() -> list[str]:  # the checkpoint's own scratch files aside
        return sorted(str(p.relative_to(plugin.workdir)) for p in plugin.workdir.rglob("*")
                      if "cdi" not in p.parts and not is_leftover(p.name, CHECKPOINT_FILE))

    before = files_outside_cdi()
    async with DraClient(registered.endpoint, "v1beta1") as kubelet:
        response = await plugin.prepare(kubelet, [
            ref(good), ref(other_node), ref(other_driver), ref(unknown), ref(taken), ref(pending),
            (namespace, "good", "0badc0de-0000-4000-8000-000000000000"),  # replaced: UID mismatch
            (namespace, "missing", "0badc0de-0000-4000-8000-000000000001"),
            (namespace, "../../../etc/passwd", "0badc0de-0000-4000-8000-000000000002"),
            (namespace, "x", "../../x"), (namespace, "y", ""),
        ])
        errors = {uid: r.error for uid, r in response.claims.items()}
        assert len(errors) == 11 and errors[good["metadata"]["uid"]] == ""
        assert [d.device_name for d in response.claims[good["metadata"]["uid"]].devices] == ["gpu-1", "gpu-2"]
        expected = {
            other_node["metadata"]["uid"]: "pool 'some-other-node'",
            other_driver["metadata"]["uid"]: f"no device of driver {driver}",
            unknown["metadata"]["uid"]: "'gpu-99' is not a device of node",
            taken["metadata"]["uid"]: f"already prepared for claim {good['metadata']['uid']}",
            pending["metadata"]["uid"]: "not allocated",
            "0badc0de-0000-4000-8000-000000000000": "the claim was replaced",
            "0badc0de-0000-4000-8000-000000000001": "not found",
            "0badc0de-0000-4000-8000-000000000002": "malformed",
            "../../x": "malformed", "": "uid is required",
        }
        for uid, fragment in expected.items():
            assert fragment in errors[uid], (uid, errors[uid])
        # Only the good claim's spec and its device metadata file were written, nothing anywhere else,
        # and the server still serves.
        metadata = metadata_dir(plugin.cdi_dir, driver)
        assert sorted(os.listdir(plugin.cdi_dir)) == sorted([plugin.spec_path(good["metadata"]["uid"]).name, metadata.name])
        assert os.listdir(metadata) == [f"{good['metadata']['uid']}_gpu.json"]
        assert files_outside_cdi() == before
        assert (await kubelet.unprepare([ref(good)])).claims[good["metadata"]["uid"]].error == ""
        assert os.listdir(plugin.cdi_dir) == [metadata.name] and os.listdir(metadata) == []


async def test_unwritable_cdi_directory_is_a_per_claim_error(kube: Kube, namespace: str, fake_nodes,
                                                            plugin_agents, driver: str, tmp_path: Path) -> None:
    node = (await fake_nodes("h100"))["metadata"]["name"]
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the CDI directory should be")
    plugin = plugin_agents(node, driver, extra_args=("--cdi-dir", str(blocker)))
    await published_devices(kube, driver, node, 8)
    registered = await plugin.registered()
    claim = await allocated_claim(kube, namespace, "c", driver, node, ["gpu-0"])
    async with DraClient(registered.endpoint) as kubelet:
        out = (await plugin.prepare(kubelet, [ref(claim)])).claims[claim["metadata"]["uid"]]
    assert "writing its CDI spec" in out.error and not out.devices
    assert plugin.checkpoint() == {} and blocker.read_text().startswith("a file")


@pytest.mark.parametrize("point", ["after-metadata-write", "after-cdi-write"])
async def test_sigkill_mid_prepare_loses_nothing_and_leaves_nothing(kube: Kube, namespace: str, fake_nodes,
                                                                   plugin_agents, driver: str, point: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    node = (await fake_nodes("h100"))["metadata"]["name"]
    first = plugin_agents(node, driver)
    await published_devices(kube, driver, node, 8)
    registered = await first.registered()
    kept = await allocated_claim(kube, namespace, "kept", driver, node, ["gpu-0"])
    crashing = await allocated_claim(kube, namespace, "crashing", driver, node, ["gpu-1"])
    async with DraClient(registered.endpoint) as kubelet:
        assert (await first.prepare(kubelet, [ref(kept)])).claims[kept["metadata"]["uid"]].error == ""
    first.agent.stop()

    monkeypatch.setenv("GPUDRA_FAULT", point)
    doomed = plugin_agents(node, driver, workdir=first.workdir)
    monkeypatch.delenv("GPUDRA_FAULT")
    registered = await doomed.registered()
    async with DraClient(registered.endpoint) as kubelet:
        with pytest.raises(Exception) as failure:  # the connection dies with the agent
            await kubelet.prepare([ref(crashing)], timeout=20)  # never answers: nothing to validate
    assert "UNAVAILABLE" in str(failure.value) or "reset" in str(failure.value).lower()
    assert doomed.agent.process.wait(timeout=10) == -signal.SIGKILL
    uid = crashing["metadata"]["uid"]
    # a plain claim is committed with one write: killed between its device metadata file, then its
    # spec, and that write, it left them with no entry naming them
    metadata = metadata_dir(first.cdi_dir, driver) / f"{uid}_gpu.json"
    assert metadata.is_file() and doomed.spec_path(uid).exists() == (point == "after-cdi-write")
    assert uid not in doomed.checkpoint()
    assert doomed.registration_socket.exists()  # SIGKILL left its sockets behind

    restarted = plugin_agents(node, driver, workdir=first.workdir)
    registered = await restarted.registered()
    assert not doomed.registration_socket.exists() and not doomed.dra_socket.exists()  # stale: removed
    assert not restarted.spec_path(uid).exists() and not metadata.exists()  # orphans: removed at start
    assert restarted.checkpoint() == {kept["metadata"]["uid"]: "PrepareCompleted"}  # nothing lost
    async with DraClient(registered.endpoint, "v1beta1") as kubelet:
        response = await restarted.prepare(kubelet, [ref(crashing), ref(kept)])
    assert {u: r.error for u, r in response.claims.items()} == {uid: "", kept["metadata"]["uid"]: ""}
    assert sorted(os.listdir(restarted.cdi_dir)) == sorted(
        [restarted.spec_path(uid).name, restarted.spec_path(kept["metadata"]["uid"]).name, metadata.parent.name])
    assert metadata.is_file()


async def test_overlapping_instances_share_state_and_serialise(kube: Kube, namespace: str, fake_nodes,
                                                              plugin_agents, driver: str) -> None:
    """A DaemonSet rolling update: two agents on one node, unique sockets, one lock, one checkpoint."""
    node = (await fake_nodes("h100"))["metadata"]["name"]
    old = plugin_agents(node, driver)
    await published_devices(kube, driver, node, 8)
    old_reg = await old.registered()
    new = plugin_agents(node, driver, workdir=old.workdir)
    new_reg = await new.registered()
    assert old_reg.endpoint != new_reg.endpoint and old.registration_socket.exists()

    claim = await allocated_claim(kube, namespace, "c", driver, node, ["gpu-4"])
    rivals = [await allocated_claim(kube, namespace, f"r{i}", driver, node, ["gpu-5"]) for i in range(6)]
    async with DraClient(old_reg.endpoint) as via_old, DraClient(new_reg.endpoint, "v1beta1") as via_new:
        assert (await old.prepare(via_old, [ref(claim)])).claims[claim["metadata"]["uid"]].error == ""
        assert (await via_new.unprepare([ref(claim)])).claims[claim["metadata"]["uid"]].error == ""  # stateless
        assert not new.spec_path(claim["metadata"]["uid"]).exists()
        # Six claims for the same GPU, raced through both instances: exactly one gets it.
        responses = await asyncio.gather(*(
            new.prepare(via_old if i % 2 else via_new, [ref(r)]) for i, r in enumerate(rivals)))
        winners = [r["metadata"]["uid"] for r, resp in zip(rivals, responses)
                   if resp.claims[r["metadata"]["uid"]].error == ""]
        assert len(winners) == 1, [resp for resp in responses]
        assert new.checkpoint() == {winners[0]: "PrepareCompleted"}
        assert [p.name for p in new.cdi_dir.iterdir() if p.is_file()] == [new.spec_path(winners[0]).name]

    assert old.agent.stop() == 0  # SIGTERM: its own sockets go, the new instance's stay
    assert not old.registration_socket.exists() and not old.dra_socket.exists()
    assert new.registration_socket.is_socket() and new.dra_socket.is_socket()
    async with DraClient(new_reg.endpoint) as kubelet:
        winner = next(r for r in rivals if r["metadata"]["uid"] == winners[0])
        assert (await kubelet.unprepare([ref(winner)])).claims[winners[0]].error == ""
    assert json.loads((new.workdir / "kubelet" / "plugins" / driver / "checkpoint.json").read_text())["claims"] == {}



async def test_a_live_instance_rolls_back_what_a_sigkilled_peer_left_half_done(
        kube: Kube, namespace: str, fake_nodes, plugin_agents, driver: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rolling update where the old instance is SIGKILLed mid-prepare of a plain claim (one
    write: its spec, not yet its commit): the new one, already running, serves on, removes the
    orphan spec at its next unprepare, and prepares the claim when the kubelet retries; nothing
    waits for a restart. (Claims with side effects: PrepareStarted, rolled back at the next call,
    test_time_slicing_is_set_on_the_gpu_undone_after_a_crash_and_reset_by_the_last_unprepare.)"""
    node = (await fake_nodes("h100"))["metadata"]["name"]
    monkeypatch.setenv("GPUDRA_FAULT", "after-cdi-write")
    doomed = plugin_agents(node, driver)
    monkeypatch.delenv("GPUDRA_FAULT")
    await published_devices(kube, driver, node, 8)
    doomed_reg = await doomed.registered()
    live = plugin_agents(node, driver, workdir=doomed.workdir)
    live_reg = await live.registered()
    crashing = await allocated_claim(kube, namespace, "crashing", driver, node, ["gpu-2"])
    other = await allocated_claim(kube, namespace, "other", driver, node, ["gpu-3"])
    uid = crashing["metadata"]["uid"]
    async with DraClient(doomed_reg.endpoint) as kubelet:
        with pytest.raises(Exception):  # the connection dies with the agent
            await kubelet.prepare([ref(crashing)], timeout=20)
    assert doomed.agent.process.wait(timeout=10) == -signal.SIGKILL
    assert live.spec_path(uid).exists() and live.checkpoint() == {}  # the spec, no entry naming it

    other_uid = other["metadata"]["uid"]
    async with DraClient(live_reg.endpoint, "v1beta1") as kubelet:
        assert (await live.prepare(kubelet, [ref(other)])).claims[other_uid].error == ""
        assert live.checkpoint() == {other_uid: "PrepareCompleted"}
        assert (await kubelet.unprepare([ref(other)])).claims[other_uid].error == ""
        assert not live.spec_path(uid).exists()  # the orphan went with the live instance's unprepare
        # the kubelet, which got no answer, retries through the live instance
        assert (await live.prepare(kubelet, [ref(crashing)])).claims[uid].error == ""
    assert live.checkpoint() == {uid: "PrepareCompleted"}


async def test_a_checkpoint_of_a_newer_agent_stops_the_agent_with_one_clear_line(fake_nodes, plugin_agents,
                                                                                driver: str, tmp_path: Path) -> None:
    """A downgrade with claims prepared by a newer agent: refused, not silently rewritten."""
    node = (await fake_nodes("h100"))["metadata"]["name"]
    plugin_dir = tmp_path / node / "kubelet" / "plugins" / driver
    plugin_dir.mkdir(parents=True)
    (plugin_dir / CHECKPOINT_FILE).write_text(json.dumps({"version": 99, "bootID": "x", "claims": {}}))
    plugin = plugin_agents(node, driver)
    assert plugin.agent.process.wait(timeout=30) == 1
    errors = [line for line in plugin.agent.log_tail().splitlines() if "cannot start" in line]
    assert len(errors) == 1 and "version 99" in errors[0], plugin.agent.log_tail()
    assert "Traceback" not in plugin.agent.log_tail()
    assert json.loads((plugin_dir / CHECKPOINT_FILE).read_text())["version"] == 99  # left as it was

async def test_ready_file_appears_once_registered_and_published(kube: Kube, fake_nodes, plugin_agents,
                                                                driver: str, tmp_path: Path) -> None:
    """What the DaemonSet's readiness probe tests: not before the kubelet registered the plugin."""
    node = (await fake_nodes("ready"))["metadata"]["name"]
    ready = tmp_path / "ready"
    plugin = plugin_agents(node, driver, extra_args=("--ready-file", str(ready)))
    await published_devices(kube, driver, node, 8)
    await wait_for(lambda: _is_socket(plugin.registration_socket), timeout=30, what="the registration socket")
    assert not ready.exists()  # published, but no kubelet has registered it yet
    await plugin.registered()
    await wait_for(lambda: _exists(ready), timeout=10, what=f"{ready} after registration")

    # The kubelet takes the registration back (NotifyRegistrationStatus, not registered): the pod
    # turns unready until the plugin is registered again.
    await _refuse_registration(plugin.registration_socket)
    await wait_for(lambda: _gone(ready), timeout=10, what=f"{ready} removed once the registration is lost")
    await plugin.registered()
    await wait_for(lambda: _exists(ready), timeout=10, what=f"{ready} back after registering again")
    assert plugin.agent.stop() == 0
    assert not ready.exists()  # a stopping agent is no longer ready


async def _refuse_registration(registration_socket: Path) -> None:
    from gpudra_driver.plugin.gen import pluginregistration_pb2, pluginregistration_pb2_grpc
    from gpudra_driver.plugin.sockets import SocketAddress

    with SocketAddress(registration_socket) as address:
        async with grpc.aio.insecure_channel(address.target) as channel:
            stub = pluginregistration_pb2_grpc.RegistrationStub(channel)
            status = pluginregistration_pb2.RegistrationStatus(plugin_registered=False, error="deregistered")
            with contextlib.suppress(grpc.aio.AioRpcError):  # the plugin answers a refusal with an error
                await stub.NotifyRegistrationStatus(status, timeout=5)


async def _gone(path: Path) -> bool:
    return not path.exists()


async def _is_socket(path: Path) -> bool:
    return path.is_socket()


async def _exists(path: Path) -> bool:
    return path.exists()


async def test_liveness_probe_passes_while_the_kubelet_can_reach_the_agent(kube: Kube, fake_nodes, plugin_agents,
                                                                          driver: str) -> None:
    """What the DaemonSet's startup and liveness probes ask: SERVING from start-up on, NOT_SERVING
    once the registration socket is removed from under the agent (the kubelet then has no way to
    it but a restart), with the reason in the agent's log."""
    from grpc_health.v1 import health_pb2

    node = (await fake_nodes("alive"))["metadata"]["name"]
    port = free_port()
    plugin = plugin_agents(node, driver, extra_args=("--health-port", str(port)))

    async def serving() -> bool:
        assert plugin.agent.process.poll() is None, plugin.agent.log_tail()
        try:
            return await probe_health(port) == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            return False  # not listening yet: the startup probe's case

    await wait_for(serving, timeout=30, what=f"the agent's health service on port {port}")
    await plugin.registered()
    assert await probe_health(port) == health_pb2.HealthCheckResponse.SERVING
    plugin.registration_socket.unlink()
    assert await probe_health(port) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert "liveness check failed" in plugin.agent.log_tail() and "is gone" in plugin.agent.log_tail()
    assert plugin.agent.stop() == 0


async def test_the_agent_stays_within_its_memory_budget_as_deployed(kube: Kube, namespace: str, fake_nodes,
                                                                    plugin_agents, driver: str) -> None:
    """docs/agent.md, "Footprint": at most 100 MiB VmRSS with metrics and health served, after it has
    prepared claims, in the DaemonSet's process env (PYTHONOPTIMIZE=2 among it). bench/agent_footprint.py
    weighs each setting; this keeps a growing agent from leaving the budget unnoticed."""
    from grpc_health.v1 import health_pb2

    node = (await fake_nodes("footprint"))["metadata"]["name"]
    health = free_port()
    plugin = plugin_agents(node, driver, extra_args=("--metrics-port", str(free_port()), "--health-port", str(health)))
    await published_devices(kube, driver, node, 8)
    registered = await plugin.registered()
    claims = [await allocated_claim(kube, namespace, f"fp-{i}", driver, node, [f"gpu-{i}"]) for i in range(8)]
    async with DraClient(registered.endpoint, registered.version) as kubelet:
        for claim in claims:  # one at a time, then all at once (a batch), as bench/agent_footprint.py does
            assert (await plugin.prepare(kubelet, [ref(claim)])).claims[claim["metadata"]["uid"]].error == ""
            await kubelet.unprepare([ref(claim)])
        answers = await asyncio.gather(*(plugin.prepare(kubelet, [ref(claim)]) for claim in claims))
        assert all(r.error == "" for answer in answers for r in answer.claims.values())
        await kubelet.unprepare([ref(claim) for claim in claims])
    assert await probe_health(health) == health_pb2.HealthCheckResponse.SERVING
    rss_mib = plugin.agent.rss_mib()
    assert rss_mib <= AGENT_RSS_BUDGET_MIB, (f"the agent takes {rss_mib:.1f} MiB as deployed (budget "
                                             f"{AGENT_RSS_BUDGET_MIB} MiB; make bench BENCH_ARGS=agent_footprint)")
    assert plugin.agent.stop() == 0


async def test_a_health_port_in_use_stops_the_agent_with_one_clear_line(fake_nodes, plugin_agents,
                                                                       driver: str) -> None:
    node = (await fake_nodes("busy-port"))["metadata"]["name"]
    with socket.socket() as holder:
        # as another gRPC server holds a port (gRPC sets SO_REUSEPORT): the agent must not share it
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        port = holder.getsockname()[1]
        plugin = plugin_agents(node, driver, extra_args=("--health-port", str(port)))
        assert plugin.agent.process.wait(timeout=30) == 1
    errors = [line for line in plugin.agent.log_tail().splitlines() if "cannot serve the health check" in line]
    assert len(errors) == 1 and str(port) in errors[0], plugin.agent.log_tail()
    assert "Traceback" not in plugin.agent.log_tail()
    assert not plugin.dra_socket.exists()  # it stopped cleanly: its sockets are gone


async def test_the_agent_on_uvloop_registers_prepares_and_unprepares(kube: Kube, namespace: str, fake_nodes,
                                                                     plugin_agents, driver: str) -> None:
    """The opt-in event loop (``--event-loop uvloop``): the same gRPC servers, claim GETs and
    checkpoint writes, on libuv."""
    node = (await fake_nodes("uvloop"))["metadata"]["name"]
    plugin = plugin_agents(node, driver, extra_args=("--event-loop", "uvloop"))
    await published_devices(kube, driver, node, 8)
    registered = await plugin.registered()
    claim = await allocated_claim(kube, namespace, "on-uvloop", driver, node, ["gpu-4"])
    async with DraClient(registered.endpoint, registered.version) as kubelet:
        response = await plugin.prepare(kubelet, [ref(claim)])
        (device,) = response.claims[claim["metadata"]["uid"]].devices
        assert device.device_name == "gpu-4" and response.claims[claim["metadata"]["uid"]].error == ""
        assert plugin.checkpoint() == {claim["metadata"]["uid"]: "PrepareCompleted"}
        unprepared = await kubelet.unprepare([ref(claim)])
        assert unprepared.claims[claim["metadata"]["uid"]].error == ""
    assert plugin.checkpoint() == {} and not plugin.spec_path(claim["metadata"]["uid"]).exists()
    # what it ran on, read off the running loop
    assert "event loop uvloop, Python optimization level 2" in plugin.agent.log_path.read_text()
    assert plugin.agent.stop() == 0


async def test_a_claim_deleted_behind_the_agents_back_is_released_by_the_sweep(
        kube: Kube, namespace: str, fake_nodes, plugin_agents, driver: str) -> None:
    """The review's leak: a prepared claim is deleted while its unprepare never comes (the
    kubelet's state lost, the node away). The scheduler sees gpu-2 free and allocates it to a new
    claim; the agent refuses it ("already prepared") until its checkpoint sweep finds the old claim
    gone and releases it, with a Node event. Then the same prepare succeeds."""
    node = (await fake_nodes("leak"))["metadata"]["name"]
    plugin = plugin_agents(node, driver, extra_args=("--checkpoint-sweep-interval", "1"))
    await published_devices(kube, driver, node, 8)
    registered = await plugin.registered()
    old = await allocated_claim(kube, namespace, "leaked", driver, node, ["gpu-2"])
    async with DraClient(registered.endpoint, registered.version) as kubelet:
        first = await plugin.prepare(kubelet, [ref(old)])
        assert first.claims[old["metadata"]["uid"]].error == ""
        await kube.delete(CLAIM, "leaked", namespace)  # no unprepare ever reaches the agent
        new = await allocated_claim(kube, namespace, "leaked", driver, node, ["gpu-2"])  # same name, new UID

        async def released() -> Obj | None:
            events = [e for e in await events_about(kube, node) if e.get("reason") == "LeakedClaimReleased"]
            return events[0] if events else None

        event = await wait_for(released, timeout=30, what="the sweep to release the deleted claim")
        assert f"UID {old['metadata']['uid']}" in event["message"] and "gpu-2" in event["message"]
        assert "re-created" in event["message"]
        again = await plugin.prepare(kubelet, [ref(new)])
        assert again.claims[new["metadata"]["uid"]].error == ""
        assert plugin.checkpoint() == {new["metadata"]["uid"]: "PrepareCompleted"}
        assert not plugin.spec_path(old["metadata"]["uid"]).exists()


async def test_a_checkpoint_corrupted_under_the_running_agent_is_recovered_and_its_adopted_claims_swept(
        kube: Kube, namespace: str, fake_nodes, plugin_agents, driver: str) -> None:
    """A disk fault (or a hand edit) corrupts the checkpoint while the agent serves. The next call
    sets it aside and adopts the CDI specs, as a start would, with no restart: prepare and
    unprepare go on. An adopted claim deleted while its unprepare never comes is found by the sweep
    under the name the agent knew it by, and its GPU freed."""
    node = (await fake_nodes("corrupt"))["metadata"]["name"]
    plugin = plugin_agents(node, driver, extra_args=("--checkpoint-sweep-interval", "1"))
    await published_devices(kube, driver, node, 8)
    registered = await plugin.registered()
    kept = await allocated_claim(kube, namespace, "kept", driver, node, ["gpu-2"])
    leaked = await allocated_claim(kube, namespace, "leaked", driver, node, ["gpu-3"])
    path = plugin.workdir / "kubelet" / "plugins" / driver / CHECKPOINT_FILE
    async with DraClient(registered.endpoint, registered.version) as kubelet:
        first = await plugin.prepare(kubelet, [ref(kept), ref(leaked)])
        assert all(c.error == "" for c in first.claims.values())
        path.write_bytes(path.read_bytes().replace(b'"PrepareCompleted"', b'"PrepareCompletex"', 1))

        fresh = await allocated_claim(kube, namespace, "fresh", driver, node, ["gpu-4"])
        again = await plugin.prepare(kubelet, [ref(fresh)])
        assert again.claims[fresh["metadata"]["uid"]].error == ""
        assert plugin.agent.process.poll() is None  # no restart
        assert plugin.checkpoint() == {fresh["metadata"]["uid"]: "PrepareCompleted"}
        doc = json.loads(path.read_bytes())
        assert set(doc["adopted"]) == {kept["metadata"]["uid"], leaked["metadata"]["uid"]}
        assert any(n.startswith(f"{CHECKPOINT_FILE}.corrupt-") for n in os.listdir(path.parent))
        taken = await allocated_claim(kube, namespace, "taken", driver, node, ["gpu-2"])
        refused = await plugin.prepare(kubelet, [ref(taken)])
        assert f"already prepared for claim {kept['metadata']['uid']}" in refused.claims[taken["metadata"]["uid"]].error

        unprepared = await kubelet.unprepare([ref(kept)])
        assert unprepared.claims[kept["metadata"]["uid"]].error == ""
        assert not plugin.spec_path(kept["metadata"]["uid"]).exists()

        await kube.delete(CLAIM, "leaked", namespace)  # its unprepare never reaches the agent

        async def released() -> Obj | None:
            events = [e for e in await events_about(kube, node) if e.get("reason") == "LeakedClaimReleased"]
            return events[0] if events else None

        event = await wait_for(released, timeout=30, what="the sweep to release the adopted, deleted claim")
        assert f"UID {leaked['metadata']['uid']}" in event["message"] and "gpu-3" in event["message"]
        assert not plugin.spec_path(leaked["metadata"]["uid"]).exists()
        reuse = await allocated_claim(kube, namespace, "reuse", driver, node, ["gpu-3"])
        freed = await plugin.prepare(kubelet, [ref(reuse)])
        assert freed.claims[reuse["metadata"]["uid"]].error == ""
        assert "adopted" not in json.loads(path.read_bytes())


def time_slicing(driver: str, interval: str) -> list[Obj]:
    return [{"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": driver, "parameters": {
        "apiVersion": "gpudra.io/v1alpha1", "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": interval}}}}}]


async def test_time_slicing_is_set_on_the_gpu_undone_after_a_crash_and_reset_by_the_last_unprepare(
        kube: Kube, namespace: str, fake_nodes, plugin_agents, driver: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The real pynvml against the mock libnvidia-ml and the driver root's mock nvidia-smi, which
    record every change they make (localcluster/mockstate.py)."""
    from gpudra_dev.localcluster import mockstate
    from gpudra_dev.localcluster.fakedriverroot import make_driver_root

    node = (await fake_nodes("h100"))["metadata"]["name"]
    root = make_driver_root(tmp_path / "driver-root", "dgx-h100")
    first = plugin_agents(node, driver, nvml="mock:dgx-h100", driver_root=root)
    devices = await published_devices(kube, driver, node, 8)
    uuid_of = {name: d["attributes"]["uuid"]["string"] for name, d in devices.items()}
    smi = root / "usr/bin/nvidia-smi"
    subprocess.run([str(smi), "-i", uuid_of["gpu-2"], "-c", "EXCLUSIVE_PROCESS"], check=True, capture_output=True)
    registered = await first.registered()
    sliced = await allocated_claim(kube, namespace, "sliced", driver, node, ["gpu-2"],
                                   config=time_slicing(driver, "Long"))
    async with DraClient(registered.endpoint) as kubelet:
        response = await first.prepare(kubelet, [ref(sliced)])
    assert response.claims[sliced["metadata"]["uid"]].error == ""
    assert (mockstate.compute_mode(root, uuid_of["gpu-2"]), mockstate.timeslice(root, uuid_of["gpu-2"])) == (0, 3)
    assert mockstate.calls(root)[-2:] == [f"nvml SetComputeMode {uuid_of['gpu-2']} 0",
                                          f"nvidia-smi compute-policy {uuid_of['gpu-2']} --set-timeslice 3"]
    first.agent.stop()

    # Killed after setting its GPU, before the commit: the next start puts the GPU back.
    monkeypatch.setenv("GPUDRA_FAULT", "after-cdi-write")
    doomed = plugin_agents(node, driver, nvml="mock:dgx-h100", driver_root=root, workdir=first.workdir)
    monkeypatch.delenv("GPUDRA_FAULT")
    crashing = await allocated_claim(kube, namespace, "crashing", driver, node, ["gpu-5"],
                                     config=time_slicing(driver, "Medium"))
    async with DraClient((await doomed.registered()).endpoint) as kubelet:
        with pytest.raises(Exception):  # the connection dies with the agent
            await kubelet.prepare([ref(crashing)], timeout=20)
    assert doomed.agent.process.wait(timeout=10) == -signal.SIGKILL
    assert mockstate.timeslice(root, uuid_of["gpu-5"]) == 2  # set, then the crash
    restarted = plugin_agents(node, driver, nvml="mock:dgx-h100", driver_root=root, workdir=first.workdir)
    registered = await restarted.registered()
    assert mockstate.timeslice(root, uuid_of["gpu-5"]) == 0  # rolled back at start
    assert mockstate.timeslice(root, uuid_of["gpu-2"]) == 3  # the prepared claim's GPU kept as it is

    async with DraClient(registered.endpoint) as kubelet:
        assert (await kubelet.unprepare([ref(sliced)])).claims[sliced["metadata"]["uid"]].error == ""
    assert mockstate.timeslice(root, uuid_of["gpu-2"]) == 0  # the last claim on it gone: default again

