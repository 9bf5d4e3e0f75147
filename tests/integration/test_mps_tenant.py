"""The MPS supervisor against a tenant that is root in its containers (docs/sharing.md, "What a
tenant can and cannot do"). A claim's pipe and shm directories are mounted read-write into its
containers, so here the test plays the tenant: it writes into them, plants links, quits the
claim's daemon and runs a daemon of its own, as a root process in a container could.

The supervisor runs as a process (as in its DaemonSet, but in this machine's mount namespace),
driven like the agent drives it (spec files and its socket, :class:`MpsDaemons`), against a fake
driver root's mock ``nvidia-cuda-mps-control``: real daemons, real signals, real tmpfs mounts.
No API server: none of this goes through it, except in the last tests, where the agent drives the
supervisor as on a node (an unprepare waits for the claim's daemon under the agent's node lock)."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from seedobjects import published_devices
from test_kubelet_plugin import allocated_claim, driver, plugin_agents, ref  # noqa: F401 (fixtures)
from test_mps import EXCLUSIVE_PROCESS, mps_config

from gpudra_driver.plugin.sharing.mps import mounts as mpsmounts

from gpudra_driver.plugin.sharing.mps import supervisor as mpssupervisor
from gpudra_core.kubeapi import Kube
from gpudra_dev.kubelet_client import DraClient
from gpudra_driver.plugin.sharing.mps.plan import DaemonSpec
from gpudra_driver.plugin.sharing.mps.apply import MpsDaemons, MpsUnavailable
from gpudra_driver.plugin.sockets import SocketAddress
from gpudra_dev.localcluster import mockstate
from gpudra_dev.localcluster.agents import AgentProcess, start_mps_supervisor
from gpudra_dev.localcluster.fakedriverroot import make_driver_root
from gpudra_dev.localcluster.processes import stop_process
from gpudra_dev.localcluster.waiting import wait_for

CLAIM_A = "0c1d2e3f-0000-4000-8000-00000000000a"
CLAIM_B = "0c1d2e3f-0000-4000-8000-00000000000b"
GPU_0, GPU_1 = "GPU-00000000-0000-0000-0000-000000000000", "GPU-00000000-0000-0000-0000-000000000001"


@dataclass
class Node:
    root: Path  # the fake driver root
    plugin_dir: Path
    workdir: Path
    supervisors: list[AgentProcess]

    @property
    def mps(self) -> Path:
        return self.plugin_dir / "mps"

    def start_supervisor(self, *extra: str) -> AgentProcess:
        process = start_mps_supervisor(plugin_dir=self.plugin_dir, driver_root=self.root, workdir=self.workdir,
                                       extra_args=extra)
        self.supervisors.append(process)
        return process

    async def converge(self, specs: dict[str, DaemonSpec]) -> dict[str, str]:
        """As the agent does it at prepare and unprepare, once the supervisor listens."""
        async def listening() -> bool:
            try:
                await asyncio.to_thread(MpsDaemons(self.mps, timeout=5).sync)
                return True
            except MpsUnavailable:
                return False

        await wait_for(listening, timeout=20, what="the MPS supervisor to listen")
        return await asyncio.to_thread(MpsDaemons(self.mps).converge, specs)

    async def status(self, uid: str) -> dict[str, object]:
        return dict((await asyncio.to_thread(MpsDaemons(self.mps, timeout=30).sync, [uid]))[uid])

    def daemons_of(self, uid: str) -> list[int]:
        return [d.pid for d in mockstate.mps_daemons(self.root) if d.pipe_dir == self.mps / uid / "pipe"]

    def control(self, uid: str, *commands: str) -> subprocess.CompletedProcess[str]:
        """nvidia-cuda-mps-control as a client in the claim's container: its pipe directory."""
        return subprocess.run([str(self.root / mockstate.MPS_CONTROL)], input="".join(f"{c}\n" for c in commands),
                              env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(self.mps / uid / "pipe")},
                              capture_output=True, text=True, timeout=20)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    root = make_driver_root(tmp_path / "driver-root", "dgx-h100")
    node = Node(root, tmp_path / "kubelet" / "plugins" / "gpu.gpudra.io", tmp_path, [])
    try:
        yield node
    finally:
        for process in node.supervisors:
            process.stop()
        mockstate.kill_mps_daemons(root)  # they outlive the supervisor by design
        for mount in [*node.mps.glob("*/shm"), *node.mps.glob("*/pipe")]:
            mpsmounts.unmount(mount)  # a failed test's: tmp_path's removal would stop at it


@pytest.fixture
def bystander() -> Iterator[subprocess.Popen[bytes]]:
    """A process the tenant would like killed: it must outlive every test."""
    process = subprocess.Popen(["sleep", "3600"])
    yield process
    stop_process(process)


def spec(uid: str, gpu: str, **kwargs: object) -> DaemonSpec:
    return DaemonSpec(uid, (gpu,), **kwargs)  # type: ignore[arg-type]


def tenant_daemon(node: Node, uid: str) -> subprocess.Popen[bytes]:
    """A control daemon the tenant starts in its container on the claim's pipe directory."""
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(node.mps / uid / "pipe"),
           "CUDA_MPS_LOG_DIRECTORY": str(node.workdir / "tenant-log")}
    return subprocess.Popen([str(node.root / mockstate.MPS_CONTROL), "-f"], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


async def test_a_restarted_supervisor_adopts_only_its_own_daemon_and_signals_no_pid_a_tenant_names(
        node: Node, bystander: subprocess.Popen[bytes]) -> None:
    first = node.start_supervisor()
    assert await node.converge({CLAIM_A: spec(CLAIM_A, GPU_0, active_thread_percentage=40)}) == {}
    [ours] = node.daemons_of(CLAIM_A)
    pipe = node.mps / CLAIM_A / "pipe"

    # The supervisor goes (killed, restarted in place); meanwhile the tenant quits the claim's
    # daemon, runs its own on the control socket and names a bystander in the PID file.
    first.stop(signal.SIGKILL)
    assert node.control(CLAIM_A, "quit").returncode == 0 and mockstate.wait_exited(ours, 10)
    impostor = tenant_daemon(node, CLAIM_A)
    try:
        await wait_for(lambda: _answers(node, CLAIM_A), timeout=10, what="the tenant's daemon to answer")
        (pipe / mockstate.MPS_PID_FILE).write_text(f"{bystander.pid}\n")

        node.start_supervisor()
        status = await wait_for(lambda: _ready(node, CLAIM_A), timeout=30, what="the claim's daemon Ready again")
        # not adopted: a daemon of the supervisor's own, started afresh, holds the claim's limits
        assert status["pid"] not in (bystander.pid, impostor.pid, ours)
        assert sorted(node.daemons_of(CLAIM_A)) == sorted([status["pid"], impostor.pid])  # the tenant's keeps running
        assert node.control(CLAIM_A, "get_default_active_thread_percentage").stdout.strip() == "40.0"
        record = json.loads((node.mps / mpssupervisor.STATE_DIR / f"{CLAIM_A}.json").read_text())
        assert record["pid"] == status["pid"]
        assert oct(os.stat(node.mps / mpssupervisor.STATE_DIR).st_mode & 0o777) == "0o700"

        # The claim is unprepared: its daemon goes; nothing the tenant named is signalled.
        (pipe / mockstate.MPS_PID_FILE).write_text(f"{bystander.pid}\n")
        assert await node.converge({}) == {}
        assert mockstate.wait_exited(int(status["pid"]), 10)  # type: ignore[call-overload]
        assert bystander.poll() is None and impostor.poll() is None
        assert not (node.mps / CLAIM_A).exists()
    finally:
        stop_process(impostor)


async def test_a_supervisor_restarted_after_its_daemon_was_replaced_does_not_adopt_a_reused_record(
        node: Node, bystander: subprocess.Popen[bytes]) -> None:
    """A record whose PID now belongs to another process (the daemon died, the PID was reused) is
    not adopted, and that process is not signalled when the claim goes."""
    first = node.start_supervisor()
    assert await node.converge({CLAIM_A: spec(CLAIM_A, GPU_0)}) == {}
    [ours] = node.daemons_of(CLAIM_A)
    first.stop(signal.SIGKILL)
    records = node.mps / mpssupervisor.STATE_DIR
    forged = json.loads((records / f"{CLAIM_A}.json").read_text()) | {"pid": bystander.pid}
    (records / f"{CLAIM_A}.json").write_text(json.dumps(forged))  # same start time and exe: another process
    node.control(CLAIM_A, "quit")
    assert mockstate.wait_exited(ours, 10)

    node.start_supervisor()
    status = await wait_for(lambda: _ready(node, CLAIM_A), timeout=30, what="the claim's daemon Ready again")
    assert status["pid"] != bystander.pid
    assert await node.converge({}) == {}
    assert bystander.poll() is None


async def test_a_control_link_planted_in_one_claims_pipe_directory_reaches_no_other_claims_daemon(
        node: Node) -> None:
    node.start_supervisor()
    specs = {CLAIM_A: spec(CLAIM_A, GPU_0), CLAIM_B: spec(CLAIM_B, GPU_1, active_thread_percentage=30)}
    assert await node.converge(specs) == {}
    [theirs] = node.daemons_of(CLAIM_B)
    [ours] = node.daemons_of(CLAIM_A)
    # Claim A's tenant points its control socket at claim B's (by its host path, as the supervisor
    # sees it), then A is unprepared: the supervisor's quit must not reach B's daemon.
    control = node.mps / CLAIM_A / "pipe" / "control"
    control.unlink()
    control.symlink_to(node.mps / CLAIM_B / "pipe" / "control")
    assert await node.converge({CLAIM_B: specs[CLAIM_B]}) == {}
    assert mockstate.wait_exited(ours, 10)  # A's own daemon, unreachable by its socket, was killed
    assert node.daemons_of(CLAIM_B) == [theirs]
    assert node.control(CLAIM_B, "get_default_active_thread_percentage").stdout.strip() == "30.0"
    assert (await node.status(CLAIM_B))["state"] == "Ready"


async def test_a_claims_dev_shm_is_a_tmpfs_of_its_size_that_fills_up_without_touching_the_plugin_directory(
        node: Node) -> None:
    node.start_supervisor("--shm-size", "4Mi")
    assert await node.converge({CLAIM_A: spec(CLAIM_A, GPU_0), CLAIM_B: spec(CLAIM_B, GPU_1, shm_size=8 * 2**20)}) \
        == {}
    for uid, size in ((CLAIM_A, 4 * 2**20), (CLAIM_B, 8 * 2**20)):
        shm = node.mps / uid / "shm"
        [mount] = [line.split() for line in Path("/proc/self/mountinfo").read_text().splitlines()
                   if line.split()[4] == str(shm)]
        fstype = mount[mount.index("-") + 1]
        assert fstype == "tmpfs" and f"size={size // 1024}k" in mount[-1], mount
        assert f"nr_inodes={size // 4096}" in mount[-1], mount  # empty files are bounded too
        assert {"nosuid", "nodev", "noexec"} <= set(mount[5].split(","))
        assert os.stat(shm).st_mode & 0o7777 == 0o1777
        assert os.stat(shm).st_dev != os.stat(node.plugin_dir).st_dev  # not the kubelet's file system
    # the tenant fills its /dev/shm: ENOSPC at its size, the plugin directory's file system untouched
    shm = node.mps / CLAIM_A / "shm"
    written = 0
    with pytest.raises(OSError) as raised, open(shm / "filler", "wb") as filler:
        chunk = b"\0" * 2**20
        for _ in range(16):
            written += os.write(filler.fileno(), chunk)
    assert raised.value.errno == errno.ENOSPC and written <= 4 * 2**20
    # a daemon started again keeps the claim's tmpfs and what is in it (its containers use it): none stacked
    (node.mps / CLAIM_B / "shm" / "kept").write_text("kept\n")
    [before] = node.daemons_of(CLAIM_B)
    os.kill(before, signal.SIGKILL)
    assert mockstate.wait_exited(before, 10)

    async def restarted() -> dict[str, object] | None:
        status = await _ready(node, CLAIM_B)
        return status if status and status["pid"] != before else None

    await wait_for(restarted, timeout=30, what="the supervisor to start claim B's daemon again")
    assert (node.mps / CLAIM_B / "shm" / "kept").read_text() == "kept\n"
    assert Path("/proc/self/mountinfo").read_text().count(f" {node.mps / CLAIM_B / 'shm'} ") == 1
    # unprepared: unmounted, then removed, also from the other daemons' mount namespaces (which
    # would otherwise keep its pages)
    [other] = node.daemons_of(CLAIM_B)
    assert f" {node.mps / CLAIM_A / 'shm'} " in Path(f"/proc/{other}/mountinfo").read_text()
    assert await node.converge({CLAIM_B: spec(CLAIM_B, GPU_1, shm_size=8 * 2**20)}) == {}
    assert not (node.mps / CLAIM_A).exists()
    assert f" {node.mps / CLAIM_A / 'shm'} " not in Path(f"/proc/{other}/mountinfo").read_text()
    assert str(node.mps / CLAIM_A / "shm") not in Path("/proc/self/mountinfo").read_text()
    assert await node.converge({}) == {}
    assert str(node.mps) not in Path("/proc/self/mountinfo").read_text()


async def _answers(node: Node, uid: str) -> bool:
    result = await asyncio.to_thread(node.control, uid, "get_default_active_thread_percentage")
    return result.returncode == 0


async def _ready(node: Node, uid: str) -> dict[str, object] | None:
    try:
        status = await node.status(uid)
    except (MpsUnavailable, KeyError):
        return None
    return status if status.get("state") == "Ready" else None


async def test_a_claim_asking_for_more_dev_shm_than_the_platform_allows_gets_no_daemon_and_a_reason(
        node: Node) -> None:
    node.start_supervisor("--shm-size", "4Mi", "--max-shm-size", "8Mi")
    problems = await node.converge({CLAIM_A: spec(CLAIM_A, GPU_0, shm_size=16 * 2**20),
                                    CLAIM_B: spec(CLAIM_B, GPU_1, shm_size=8 * 2**20)})
    assert list(problems) == [CLAIM_A]
    assert "sharing.mps.shmSize: 16Mi is more than 8Mi" in problems[CLAIM_A]
    assert "spec.sharing.mps.maxShmSize" in problems[CLAIM_A]
    assert node.daemons_of(CLAIM_A) == [] and not os.path.ismount(node.mps / CLAIM_A / "shm")
    assert len(node.daemons_of(CLAIM_B)) == 1 and os.path.ismount(node.mps / CLAIM_B / "shm")
    assert await node.converge({}) == {}


def _mount_of(path: Path) -> list[str]:
    [mount] = [line.split() for line in Path("/proc/self/mountinfo").read_text().splitlines()
               if line.split()[4] == str(path)]
    return mount


async def test_a_tenant_cannot_fill_the_nodes_disk_or_crash_the_supervisor_through_its_pipe_directory(
        node: Node) -> None:
    """The pipe directory is a small tmpfs: a tenant that writes into it until it is full, or
    builds a tree deeper than Python's stack, fills its own bound; the supervisor empties it
    (the daemon restarted) and removes it (the claim unprepared), and goes on for every claim."""
    supervisor = node.start_supervisor()
    assert await node.converge({CLAIM_A: spec(CLAIM_A, GPU_0), CLAIM_B: spec(CLAIM_B, GPU_1)}) == {}
    [theirs] = node.daemons_of(CLAIM_B)
    pipe = node.mps / CLAIM_A / "pipe"
    # a tree as deep as it can make it (3000 levels would crash a recursive removal)
    depth, fd = 0, os.open(pipe, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for depth in range(3000):  # noqa: B007 (the depth reached is the point)
            os.mkdir("d", dir_fd=fd)
            deeper = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = deeper
    except OSError as error:
        assert error.errno == errno.ENOSPC
    finally:
        os.close(fd)

    # it quits its daemon: the supervisor starts it again in an emptied pipe directory
    [ours] = node.daemons_of(CLAIM_A)
    assert node.control(CLAIM_A, "quit").returncode == 0 and mockstate.wait_exited(ours, 10)

    async def restarted() -> dict[str, object] | None:
        status = await _ready(node, CLAIM_A)
        return status if status and status["pid"] != ours else None

    await wait_for(restarted, timeout=30, what="claim A's daemon started again")
    assert not (pipe / "d").exists() and supervisor.process.poll() is None
    assert node.daemons_of(CLAIM_B) == [theirs] and (await node.status(CLAIM_B))["state"] == "Ready"
    mount = _mount_of(pipe)
    assert mount[mount.index("-") + 1] == "tmpfs" and f"size={mpsmounts.PIPE_SIZE // 1024}k" in mount[-1]
    assert f"nr_inodes={mpsmounts.PIPE_INODES}" in mount[-1]
    assert {"nosuid", "nodev", "noexec", "nosymfollow"} <= set(mount[5].split(","))
    assert os.stat(pipe).st_dev != os.stat(node.plugin_dir).st_dev
    assert 0 < depth < mpsmounts.PIPE_INODES  # the tree was as deep as the tmpfs's inodes, no deeper

    # the tenant writes until it cannot: its bound, not the kubelet's disk
    written = 0
    with pytest.raises(OSError) as full, open(pipe / "filler", "wb") as filler:
        for _ in range(4 * mpsmounts.PIPE_SIZE // 2**16):
            written += os.write(filler.fileno(), b"\0" * 2**16)
    assert full.value.errno == errno.ENOSPC and written <= mpsmounts.PIPE_SIZE
    (pipe / "filler").unlink()

    # a new tree, then the claim is unprepared: its directory goes, unwalked; B's daemon runs on
    os.makedirs(pipe / "/".join(["d"] * 100))
    assert await node.converge({CLAIM_B: spec(CLAIM_B, GPU_1)}) == {}
    assert not (node.mps / CLAIM_A).exists() and str(pipe) not in Path("/proc/self/mountinfo").read_text()
    assert supervisor.process.poll() is None and node.daemons_of(CLAIM_B) == [theirs]


@pytest.mark.parametrize("answer", [None, b"OK\n"], ids=["never-answers", "lies"])
async def test_unpreparing_a_claim_whose_control_socket_is_the_tenants_delays_neither_it_nor_other_claims_prepare(
        kube: Kube, namespace: str, fake_nodes, plugin_agents, driver: str, tmp_path: Path,  # noqa: F811
        answer: bytes | None) -> None:
    """Claim A's tenant replaces its control socket with one that accepts and never answers, or
    that answers OK to anything (a ``quit`` would leave the daemon running). The kubelet unprepares
    A (its containers are gone: no MPS client is left) while it prepares B, on another GPU, through
    the agent, whose node lock both calls take. Both answer within 2 s: A's daemon is killed with
    its process group at once, through its pidfd, and nothing talks to the tenant's socket; A's GPU
    is back to DEFAULT only once the group is gone; B's daemon is up, its GPU EXCLUSIVE_PROCESS."""
    root = make_driver_root(tmp_path / "driver-root", "dgx-h100")
    node = (await fake_nodes("h100"))["metadata"]["name"]
    agent = plugin_agents(node, driver, nvml="mock:dgx-h100", driver_root=root)
    plugin_dir = agent.workdir / "kubelet" / "plugins" / driver
    supervisor = start_mps_supervisor(plugin_dir=plugin_dir, driver_root=root, workdir=agent.workdir)
    connections: list[asyncio.StreamWriter] = []

    async def tenant(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)  # held open: a client waits for an answer that never comes
        if answer is not None:
            await reader.read(1024)
            writer.write(answer)
            await writer.drain()
            writer.close()

    try:
        uuid_of = {name: d["attributes"]["uuid"]["string"]
                   for name, d in (await published_devices(kube, driver, node, 8)).items()}
        a = await allocated_claim(kube, namespace, "tenant", driver, node, ["gpu-0"], config=mps_config(driver))
        b = await allocated_claim(kube, namespace, "neighbour", driver, node, ["gpu-1"], config=mps_config(driver))
        async with DraClient((await agent.registered()).endpoint) as kubelet:
            assert (await agent.prepare(kubelet, [ref(a)])).claims[a["metadata"]["uid"]].error == ""
            [daemon] = [d for d in mockstate.mps_daemons(root) if d.pipe_dir.parent.name == a["metadata"]["uid"]]
            group = os.getpgid(daemon.pid)
            assert group == daemon.pid  # the daemon leads a process group of its own
            assert mockstate.compute_mode(root, uuid_of["gpu-0"]) == EXCLUSIVE_PROCESS
            control = daemon.pipe_dir / "control"
            control.unlink()
            with SocketAddress(control) as address:
                server = await asyncio.start_unix_server(tenant, path=address.address)

            started = time.monotonic()

            async def timed(call: Awaitable[Any]) -> tuple[Any, float]:
                response = await call
                return response, time.monotonic() - started

            (unprepared, unprepare_took), (prepared, prepare_took) = await asyncio.wait_for(asyncio.gather(
                timed(kubelet.unprepare([ref(a)])), timed(agent.prepare(kubelet, [ref(b)]))), 60)
            assert unprepared.claims[a["metadata"]["uid"]].error == ""
            assert prepared.claims[b["metadata"]["uid"]].error == ""
            assert max(unprepare_took, prepare_took) < 2.0, (unprepare_took, prepare_took)
            assert connections == []  # nothing asked the tenant's socket anything
            with pytest.raises(ProcessLookupError):
                os.killpg(group, 0)  # the daemon and every process of its group are gone
            assert mockstate.compute_mode(root, uuid_of["gpu-0"]) == 0  # DEFAULT
            assert not daemon.pipe_dir.parent.exists()
            [theirs] = [d for d in mockstate.mps_daemons(root) if d.pipe_dir.parent.name == b["metadata"]["uid"]]
            assert mockstate.compute_mode(root, uuid_of["gpu-1"]) == EXCLUSIVE_PROCESS
            server.close()
            assert (await kubelet.unprepare([ref(b)])).claims[b["metadata"]["uid"]].error == ""
    finally:
        for writer in connections:
            writer.close()
        supervisor.stop()
        mockstate.kill_mps_daemons(root)  # they outlive the supervisor by design
        for mount in [*(plugin_dir / "mps").glob("*/shm"), *(plugin_dir / "mps").glob("*/pipe")]:
            mpsmounts.unmount(mount)  # a failed test's: tmp_path's removal would stop at it


async def test_a_changed_daemon_spec_restarts_the_daemon_in_the_same_directories(node: Node) -> None:
    node.start_supervisor()
    assert await node.converge({CLAIM_A: spec(CLAIM_A, GPU_0, active_thread_percentage=40)}) == {}
    [before] = node.daemons_of(CLAIM_A)
    shm = node.mps / CLAIM_A / "shm"
    (shm / "kept").write_text("kept\n")  # the claim's containers' /dev/shm: it stays
    assert await node.converge({CLAIM_A: spec(CLAIM_A, GPU_0, active_thread_percentage=30)}) == {}
    [after] = node.daemons_of(CLAIM_A)
    assert after != before and mockstate.wait_exited(before, 10)
    assert node.control(CLAIM_A, "get_default_active_thread_percentage").stdout.strip() == "30.0"
    assert (shm / "kept").read_text() == "kept\n" and os.path.ismount(shm)
    assert (node.mps / CLAIM_A / "daemon.json").exists()
    assert await node.converge({}) == {}
    assert not (node.mps / CLAIM_A).exists()
