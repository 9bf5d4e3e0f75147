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


async def test_the_async_lock_waits_for_a_holder_without_blocking_the_loop(tmp_path: Path) -> None:
    import asyncio

    from gpudra_driver.plugin.locking import node_lock_async

    path = tmp_path / "serialize.lock"
    with node_lock(path):  # a peer instance holds it
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        with pytest.raises(LockTimeout, match="held by another agent instance"):
            async with node_lock_async(path, timeout=0.05):
                pass
        ticker.cancel()
        assert ticks > 1  # the loop kept running other tasks while the lock was polled
        waiter = asyncio.create_task(_hold_briefly(path))
        done, _ = await asyncio.wait({waiter}, timeout=0.2)  # a lock that ignored the holder finishes at once
        assert not done  # still waiting for the holder
    assert await asyncio.wait_for(waiter, 10) == "locked"  # the holder let go: it gets the lock


async def _hold_briefly(path: Path) -> str:
    from gpudra_driver.plugin.locking import node_lock_async

    async with node_lock_async(path, timeout=10):
        with pytest.raises(LockTimeout):  # exclusive against the sync lock as well
            with node_lock(path, timeout=0.01):
                pass
    return "locked"
