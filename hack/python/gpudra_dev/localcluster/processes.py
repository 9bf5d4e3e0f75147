"""The local cluster's subprocesses (control plane, agents, operator, a test's kubelet): started so
that they die with whoever started them, and stopped the same way."""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Sequence


def dying_with_parent(argv: Sequence[str]) -> list[str]:
    """``argv``, run so that the kernel SIGKILLs it when the process that started it dies
    (``PR_SET_PDEATHSIG`` set by util-linux's ``setpriv``, which then execs ``argv``: same PID, and
    the setting survives the exec). A test run or demo killed outright (SIGKILL, an OOM kill, a CI
    timeout) then leaves no etcd, API server, agent or operator behind. Where ``setpriv`` is
    missing, ``argv`` runs as it is.

    The signal follows the *thread* that started the process: start these from a thread that
    lives as long as they should (the main thread, or an executor's worker)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--", *argv] if setpriv else list(argv)


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
