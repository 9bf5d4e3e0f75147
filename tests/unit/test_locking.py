"""The node lock: exclusive across open files and processes, released when its holder dies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpudra_driver.plugin.locking import LockTimeout, node_lock


def test_the_lock_is_exclusive_and_released(tmp_path: Path) -> None:
    path = tmp_path / "serialize.lock"
    with node_lock(path):
        with pytest.raises(LockTimeout, match="held by another agent instance"):
            with node_lock(path, timeout=0.05):
                pass
    with node_lock(path, timeout=0.05):  # free again
        pass


def test_a_killed_holder_releases_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "serialize.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; from gpudra_driver.plugin.locking import node_lock\n"
         f"with node_lock(Path({str(path)!r})):\n    print('locked', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(LockTimeout):
            with node_lock(path, timeout=0.05):
                pass
        holder.kill()
        holder.wait(timeout=10)
        with node_lock(path, timeout=5):
            pass
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
