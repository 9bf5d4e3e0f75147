"""The MPS supervisor's records of its daemons and its parts that need no daemon: what makes a
process the one it started, how it starts and kills one (real processes), its restart backoff,
the removal of a tenant's tree, the daemon spec's /dev/shm size, and how long the agent waits for
the supervisor. The supervisor against a tenant runs in
tests/integration/test_mps_tenant.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpudra_driver.plugin.sharing.mps import supervisor as mpssupervisor
from gpudra_driver.plugin.sharing.mps.mounts import empty_directory, helper_command
from gpudra_driver.plugin.sharing.mps.supervisor import Daemon, Supervisor, restart_at, shm_size_of
from gpudra_driver.plugin.sharing.mps.processes import ProcessRecord, observe, open_recorded, same_process, start_time_of
from gpudra_dev.localcluster.waiting import wait_for
from gpudra_driver.plugin.sharing.mps import apply as mpsdaemons
from gpudra_driver.plugin.sharing.mps.plan import DEFAULT_SHM_SIZE, DaemonSpec
from gpudra_driver.plugin.sharing.mps.apply import MpsDaemons
from gpudra_driver.plugin.sockets import SocketAddress

UID = "0c1d2e3f-0000-4000-8000-0000000000aa"


def test_the_start_time_is_field_22_whatever_the_command_name_holds() -> None:
    fields = " ".join(str(n) for n in range(3, 53))  # fields 3..52 hold their own numbers
    assert start_time_of(f"4242 (a) b) c) {fields}".encode()) == 22  # comm "a) b) c"
    assert start_time_of(f"7 (sleep) {fields}\n".encode()) == 22


def test_a_process_is_its_pid_start_time_and_executable() -> None:
    record = ProcessRecord(100, 5000, "/driver-root/usr/bin/nvidia-cuda-mps-control")
    assert same_process(record, record)
    assert same_process(record, ProcessRecord(100, 5000, record.exe + " (deleted)"))  # replaced on disk since
    assert not same_process(record, None)  # gone
    assert not same_process(record, ProcessRecord(100, 5001, record.exe))  # the PID reused
    assert not same_process(record, ProcessRecord(100, 5000, "/usr/bin/sleep"))
    assert not same_process(record, ProcessRecord(101, 5000, record.exe))


def test_a_record_is_read_strictly() -> None:
    record = ProcessRecord(100, 5000, "/bin/x")
    assert ProcessRecord.from_json(json.loads(json.dumps(record.to_json()))) == record
    for bad in ({"pid": "100", "startTime": 5000, "exe": "/bin/x"}, {"pid": 0, "startTime": 5000, "exe": "/bin/x"},
                {"pid": 100, "startTime": True, "exe": "/bin/x"}, {"pid": 100, "startTime": 1}, [100], "100\n"):
        with pytest.raises(ValueError):
            ProcessRecord.from_json(bad)


def test_only_the_recorded_process_is_opened() -> None:
    process = subprocess.Popen(["sleep", "60"])
    try:
        seen = observe(process.pid)
        assert seen is not None and seen.exe == os.path.realpath(shutil.which("sleep") or "")
        fd = open_recorded(seen)
        assert fd is not None
        os.close(fd)
        assert open_recorded(ProcessRecord(seen.pid, seen.start_time + 1, seen.exe)) is None  # not that one
    finally:
        process.kill()
        process.wait()
    assert observe(process.pid) is None and open_recorded(seen) is None  # gone


def test_a_daemon_spec_carries_its_shm_size_only_when_set() -> None:
    plain = DaemonSpec(UID, ("GPU-1",))
    assert "shmBytes" not in plain.to_json()  # a spec written before stays byte-identical
    sized = DaemonSpec(UID, ("GPU-1",), shm_size=256 * 2**20)
    assert DaemonSpec.from_json(json.loads(sized.encode())) == sized
    assert DEFAULT_SHM_SIZE == 64 * 2**20
    for bad in (0, -1, "64Mi", 2**63, True):
        with pytest.raises(ValueError, match="shmBytes"):
            DaemonSpec.from_json(plain.to_json() | {"shmBytes": bad})


def test_a_claims_shm_size_is_its_own_within_the_bound_or_the_platforms_default() -> None:
    mib = 2**20
    assert shm_size_of(DaemonSpec(UID, ("GPU-1",)), 64 * mib, 1024 * mib) == 64 * mib
    assert shm_size_of(DaemonSpec(UID, ("GPU-1",), shm_size=1024 * mib), 64 * mib, 1024 * mib) == 1024 * mib
    with pytest.raises(ValueError, match=r"sharing\.mps\.shmSize: 2Gi is more than 1Gi, .*spec\.sharing\.mps\.maxShmSize"):
        shm_size_of(DaemonSpec(UID, ("GPU-1",), shm_size=2048 * mib), 64 * mib, 1024 * mib)


def test_only_a_record_of_the_control_daemons_executable_is_opened() -> None:
    process = subprocess.Popen(["sleep", "60"])
    try:
        seen = observe(process.pid)
        assert seen is not None
        assert open_recorded(seen, "/usr/bin/nvidia-cuda-mps-control") is None  # a record naming another program
        fd = open_recorded(seen, shutil.which("sleep"))
        assert fd is not None
        os.close(fd)
    finally:
        process.kill()
        process.wait()


def test_the_helper_runs_the_daemon_only_once_told_to_and_as_the_same_process(tmp_path: Path) -> None:
    """What closes the gap between starting a daemon and recording it: a supervisor that dies
    before its record is written closes the helper's stdin, and nothing runs."""
    ran = tmp_path / "ran"
    script = ["-c", f'echo $$ > {ran}']
    told_nothing = subprocess.run(helper_command("/bin/sh", script, None), input=b"", timeout=30)
    assert told_nothing.returncode == 1 and not ran.exists()
    helper = subprocess.Popen(helper_command("/bin/sh", script, None), stdin=subprocess.PIPE)
    start = observe(helper.pid)
    assert start is not None
    helper.communicate(b"go\n", timeout=30)
    assert helper.returncode == 0 and ran.read_text() == f"{helper.pid}\n"  # the PID the record names


@pytest.mark.parametrize("spawn", ["sleep 600", "setsid sleep 600"], ids=["in-its-group", "in-a-session-of-its-own"])
async def test_a_killed_daemon_takes_its_servers_along(tmp_path: Path, spawn: str) -> None:
    """An adopted daemon (reached through a pidfd on its record) is killed with the MPS servers it
    started: they would keep its GPUs in EXCLUSIVE_PROCESS. Killed as well: a server that left the
    daemon's process group with a session of its own (setsid), since it is still the daemon's child."""
    child = tmp_path / "child"
    leader = subprocess.Popen(["sh", "-c", f"{spawn} & echo $! > {child}; wait"], start_new_session=True)
    daemon = Daemon(mpssupervisor.DaemonSpec(UID, ("GPU-1",)), pid=leader.pid)
    server = 0
    try:
        await wait_for(lambda: _nonempty(child), timeout=10, what="the daemon's child to start")
        server = int(child.read_text())
        if spawn.startswith("setsid"):
            await wait_for(lambda: _own_session(server), timeout=10, what="the daemon's child to leave its group")
        record = observe(leader.pid)
        assert record is not None
        daemon.pidfd = open_recorded(record)
        assert daemon.alive() and await daemon.killed()
        await wait_for(lambda: _gone(server), timeout=10, what="the daemon's child to go with it")
    finally:
        leader.kill()
        leader.wait()
        daemon.forget()
        if server and observe(server) is not None:
            os.kill(server, 9)


async def _own_session(pid: int) -> bool:
    """Whether ``pid`` leads a process group of its own (setsid has run in it)."""
    try:
        return os.getpgid(pid) == pid
    except ProcessLookupError:
        return False


async def _nonempty(path: Path) -> bool:
    return path.exists() and path.read_text().strip() != ""


async def _gone(pid: int) -> bool:
    return observe(pid) is None


def test_a_dead_daemon_is_restarted_after_a_backoff_that_doubles_while_it_keeps_dying_young() -> None:
    assert restart_at(100.0, 100.0 + mpssupervisor.STABLE_AFTER, 3) == (100.0 + mpssupervisor.STABLE_AFTER, 0)
    at, failures = 100.0, 0
    delays = []
    for _ in range(10):
        at, failures = restart_at(100.0, 101.0, failures)
        delays.append(at - 100.0)
    assert delays[:4] == [5.0, 10.0, 20.0, 40.0] and delays[-1] == mpssupervisor.MAX_RESTART_BACKOFF


def test_a_tenants_tree_deeper_than_pythons_stack_is_removed_following_no_link(tmp_path: Path) -> None:
    pipe, outside = tmp_path / "pipe", tmp_path / "outside"
    pipe.mkdir()
    outside.mkdir()
    (outside / "kept").write_text("kept")
    fd = os.open(pipe, os.O_RDONLY)
    for _ in range(sys.getrecursionlimit() + 500):
        os.mkdir("d", dir_fd=fd)
        os.symlink(outside, "link", dir_fd=fd)
        deeper = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = deeper
    os.close(fd)
    empty_directory(pipe)
    assert os.listdir(pipe) == [] and (outside / "kept").read_text() == "kept"


def test_a_directory_without_a_spec_is_a_leftover_by_how_long_this_process_has_seen_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not by its mtime: a wall clock stepped forward (or an old mtime) does not make a directory
    the agent is writing into a leftover."""
    supervisor = Supervisor(tmp_path / "mps", Path("/nonexistent"))
    (tmp_path / "mps" / UID).mkdir(parents=True)
    os.utime(tmp_path / "mps" / UID, (0, 0))  # as old as can be
    now = [1000.0]
    monkeypatch.setattr(mpssupervisor.time, "monotonic", lambda: now[0])
    assert not supervisor._leftover(UID)
    now[0] += mpssupervisor.LEFTOVER_AGE + 1
    assert supervisor._leftover(UID)


async def test_a_pass_that_fails_on_one_claim_fails_that_claim_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever one claim's pass raises (a RecursionError is no OSError) is that claim's Failed
    status: the supervisor and the other claims go on."""
    other = UID.replace("aa", "bb")
    supervisor = Supervisor(tmp_path / "mps", Path("/nonexistent"))
    for uid in (UID, other):
        (tmp_path / "mps" / uid).mkdir(parents=True)
        (tmp_path / "mps" / uid / "daemon.json").write_bytes(mpssupervisor.DaemonSpec(uid, ("GPU-1",)).encode())

    async def start(uid: str, daemon: Daemon) -> None:
        if uid == UID:
            raise RecursionError("maximum recursion depth exceeded")
        daemon.state = mpssupervisor.READY

    monkeypatch.setattr(supervisor, "_start", start)
    statuses = await supervisor.converge([UID, other])
    assert statuses[UID]["state"] == mpssupervisor.FAILED and "RecursionError" in statuses[UID]["message"]
    assert statuses[other]["state"] == mpssupervisor.READY
    assert json.loads((tmp_path / "mps" / UID / "status.json").read_text())["state"] == mpssupervisor.FAILED


async def test_a_sync_waits_for_the_claims_it_names_and_no_other(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other = UID.replace("aa", "bb")
    supervisor = Supervisor(tmp_path / "mps", Path("/nonexistent"))
    for uid in (UID, other):
        (tmp_path / "mps" / uid).mkdir(parents=True)
        (tmp_path / "mps" / uid / "daemon.json").write_bytes(mpssupervisor.DaemonSpec(uid, ("GPU-1",)).encode())
    stuck = asyncio.Event()  # claim UID's daemon start: set by no one until the end

    async def start(uid: str, daemon: Daemon) -> None:
        if uid == UID:
            await stuck.wait()
        daemon.state = mpssupervisor.READY

    monkeypatch.setattr(supervisor, "_start", start)
    statuses = await asyncio.wait_for(supervisor.converge([other]), 5)
    assert statuses[other]["state"] == mpssupervisor.READY and UID not in statuses
    again = await asyncio.wait_for(supervisor.converge([other]), 5)  # the stuck claim's pass is not queued twice
    assert again[other]["state"] == mpssupervisor.READY
    stuck.set()
    assert (await asyncio.wait_for(supervisor.converge([UID]), 5))[UID]["state"] == mpssupervisor.READY


async def test_the_agent_waits_for_a_stop_only_its_short_bound_and_for_a_start_its_long_one(tmp_path: Path) -> None:
    """A supervisor that takes the agent's call and never answers (one stuck, say): a call that
    only stops daemons (an unprepare) gives up after ``stop_timeout`` in all; one that starts a
    daemon waits ``timeout``. Both are under the agent's node lock."""
    root = tmp_path / "mps"
    (root / UID).mkdir(parents=True)
    (root / UID / "daemon.json").write_bytes(DaemonSpec(UID, ("GPU-1",)).encode())
    assert mpsdaemons.STOP_TIMEOUT == mpsdaemons.KILL_WAIT + 5.0 < mpsdaemons.SYNC_TIMEOUT
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with SocketAddress(root / "supervisor.sock") as address:
        listener.bind(address.address)
    listener.listen(8)  # connects, is never accepted: nothing is ever answered
    try:
        daemons = MpsDaemons(root, timeout=1.5, stop_timeout=0.3)
        started = time.monotonic()
        assert await asyncio.to_thread(daemons.converge, {}) == {}  # the stop: given up on, logged
        assert time.monotonic() - started < 1.0 and not (root / UID / "daemon.json").exists()
        started = time.monotonic()
        problems = await asyncio.to_thread(daemons.converge, {UID: DaemonSpec(UID, ("GPU-1",))})
        assert 1.5 <= time.monotonic() - started < 5 and "did not answer" in problems[UID]
    finally:
        listener.close()


_TENANT_WRITER = """
import os, sys
directory, prefix, i = sys.argv[1], sys.argv[2], 0
while True:  # d1/f, d2/f, ...: a new name each time
    i += 1
    try:
        os.mkdir(f"{directory}/{prefix}{i}")
        open(f"{directory}/{prefix}{i}/f", "w").close()
    except OSError:
        pass
"""
TENANT_WRITERS = 2  # one alone, racing one thread that empties, lost the race now and then on two vCPUs


async def test_a_tenant_writing_into_its_pipe_directory_fails_its_own_restart_in_bounded_time_and_no_other(
        tmp_path: Path) -> None:
    """The tenant's container has its pipe directory mounted read-write while the daemon is
    started again, and keeps creating directories with a file in each (``d1/f``, ``d2/f``, ...,
    from two processes at once):
    the emptying stops at its bound and that claim fails with a reason; another claim's
    directories are prepared meanwhile, even with asyncio's shared executor down to one thread.
    (A plain pipe directory, as an older version left it, where this writer outpaces the emptying
    on any kernel; a tmpfs one is bounded by operations as well as by the deadline.)"""
    other = UID.replace("aa", "bb")
    loop = asyncio.get_running_loop()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(1))
    supervisor = Supervisor(tmp_path / "mps", Path("/nonexistent"))
    spec = DaemonSpec(UID, ("GPU-1",))
    for uid in (UID, other):
        (tmp_path / "mps" / uid).mkdir(parents=True)
    pipe = tmp_path / "mps" / UID / "pipe"
    pipe.mkdir()
    writers = [subprocess.Popen([sys.executable, "-c", _TENANT_WRITER, str(pipe), f"w{n}-d"])
               for n in range(TENANT_WRITERS)]
    try:
        await wait_for(lambda: _entries(pipe, 2000), timeout=20, what="the tenant to write")
        racing = Daemon(spec)
        started = time.monotonic()
        restart = asyncio.create_task(supervisor._start(UID, racing))

        async def emptying() -> bool:  # its first step hands the directories' work to a thread
            return racing.started_at > 0

        await wait_for(emptying, timeout=10, what="the claim's restart to begin")
        neighbour = Daemon(DaemonSpec(other, ("GPU-2",)))
        await asyncio.wait_for(supervisor._start(other, neighbour), 5)
        # its directories were prepared: it got as far as starting its (here missing) program
        assert neighbour.state == mpssupervisor.FAILED and "/nonexistent" in neighbour.message
        assert os.path.ismount(tmp_path / "mps" / other / "pipe")
        await asyncio.wait_for(restart, mpssupervisor.EMPTY_TIMEOUT + 10)
        assert time.monotonic() - started <= mpssupervisor.EMPTY_TIMEOUT + 1
        assert racing.state == mpssupervisor.FAILED and "keeps writing into it" in racing.message
    finally:
        for writer in writers:
            writer.kill()
            writer.wait()
        for uid in (UID, other):
            supervisor._remove_dir(uid)
    assert not (tmp_path / "mps" / UID).exists()


async def test_the_helpers_python_runs_without_the_driver_roots_libraries_and_the_daemon_with_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver root's library directory (on a node, the host's libc) is the daemon's
    LD_LIBRARY_PATH, never the helper's: the image's Python may not load the host's libraries."""
    library, seen = tmp_path / "driver-lib", tmp_path / "seen"
    control = tmp_path / "nvidia-cuda-mps-control"
    control.write_text(f'#!/bin/sh\necho "$LD_LIBRARY_PATH $CUDA_VISIBLE_DEVICES" > {seen}\n')
    control.chmod(0o755)
    (tmp_path / "mps" / UID).mkdir(parents=True)
    supervisor = Supervisor(tmp_path / "mps", control, library)
    helper_environ: list[bytes] = []
    real_observe = mpssupervisor.observe

    def observing(pid: int) -> ProcessRecord | None:  # the helper, before it is told to go
        helper_environ.append(Path(f"/proc/{pid}/environ").read_bytes())
        return real_observe(pid)

    monkeypatch.setattr(mpssupervisor, "observe", observing)
    daemon = Daemon(DaemonSpec(UID, ("GPU-7",)))
    try:
        assert await supervisor._spawn(UID, daemon) is None
        assert daemon.process is not None and await asyncio.wait_for(daemon.process.wait(), 30) == 0
    finally:
        daemon.forget()
    assert seen.read_text().split() == [str(library), "GPU-7"]
    assert len(helper_environ) == 1 and str(library).encode() not in helper_environ[0]
    assert b"CUDA_VISIBLE_DEVICES=GPU-7" not in helper_environ[0]


async def test_a_control_client_that_prints_without_end_is_killed_at_its_output_limit(tmp_path: Path) -> None:
    """A tenant that replaced its control socket can make the client print a reply as long as it
    likes: the supervisor holds at most CLIENT_OUTPUT_LIMIT bytes of it, then kills the client and
    fails the call, at once rather than at its timeout."""
    control = tmp_path / "nvidia-cuda-mps-control"
    control.write_text("#!/bin/sh\nexec head -c 268435456 /dev/zero\n")  # 256 MiB: endless enough
    control.chmod(0o755)
    (tmp_path / "mps" / UID).mkdir(parents=True)
    supervisor = Supervisor(tmp_path / "mps", control)
    started = time.monotonic()
    problem = await supervisor._client(UID, ["get_default_active_thread_percentage"])
    assert time.monotonic() - started < mpssupervisor.CLIENT_TIMEOUT / 2
    assert problem is not None and f"more than {mpssupervisor.CLIENT_OUTPUT_LIMIT} bytes" in problem


async def test_a_killed_daemon_that_keeps_starting_servers_in_sessions_of_their_own_leaves_none(
        tmp_path: Path) -> None:
    """A live daemon may start another server (setsid) between the scan for its children and its
    kill; it is stopped first, so none escapes. Three rounds: the gap is short."""
    for round in range(3):
        pids, duration = tmp_path / f"pids-{round}", f"600.{os.getpid()}{round}"  # this round's servers alone
        leader = subprocess.Popen(["sh", "-c", f"while :; do setsid sleep {duration} & echo $! >> {pids}; done"],
                                  start_new_session=True)
        record = observe(leader.pid)
        assert record is not None
        daemon = Daemon(mpssupervisor.DaemonSpec(UID, ("GPU-1",)), pid=leader.pid)
        try:
            await wait_for(lambda: _lines(pids, 50), timeout=10, what="the daemon to start servers")
            daemon.pidfd = open_recorded(record)
            assert daemon.alive() and await daemon.killed()
            leader.wait()

            async def none_left() -> bool:
                return not _servers_since(record.start_time, duration)

            await wait_for(none_left, timeout=10, what="every server the daemon started to go")
        finally:
            leader.kill()
            leader.wait()
            daemon.forget()
            for pid in _servers_since(record.start_time, duration):
                os.kill(pid, 9)


async def _entries(path: Path, count: int) -> bool:
    return len(os.listdir(path)) >= count


async def _lines(path: Path, count: int) -> bool:
    return path.exists() and path.read_text().count("\n") >= count


def _servers_since(start_time: int, duration: str) -> list[int]:
    """``sleep DURATION`` processes leading sessions of their own, started since ``start_time``."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes()
            seen = observe(int(entry.name))
            if cmdline == f"sleep\x00{duration}\x00".encode() and seen is not None and seen.start_time >= start_time \
                    and os.getsid(int(entry.name)) == int(entry.name):
                found.append(int(entry.name))
        except OSError:
            continue
    return found
