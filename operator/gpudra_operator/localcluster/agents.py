"""Node agents as local subprocesses, one per fake Node, on simulated NVML: what a DaemonSet pod
would run on a real GPU node, minus the container."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class AgentProcess:
    node_name: str
    log_path: Path
    process: subprocess.Popen[bytes]

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_agent(*, kubeconfig: Path, node_name: str, nvml: str, driver: str, workdir: Path,
                extra_args: tuple[str, ...] = (), rescan_interval: float = 60.0) -> AgentProcess:
    """Start ``gpudra agent`` for ``node_name``; its kubelet and CDI directories live in ``workdir``."""
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "agent.log"
    argv = [sys.executable, "-m", "gpudra_operator.cli", "agent", "--driver", driver,
            "--node-name", node_name, "--nvml", nvml, "--kubeconfig", str(kubeconfig),
            "--rescan-interval", str(rescan_interval),
            "--kubelet-dir", str(workdir / "kubelet"), "--cdi-dir", str(workdir / "cdi"), *extra_args]
    with log_path.open("ab") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return AgentProcess(node_name, log_path, process)
