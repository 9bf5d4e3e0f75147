"""Stopping the local cluster's subprocesses (agents, operator, a test's kubelet) the same way."""

from __future__ import annotations

import signal
import subprocess


def stop_process(process: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 15) -> int:
    """Send ``sig`` (unless the process has exited), wait ``timeout`` seconds, then SIGKILL it;
    returns its exit status (negative: the signal that ended it)."""
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode
