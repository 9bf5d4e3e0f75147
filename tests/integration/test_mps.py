"""MPS sharing at the real boundary: the agent and the MPS supervisor as processes of one node, the
real pynvml against the mock libnvidia-ml, and the driver root's mock nvidia-cuda-mps-control, a
real daemon that records what it is told (localcluster/mockstate.py). Claims are written into the
real API server and prepared over the kubelet's gRPC API."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from seedobjects import published_devices
from test_kubelet_plugin import PluginAgent, allocated_claim, driver, plugin_agents, ref  # noqa: F401 (fixtures)

from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_dev.kubelet_client import DraClient
from gpudra_driver.plugin.sharing.mps.apply import MpsDaemons, MpsUnavailable
from gpudra_core.quantity import parse_quantity
from gpudra_dev.localcluster import mockstate
from gpudra_dev.localcluster.agents import AgentProcess, start_mps_supervisor
from gpudra_dev.localcluster.fakedriverroot import make_driver_root
from gpudra_dev.localcluster.objects import events_about
from gpudra_dev.localcluster.waiting import wait_for

EXCLUSIVE_PROCESS = 3
CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")


def mps_config(driver: str, **mps: Any) -> list[Obj]:
    return [{"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": driver, "parameters": {
        "apiVersion": "gpudra.io/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "MPS", "mps": mps}}}}]


@pytest.fixture
def driver_root(tmp_path: Path) -> Iterator[Path]:
    root = make_driver_root(tmp_path / "driver-root", "dgx-h100")
    yield root
    mockstate.kill_mps_daemons(root)  # they outlive the supervisor by design


def supervisor(plugin: PluginAgent, root: Path) -> AgentProcess:
    return start_mps_supervisor(plugin_dir=plugin.workdir / "kubelet" / "plugins" / plugin.driver, driver_root=root,
                                workdir=plugin.workdir)


def daemons_of(root: Path, claim_uid: str) -> list[mockstate.MpsDaemon]:
    return [d for d in mockstate.mps_daemons(root) if d.pipe_dir.parent.name == claim_uid]


async def test_an_mps_claim_gets_its_own_daemon_that_outlives_the_agent_and_goes_with_the_claim(
        kube: Kube, namespace: str, fake_nodes, plugin_agents, driver: str, driver_root: Path) -> None:
    node = (await fake_nodes("h100"))["metadata"]["name"]
    first = plugin_agents(node, driver, nvml="mock:dgx-h100", driver_root=driver_root)
    mps_supervisor = supervisor(first, driver_root)
    devices = await published_devices(kube, driver, node, 8)
    uuid_of = {name: d["attributes"]["uuid"]["string"] for name, d in devices.items()}
    claim = await allocated_claim(kube, namespace, "mps", driver, node, ["gpu-1", "gpu-3"], config=mps_config(
        driver, activeThreadPercentage=40, pinnedMemoryLimit="8Gi", perDevice={"gpu-3": {"pinnedMemoryLimit": "16Gi"}}))
    uid = claim["metadata"]["uid"]
    async with DraClient((await first.registered()).endpoint) as kubelet:
        response = await first.prepare(kubelet, [ref(claim)])  # the CDI spec validated too
    assert response.claims[uid].error == ""

    [daemon] = daemons_of(driver_root, uid)
    assert set(daemon.serves) == {uuid_of["gpu-1"], uuid_of["gpu-3"]}  # only the claim's GPUs
    pipe = daemon.pipe_dir
    assert sorted(mockstate.calls(driver_root, "mps-control")[-3:]) == sorted([
        f"mps-control {pipe} set_default_active_thread_percentage 40",
        f"mps-control {pipe} set_default_device_pinned_mem_limit {uuid_of['gpu-1']} 8192M",
        f"mps-control {pipe} set_default_device_pinned_mem_limit {uuid_of['gpu-3']} 16384M"])
    assert {mockstate.compute_mode(driver_root, uuid_of[g]) for g in ("gpu-1", "gpu-3")} == {EXCLUSIVE_PROCESS}
    # What holds: a process of the claim that ignores the pipe directory gets no context of its own
    # on the claim's whole GPU (EXCLUSIVE_PROCESS, the claim's server holds it); through the pipe
    # directory, the daemon's limits. A GPU no MPS claim holds is another process's to open.
    bypass = cuda_context(driver_root, uuid_of["gpu-1"], pipe_dir=None)
    assert (bypass.returncode, bypass.stdout) == (2, "busy\n"), bypass
    assert "busy or unavailable" in bypass.stderr
    assert cuda_context(driver_root, uuid_of["gpu-3"], pipe_dir=pipe).stdout == "mps 40.0 16384M\n"
    assert cuda_context(driver_root, uuid_of["gpu-2"], pipe_dir=None).stdout == "direct unlimited\n"
    spec = json.loads(first.spec_path(uid).read_text())
    assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in spec["containerEdits"]["env"]
    mounts = {m["containerPath"]: m["hostPath"] for m in spec["containerEdits"]["mounts"]}
    assert mounts["/tmp/nvidia-mps"] == str(pipe) and mounts["/dev/shm"] == str(pipe.parent / "shm")

    # The agent goes (a restart, a rolling update): the daemon stays, and a new agent answers again.
    first.agent.stop()
    second = plugin_agents(node, driver, nvml="mock:dgx-h100", driver_root=driver_root, workdir=first.workdir)
    async with DraClient((await second.registered()).endpoint) as kubelet:
        again = await second.prepare(kubelet, [ref(claim)])
        assert again.claims[uid].error == ""
        assert [d.pid for d in daemons_of(driver_root, uid)] == [daemon.pid]

        # The daemon dies: the supervisor starts it again with its limits; the agent reports it.
        os.kill(daemon.pid, signal.SIGKILL)
        assert mockstate.wait_exited(daemon.pid, 10)

        async def restarted() -> bool:
            return [d.pid for d in daemons_of(driver_root, uid)] not in ([], [daemon.pid])

        await wait_for(restarted, timeout=20, what="the supervisor to start the claim's daemon again")
        [replacement] = daemons_of(driver_root, uid)
        await wait_for(lambda: _limits_set(driver_root, replacement.pipe_dir, 2), timeout=10,
                       what="the limits set on the restarted daemon")

        async def reported() -> list[Obj]:
            return [e for e in await events_about(kube, node) if e["reason"] == "MPSDaemonRestarted"]

        [event] = await wait_for(reported, timeout=20, what="an MPSDaemonRestarted event on the node")
        assert f"{namespace}/mps" in event["message"] and event["type"] == "Warning"

        # The supervisor itself restarts: it adopts the running daemon rather than start another.
        mps_supervisor.stop(signal.SIGKILL)
        supervisor(second, driver_root)
        await wait_for(lambda: _adopted(pipe.parent.parent, uid, replacement.pid), timeout=20,
                       what="the new supervisor to answer, with the claim's daemon adopted")
        assert [d.pid for d in daemons_of(driver_root, uid)] == [replacement.pid]

        # The last unprepare: the daemon is killed, its directory goes, the GPUs are DEFAULT again.
        assert (await kubelet.unprepare([ref(claim)])).claims[uid].error == ""
    assert daemons_of(driver_root, uid) == [] and not pipe.parent.exists()
    assert {mockstate.compute_mode(driver_root, uuid_of[g]) for g in ("gpu-1", "gpu-3")} == {0}


def cuda_context(root: Path, uuid: str, *, pipe_dir: Path | None) -> subprocess.CompletedProcess[str]:
    """A CUDA process of the claim opening a context on ``uuid`` (the mock's --mock-cuda-context):
    through the daemon on ``pipe_dir``, or, with None, ignoring MPS (an empty pipe directory)."""
    empty = root / "run" / "no-mps-here"
    empty.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir or empty)}
    return subprocess.run([str(root / mockstate.MPS_CONTROL), "--mock-cuda-context", uuid], env=env,
                          capture_output=True, text=True, timeout=20)


async def _limits_set(root: Path, pipe: Path, times: int) -> bool:
    calls = mockstate.calls(root, "mps-control")
    return calls.count(f"mps-control {pipe} set_default_active_thread_percentage 40") >= times


async def _adopted(mps_root: Path, uid: str, pid: int) -> bool:
    try:
        # Naming the claim waits for its pass: a supervisor just started answers a sync that
        # names none before its first pass over the claims has reported anything.
        statuses = await asyncio.to_thread(MpsDaemons(mps_root, timeout=5).sync, [uid])
    except MpsUnavailable:  # not listening yet
        return False
    status = statuses.get(uid) or {}
    return status.get("state") == "Ready" and status.get("pid") == pid


async def test_sigkill_mid_prepare_of_an_mps_claim_leaks_no_daemon_and_restores_the_gpu(
        kube: Kube, namespace: str, fake_nodes, plugin_agents, driver: str, driver_root: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    node = (await fake_nodes("h100"))["metadata"]["name"]
    monkeypatch.setenv("GPUDRA_FAULT", "after-cdi-write")  # the daemon running, the commit not written
    doomed = plugin_agents(node, driver, nvml="mock:dgx-h100", driver_root=driver_root)
    monkeypatch.delenv("GPUDRA_FAULT")
    supervisor(doomed, driver_root)
    devices = await published_devices(kube, driver, node, 8)
    gpu = devices["gpu-4"]["attributes"]["uuid"]["string"]
    claim = await allocated_claim(kube, namespace, "crashing", driver, node, ["gpu-4"],
                                  config=mps_config(driver, activeThreadPercentage=25))
    uid = claim["metadata"]["uid"]
    async with DraClient((await doomed.registered()).endpoint) as kubelet:
        with pytest.raises(Exception):  # the connection dies with the agent
            await kubelet.prepare([ref(claim)], timeout=20)
    assert doomed.agent.process.wait(timeout=10) == -signal.SIGKILL
    assert len(daemons_of(driver_root, uid)) == 1 and mockstate.compute_mode(driver_root, gpu) == EXCLUSIVE_PROCESS

    restarted = plugin_agents(node, driver, nvml="mock:dgx-h100", driver_root=driver_root, workdir=doomed.workdir)
    registered = await restarted.registered()
    assert daemons_of(driver_root, uid) == []  # start-up rolled the prepare back: its daemon stopped
    assert mockstate.compute_mode(driver_root, gpu) == 0
    async with DraClient(registered.endpoint) as kubelet:
        assert (await restarted.prepare(kubelet, [ref(claim)])).claims[uid].error == ""
        assert len(daemons_of(driver_root, uid)) == 1
        assert (await kubelet.unprepare([ref(claim)])).claims[uid].error == ""
    assert daemons_of(driver_root, uid) == [] and mockstate.compute_mode(driver_root, gpu) == 0


async def test_mps_refusals_name_the_reason_and_change_nothing_on_the_gpu(
        kube: Kube, namespace: str, fake_nodes, plugin_agents, driver: str, driver_root: Path) -> None:
    node = (await fake_nodes("h100"))["metadata"]["name"]
    plugin = plugin_agents(node, driver, nvml="mock:dgx-h100", driver_root=driver_root)
    devices = await published_devices(kube, driver, node, 8)
    gpu = devices["gpu-2"]["attributes"]["uuid"]["string"]
    too_much = await allocated_claim(kube, namespace, "too-much", driver, node, ["gpu-2"],
                                     config=mps_config(driver, pinnedMemoryLimit="1Ti"))
    no_supervisor = await allocated_claim(kube, namespace, "no-supervisor", driver, node, ["gpu-2"],
                                          config=mps_config(driver))
    async with DraClient((await plugin.registered()).endpoint) as kubelet:
        first = await plugin.prepare(kubelet, [ref(too_much)])
        second = await plugin.prepare(kubelet, [ref(no_supervisor)])
    error = first.claims[too_much["metadata"]["uid"]].error
    assert "sharing.mps.pinnedMemoryLimit: 1Ti is more than device gpu-2's memory" in error
    error = second.claims[no_supervisor["metadata"]["uid"]].error
    assert "the MPS supervisor is not running on this node" in error
    assert mockstate.compute_mode(driver_root, gpu) == 0  # set for the daemon, then put back
    assert mockstate.mps_daemons(driver_root) == [] and plugin.checkpoint() == {}


async def test_an_mps_claims_dev_shm_is_the_size_it_asks_for_within_the_platforms_bound(
        kube: Kube, namespace: str, fake_nodes, plugin_agents, driver: str, driver_root: Path) -> None:
    node = (await fake_nodes("h100"))["metadata"]["name"]
    plugin = plugin_agents(node, driver, nvml="mock:dgx-h100", driver_root=driver_root)
    supervisor(plugin, driver_root)  # the defaults: 64Mi unless a claim asks, at most 1Gi
    devices = await published_devices(kube, driver, node, 8)
    gpu = devices["gpu-6"]["attributes"]["uuid"]["string"]
    sized = await allocated_claim(kube, namespace, "sized", driver, node, ["gpu-5"],
                                  config=mps_config(driver, shmSize="256Mi"))
    too_big = await allocated_claim(kube, namespace, "too-big", driver, node, ["gpu-6"],
                                    config=mps_config(driver, shmSize="2Gi"))
    uid, refused = sized["metadata"]["uid"], too_big["metadata"]["uid"]
    async with DraClient((await plugin.registered()).endpoint) as kubelet:
        response = await plugin.prepare(kubelet, [ref(sized), ref(too_big)])
        assert response.claims[uid].error == ""
        error = response.claims[refused].error
        assert "sharing.mps.shmSize: 2Gi is more than 1Gi" in error and "spec.sharing.mps.maxShmSize" in error
        [daemon] = daemons_of(driver_root, uid)
        shm = daemon.pipe_dir.parent / "shm"
        [mount] = [line.split() for line in Path("/proc/self/mountinfo").read_text().splitlines()
                   if line.split()[4] == str(shm)]
        assert mount[mount.index("-") + 1] == "tmpfs" and f"size={256 * 1024}k" in mount[-1], mount
        # the refused claim: no daemon, no directory, its GPU put back, not in the checkpoint
        assert daemons_of(driver_root, refused) == [] and not (shm.parent.parent / refused).exists()
        assert mockstate.compute_mode(driver_root, gpu) == 0 and refused not in plugin.checkpoint()
        assert (await kubelet.unprepare([ref(sized)])).claims[uid].error == ""
    assert not shm.parent.exists() and str(shm) not in Path("/proc/self/mountinfo").read_text()


async def test_mps_claims_sharing_a_gpu_by_consumable_capacity_get_what_the_scheduler_granted_as_limits(
        kube: Kube, namespace: str, fake_nodes, plugin_agents, driver: str, tmp_path: Path) -> None:
    """Beyond NVIDIA's driver (which refuses MPS with consumable capacity): the real scheduler packs
    two MPS claims onto one GPU by memory, and each gets a daemon of its own held to its grant."""
    from test_consumable_capacity import allocated, claim, minor_version

    if await minor_version(kube) < 36:  # DRAConsumableCapacity is off: 1.36 and 1.37 run the rest
        stored = await kube.create(claim(f"dropped-{os.urandom(3).hex()}", namespace, "any-class", "10Gi"))
        assert "capacity" not in stored["spec"]["devices"]["requests"][0]["exactly"], stored["spec"]
        return
    root = make_driver_root(tmp_path / "driver-root", "dgx-h100")
    try:
        node = (await fake_nodes("mps-cc"))["metadata"]["name"]
        plugin = plugin_agents(node, driver, nvml="mock:dgx-h100", driver_root=root,
                               extra_args=("--consumable-memory-step", "1Gi"))
        supervisor(plugin, root)
        devices = await published_devices(kube, driver, node, 8)
        gpu = devices["gpu-0"]["attributes"]["uuid"]["string"]
        only_gpu_0 = f'device.driver == "{driver}" && device.attributes["{driver}"].uuid == "{gpu}"'
        await kube.create({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": driver},
                           "spec": {"selectors": [{"cel": {"expression": only_gpu_0}}],
                                    "config": [{"opaque": mps_config(driver)[0]["opaque"]}]}})
        small, large = claim("small", namespace, driver, "20Gi"), claim("large", namespace, driver, "40Gi")
        results = await allocated(kube, namespace, node, [small, large])
        assert {r["device"] for r in results.values()} == {"gpu-0"}  # packed onto one GPU
        memory = devices["gpu-0"]["capacity"]["memory"]["value"]
        refs = [ref(await kube.get(CLAIM, name, namespace)) for name in ("small", "large")]
        async with DraClient((await plugin.registered()).endpoint) as kubelet:
            response = await plugin.prepare(kubelet, refs)
            assert {u: r.error for u, r in response.claims.items()} == {r[2]: "" for r in refs}
            assert all(r.devices[0].share_id for r in response.claims.values())
            daemons = {uid: daemons_of(root, uid) for _, _, uid in refs}
            assert all(len(d) == 1 and d[0].serves == (gpu,) for d in daemons.values()), daemons
            total = parse_quantity(memory)
            for (_, name, uid), granted in zip(refs, (20, 40)):
                pipe = daemons[uid][0].pipe_dir
                percentage = -(-granted * 2**30 * 100 // int(total))
                assert f"mps-control {pipe} set_default_device_pinned_mem_limit {gpu} {granted * 1024}M" in \
                    mockstate.calls(root, "mps-control"), name
                assert f"mps-control {pipe} set_default_active_thread_percentage {percentage}" in \
                    mockstate.calls(root, "mps-control"), name
            assert mockstate.compute_mode(root, gpu) == 0  # the claims' servers share the GPU
            # so the limits are cooperative: a process that ignores its pipe directory gets a
            # context of its own on the GPU, with no limit (docs/sharing.md says so)
            assert cuda_context(root, gpu, pipe_dir=None).stdout == "direct unlimited\n"
            pipe = daemons[refs[0][2]][0].pipe_dir
            assert cuda_context(root, gpu, pipe_dir=pipe).stdout.startswith("mps ")
            # the GPU is full (its 79Gi in 1Gi steps, 60Gi granted, 20Gi asked): not allocated
            third = await allocated_or_pending(kube, namespace, node, claim("third", namespace, driver, "20Gi"))
            assert third is None
            unprepared = await kubelet.unprepare(refs)
            assert {u: r.error for u, r in unprepared.claims.items()} == {r[2]: "" for r in refs}
        assert mockstate.mps_daemons(root) == []
    finally:
        mockstate.kill_mps_daemons(root)
        await kube.delete(resource_type("resource.k8s.io/v1", "DeviceClass"), driver)


async def allocated_or_pending(kube: Kube, namespace: str, node: str, claim_obj: Obj) -> Obj | None:
    """The claim's allocation once its pod is scheduled, or None once the scheduler says it cannot be."""
    from test_consumable_capacity import run_pod, unschedulable

    name = await run_pod(kube, namespace, node, claim_obj)
    assert "cannot allocate all claims" in await unschedulable(kube, namespace, name)
    return (await kube.get(CLAIM, name, namespace) or {}).get("status", {}).get("allocation")
