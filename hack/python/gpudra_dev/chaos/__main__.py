"""`make chaos`: one chaos run, its report on stdout; exit status 1 on any invariant violation.

CHAOS_SEED reproduces a run's schedule (default: a new seed, printed first), CHAOS_DURATION sets
its seconds of faults and load (default 600), CHAOS_NODES its number of nodes (default 3),
CHAOS_REAL_NODES how many of them are real (the kubelet on containerd + runc, from tests/realruntime.py:
tests/ on PYTHONPATH, as make chaos puts it; default 1), CHAOS_KEEP=1 keeps its directory (logs of
every component) for a look afterwards."""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from .run import ChaosRun, settings_from_environment


def main() -> int:
    logging.basicConfig(level=os.environ.get("CHAOS_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings_from_environment(default_duration=600)
    report = asyncio.run(ChaosRun(settings, say=lambda line: print(line, flush=True)).run())
    print(report.render(), flush=True)
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
