"""The operator as a local subprocess (`gpudra operator`), as tests, the demo and the benchmarks
run it: its own log file, its own kubeconfig, stopped by PID."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpudra_dev.localcluster.processes import dying_with_parent, stop_process


@dataclass
class OperatorProcess:
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_count(self, text: str) -> int:
        return self.log().count(text)

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def stop(self, timeout: float = 20) -> int:
        return stop_process(self.process, timeout=timeout)


def start_operator(*, kubeconfig: Path, log_path: Path, args: Sequence[str] = ("--liveness-port", "0"),
                   env: Mapping[str, str] | None = None) -> OperatorProcess:
    """Start ``gpudra operator <args>`` with ``KUBECONFIG=kubeconfig`` and ``env`` added."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            dying_with_parent([sys.executable, "-m", "gpudra.cli", "operator", *args]),
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1", **(env or {})})
    return OperatorProcess(process, log_path)
