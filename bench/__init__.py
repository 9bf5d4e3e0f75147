"""gpudra benchmarks: ``python -m bench [name ...]`` runs every bench module in this folder (or the
named ones) and prints one table and one JSON document. See bench/README.md for the convention:

    async def run(ctx: bench.Context) -> list[bench.Result]

A module may instead expose ``main() -> dict`` (run in a thread; its numeric values become rows).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Result:
    """One row of the table. ``ok`` is None when the metric has no target."""

    metric: str
    value: float
    unit: str
    target: str = ""
    ok: bool | None = None
    note: str = ""
    bench: str = ""  # filled in by the runner: the module name

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def at_most(metric: str, value: float, unit: str, limit: float, note: str = "") -> Result:
    return Result(metric, value, unit, f"<= {limit:g}", value <= limit, note)


def median(samples: list[float]) -> float:
    return statistics.median(samples)


@dataclass
class Context:
    """What the runner gives every bench module: a scratch dir, a repetition count, and one local
    control plane shared by all modules of the run (started on first use, stopped at the end)."""

    repeat: int = 10
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="gpudra-bench-")))
    _plane: Any = None
    _api: Any = None
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def workdir(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    async def control_plane(self) -> Any:
        """A started ``gpudra_dev.localcluster.controlplane.ControlPlane``."""
        async with self._lock:
            if self._plane is None:
                from gpudra_dev.localcluster.controlplane import ControlPlane, find_binaries

                plane = ControlPlane(find_binaries(), self.root / "cluster")
                await asyncio.to_thread(plane.start)
                self._plane = plane
            return self._plane

    async def kube(self, field_manager: str = "gpudra-bench") -> Any:
        """A ``gpudra_core.kubeapi.Kube`` on the shared control plane."""
        from gpudra_core.kubeapi import Kube, connect

        plane = await self.control_plane()
        if self._api is None:
            self._api = await connect(str(plane.kubeconfig))
        return Kube(self._api, field_manager)

    async def close(self) -> None:
        if self._api is not None:
            await self._api.close()
        if self._plane is not None:
            await asyncio.to_thread(self._plane.stop)
