"""The local cluster's subprocesses die with the process that started them, even when it is
SIGKILLed (a CI timeout, an OOM kill), and the next run removes the in-memory scratch directories
(etcd's data) such a run leaves: no etcd, API server or agent, and no memory, outlives it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gpudra_dev.localcluster.processes import dying_with_parent
from gpudra_dev.localcluster.scratch import ScratchDir, remove_orphans
from gpudra_dev.localcluster.waiting import wait_for

# A parent that starts `sleep` (through dying_with_parent, or plainly) and reports the child's PID.
PARENT = """
import subprocess, sys
from gpudra_dev.localcluster.processes import dying_with_parent
argv = ["sleep", "300"]
child = subprocess.Popen(dying_with_parent(argv) if sys.argv[1] == "dying" else argv)
print(child.pid, flush=True)
sys.stdin.read()
"""


def alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it has died)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def start_parent(mode: str) -> tuple[subprocess.Popen[str], int]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, mode], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    return parent, int(parent.stdout.readline())


async def test_a_child_dies_when_its_parent_is_killed() -> None:
    assert shutil.which("setpriv"), "needs util-linux's setpriv (as the real-kubelet tests do)"
    parent, child = start_parent("dying")
    try:
        # once setpriv has exec'd sleep, the death signal is set (killing the parent earlier would race it)
        await wait_for(lambda: _comm_is(child, "sleep"), timeout=10, what="setpriv to exec the child")
        parent.kill()
        parent.wait(timeout=10)

        async def gone() -> bool:
            return not alive(child)

        await wait_for(gone, timeout=10, what=f"child {child} to die with its parent")
    finally:
        _cleanup(parent, child)


async def test_without_it_a_child_outlives_its_killed_parent() -> None:
    """The control: what the tests' processes did before (and do where setpriv is missing)."""
    parent, child = start_parent("plain")
    try:
        parent.kill()
        parent.wait(timeout=10)
        assert alive(child)
    finally:
        _cleanup(parent, child)


def test_without_setpriv_the_command_runs_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert dying_with_parent(["etcd", "--data-dir", "x"]) == ["etcd", "--data-dir", "x"]


async def _comm_is(pid: int, name: str) -> bool:
    return Path(f"/proc/{pid}/comm").read_text().strip() == name


def _cleanup(parent: subprocess.Popen[str], child: int) -> None:
    if parent.poll() is None:
        parent.kill()
        parent.wait(timeout=10)
    if alive(child):
        os.kill(child, signal.SIGKILL)


# A process that makes a scratch directory, reports its path and waits (to be killed).
OWNER = """
import sys
from pathlib import Path
from gpudra_dev.localcluster.scratch import ScratchDir
scratch = ScratchDir("gpudra-test-", Path(sys.argv[1]))
(scratch.path / "data").write_text("etcd's, say")
print(scratch.path, flush=True)
sys.stdin.read()
"""


def test_scratch_dirs_of_killed_runs_are_removed_by_the_next_one(tmp_path: Path) -> None:
    owners = [subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        killed, alive_owner = owners
        paths = [Path(o.stdout.readline().strip()) for o in owners if o.stdout is not None]
        assert all((p / "data").is_file() for p in paths)
        killed.kill()
        killed.wait(timeout=10)
        unlocked = tmp_path / "gpudra-test-unlocked"  # being made by someone, or from before owner locks
        unlocked.mkdir()
        other_prefix = tmp_path / "other-x"
        other_prefix.mkdir()
        (other_prefix / "owner.lock").touch()
        elsewhere = tmp_path / "elsewhere"  # a link planted in /dev/shm is not followed
        elsewhere.mkdir()
        (elsewhere / "owner.lock").touch()
        (tmp_path / "gpudra-test-link").symlink_to(elsewhere)

        assert remove_orphans(tmp_path, "gpudra-test-") == [paths[0]]
        assert not paths[0].exists(), "the killed run's directory stays"
        assert (paths[1] / "data").is_file(), "a live run's directory was removed"
        assert unlocked.is_dir() and other_prefix.is_dir() and (elsewhere / "owner.lock").is_file()

        mine = ScratchDir("gpudra-test-", tmp_path)  # sweeps as it is made (nothing left to sweep now)
        assert (mine.path / "owner.lock").is_file() and (paths[1] / "data").is_file()
        mine.remove()
        assert not mine.path.exists()
    finally:
        for owner in owners:
            owner.kill()
            owner.wait(timeout=10)
