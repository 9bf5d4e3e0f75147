"""`gpudra-dev local-cluster up|down`: a real control plane on this machine, kept up until Ctrl-C."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

DEFAULT_STATE = Path(tempfile.gettempdir()) / "gpudra-local"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("local-cluster", help="run a local control plane (etcd, apiserver, "
                                   "controller-manager, scheduler) with fake Nodes")
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE,
                        help="where certificates, kubeconfig, logs and the pid file live (default: %(default)s)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    pid_file = args.state_dir / "local-cluster.pid"
    if args.action == "down":
        return _down(pid_file)
    return _up(args.state_dir, pid_file)


def _down(pid_file: Path) -> int:
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        print(f"no local cluster running ({pid_file} not found)")
        return 0
    try:
        os.kill(pid, signal.SIGTERM)
        print(f"sent SIGTERM to the local cluster (pid {pid}); it stops its processes and exits")
    except ProcessLookupError:
        pid_file.unlink(missing_ok=True)
        print("the local cluster had already exited")
    return 0


def _up(state_dir: Path, pid_file: Path) -> int:
    from .controlplane import ControlPlane, ControlPlaneError, find_binaries

    try:
        bin_dir = find_binaries()
    except ControlPlaneError as error:
        print(f"error: {error}")
        return 2
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text()), 0)
            print(f"a local cluster is already running (pid file {pid_file}); `gpudra-dev local-cluster down` first")
            return 1
        except (ProcessLookupError, ValueError):
            pid_file.unlink()
    workdir = Path(tempfile.mkdtemp(prefix="cluster-", dir=_ensure(state_dir)))
    plane = ControlPlane(bin_dir, workdir)
    print(f"[local-cluster] starting etcd, kube-apiserver, kube-controller-manager, kube-scheduler from {bin_dir}")
    started = time.monotonic()
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        plane.start()
        pid_file.write_text(str(os.getpid()))
        print(f"[local-cluster] ready in {time.monotonic() - started:.1f}s: {plane.server}")
        print(f"[local-cluster] logs: {workdir / 'logs'}")
        print(f"\n  export KUBECONFIG={plane.kubeconfig}\n  kubectl get --raw /readyz\n")
        print("[local-cluster] running; Ctrl-C (or `make demo-down`) stops it and removes its files")
        while not stop.wait(1.0):  # wakes for the signal handler; the event is the condition
            pass
    finally:
        plane.stop()
        pid_file.unlink(missing_ok=True)
        shutil.rmtree(workdir, ignore_errors=True)
        print("[local-cluster] stopped; every process and temporary file removed")
    return 0


def _ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
