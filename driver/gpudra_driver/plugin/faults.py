"""A test-only fault hook: ``GPUDRA_FAULT=<point>`` makes the agent SIGKILL itself at that point,
so tests can prove that a crash anywhere loses nothing and leaves nothing behind.

Points: ``after-checkpoint-started``, ``after-mig-instance`` (a dynamic MIG instance made, not
recorded yet), ``after-mig-mode-off`` (a dynamic GPU's MIG mode turned off for a claim of its whole
GPU, not recorded as done yet), ``after-metadata-write`` (a claim's device metadata files written,
its CDI spec not yet), ``after-cdi-write``, ``after-checkpoint-completed``,
``unprepare-after-checkpoint``. Unset (always, outside tests): a no-op."""

from __future__ import annotations

import os
import signal

POINTS = ("after-checkpoint-started", "after-mig-instance", "after-mig-mode-off", "after-metadata-write", "after-cdi-write",
          "after-checkpoint-completed", "unprepare-after-checkpoint")


class FaultHook:
    def __init__(self, point: str | None = None) -> None:
        point = point if point is not None else os.environ.get("GPUDRA_FAULT", "")
        if point and point not in POINTS:
            raise ValueError(f"GPUDRA_FAULT={point!r}: known points are {', '.join(POINTS)}")
        self.point = point or None

    def __call__(self, point: str) -> None:
        if point == self.point:
            os.kill(os.getpid(), signal.SIGKILL)
