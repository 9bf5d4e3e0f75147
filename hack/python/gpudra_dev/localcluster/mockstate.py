"""What the mock driver tools of a fake driver root did: their shared state and call log, and the
mock MPS control daemons they left running.

The mock ``libnvidia-ml.so.1``, ``nvidia-smi`` and ``nvidia-cuda-mps-control`` (``tests/mocknvml``,
laid out by :func:`~gpudra_dev.localcluster.fakedriverroot.make_driver_root`) run in different
processes but model one machine: what one sets, the others read, from files under
``<root>/run/gpudra-mock`` (each mock finds ``<root>`` from its own path; the format is documented
in ``tests/mocknvml/mock_state.h``)::

    state/<GPU uuid>/compute_mode    NVML compute mode (absent: 0, DEFAULT)
    state/<GPU uuid>/timeslice       nvidia-smi compute-policy time slice 0-3 (absent: 0)
    mps/<pid>                        a running mock MPS control daemon: pipe, log and devices
    calls.log                        one line per successful call, e.g. ``nvml SetComputeMode GPU-… 3``
    events                           health injected by a test while NVML runs (:func:`inject_xid`,
                                     :func:`inject_ecc`, :func:`lose_gpu`, :func:`set_recovery_action`,
                                     :func:`recover_gpu`), read by the mock library and the Python
                                     simulator alike (``tests/mocknvml/mock_nvml.c`` has the format)

Tests assert on :func:`calls` and the getters, and end every MPS test with
:func:`kill_mps_daemons`, which leaves no daemon behind whatever the test did.
"""

from __future__ import annotations

import os
import select
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "mig_devices",
    "MPS_CONTROL",
    "STATE_DIR",
    "STATE_ENV",
    "MpsDaemon",
    "EVENTS_FILE",
    "calls",
    "compute_mode",
    "inject_ecc",
    "inject_xid",
    "lose_gpu",
    "recover_gpu",
    "set_recovery_action",
    "kill_mps_daemons",
    "mps_daemons",
    "state_dir",
    "timeslice",
    "wait_exited",
]

STATE_DIR = Path("run/gpudra-mock")  # relative to the driver root
STATE_ENV = "GPUDRA_MOCK_STATE_DIR"  # read by the mocks: the state directory instead of <root>/run/gpudra-mock
EVENTS_FILE = "events"  # in the state directory: the health lines the mocks read
MPS_CONTROL = Path("usr/bin/nvidia-cuda-mps-control")
MPS_PID_FILE = "nvidia-cuda-mps-control.pid"  # in the pipe directory, as the real daemon writes it
MPS_ENDPOINT_FILES = ("control", "control_lock", MPS_PID_FILE)


def state_dir(root: Path) -> Path:
    """Where the mocks of ``root`` keep their state (unless they run with ``$GPUDRA_MOCK_STATE_DIR``)."""
    return root / STATE_DIR


def calls(root: Path, tool: str | None = None) -> list[str]:
    """The lines of ``calls.log`` in order (none yet: ``[]``); only ``tool``'s (``nvml``,
    ``nvidia-smi``, ``mps-control``) when given."""
    try:
        lines = (state_dir(root) / "calls.log").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [line for line in lines if tool is None or line.split(" ", 1)[0] == tool]


def _gpu_value(root: Path, uuid: str, key: str) -> int:
    try:
        return int((state_dir(root) / "state" / uuid / key).read_text())
    except FileNotFoundError:
        return 0


def compute_mode(root: Path, uuid: str) -> int:
    """The GPU's compute mode as the mocks see it (``pynvml.NVML_COMPUTEMODE_*``)."""
    return _gpu_value(root, uuid, "compute_mode")


def timeslice(root: Path, uuid: str) -> int:
    """The GPU's time slice (0 DEFAULT, 1 SHORT, 2 MEDIUM, 3 LONG) as ``nvidia-smi compute-policy`` set it."""
    return _gpu_value(root, uuid, "timeslice")


# -- injected health ------------------------------------------------------------------------------

def _append_event(state: Path, line: str) -> None:
    """One line, in one write(2) on an O_APPEND descriptor: a reader never sees half of it."""
    state.mkdir(parents=True, exist_ok=True)
    fd = os.open(state / EVENTS_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    try:
        data = (line + "\n").encode()
        if os.write(fd, data) != len(data):
            raise OSError(f"short write to {state / EVENTS_FILE}")
    finally:
        os.close(fd)


def inject_xid(root: Path, uuid: str, xid: int) -> None:
    """An XID critical error on the GPU or MIG device ``uuid`` of the driver root ``root``."""
    _append_event(state_dir(root), f"xid {uuid} {int(xid)}")


def inject_ecc(root: Path, uuid: str) -> None:
    """A double-bit ECC error on the GPU or MIG device ``uuid``."""
    _append_event(state_dir(root), f"ecc {uuid}")


def lose_gpu(root: Path, uuid: str) -> None:
    """The GPU ``uuid`` falls off the bus: NVML answers GPU_IS_LOST for it until :func:`recover_gpu`."""
    _append_event(state_dir(root), f"lost {uuid}")


def set_recovery_action(root: Path, uuid: str, action: int) -> None:
    """What NVML_FI_DEV_GET_GPU_RECOVERY_ACTION reads for the GPU ``uuid`` from now on
    (``pynvml.NVML_GPU_RECOVERY_ACTION_*``)."""
    _append_event(state_dir(root), f"action {uuid} {int(action)}")


def recover_gpu(root: Path, uuid: str) -> None:
    """The GPU ``uuid`` is back and healthy: not lost, recovery action NONE."""
    _append_event(state_dir(root), f"recover {uuid}")


# -- MPS control daemons --------------------------------------------------------------------------


@dataclass(frozen=True)
class MpsDaemon:
    pid: int
    pipe_dir: Path
    log_dir: Path
    devices: str  # CUDA_VISIBLE_DEVICES as the daemon got it; "all" when unset, "none" when empty
    serves: tuple[str, ...]  # the devices as UUIDs (indexes mapped by the inventory); ("all",) when unknown


def _is_daemon_of(pid: int, binary: str) -> bool:
    """Whether ``pid`` runs ``binary`` (also after make_driver_root replaced the file)."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False
    return exe.removesuffix(" (deleted)") == binary


def _binary(root: Path) -> str:
    return os.path.realpath(root / MPS_CONTROL)


def _registered(root: Path) -> dict[int, MpsDaemon]:
    daemons = {}
    registry = state_dir(root) / "mps"
    for entry in registry.glob("[0-9]*") if registry.is_dir() else ():
        try:
            fields = dict(line.split(" ", 1) for line in entry.read_text().splitlines() if " " in line)
        except FileNotFoundError:
            continue  # the daemon quit meanwhile
        pid = int(entry.name)
        serves = fields.get("serves", "none")
        daemons[pid] = MpsDaemon(pid, Path(fields.get("pipe", "")), Path(fields.get("log", "")),
                                 fields.get("devices", ""), () if serves == "none" else tuple(serves.split(",")))
    return daemons


def mps_daemons(root: Path) -> list[MpsDaemon]:
    """The mock MPS control daemons of ``root`` that are running, by PID."""
    binary = _binary(root)
    return sorted((d for d in _registered(root).values() if _is_daemon_of(d.pid, binary)), key=lambda d: d.pid)


def wait_exited(pid: int, timeout: float) -> bool:
    """Wait until ``pid`` (any process, not only a child) has exited; False on timeout."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([fd], [], [], timeout)
        return bool(readable)
    finally:
        os.close(fd)


def _kill(pid: int, binary: str, deadline: float) -> bool:
    """SIGKILL ``pid`` if it still runs ``binary`` (checked through a pidfd, so a reused PID is
    never hit) and wait for it to exit. Whether it was killed."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    try:
        if not _is_daemon_of(pid, binary):
            return False
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        readable, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not readable:
            raise TimeoutError(f"mock MPS control daemon {pid} did not exit after SIGKILL")
        return True
    finally:
        os.close(fd)


def _remove_leftovers(daemon: MpsDaemon) -> None:
    """What a killed daemon leaves: its endpoint files (if still its own) and its registry entry."""
    try:
        owner = int((daemon.pipe_dir / MPS_PID_FILE).read_text())
    except (OSError, ValueError):
        owner = daemon.pid
    if owner == daemon.pid:
        for name in MPS_ENDPOINT_FILES:
            (daemon.pipe_dir / name).unlink(missing_ok=True)


def kill_mps_daemons(root: Path, timeout: float = 10.0) -> list[int]:
    """Kill every mock MPS control daemon started from ``root`` (registered, or found in /proc by
    its executable), wait until each has exited, and remove what they leave behind (endpoint files,
    registry entries). Returns the PIDs killed; ``[]`` means none was running."""
    deadline = time.monotonic() + timeout
    binary = _binary(root)
    registered = _registered(root)
    running = set(registered)
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _is_daemon_of(int(entry), binary):
            running.add(int(entry))
    killed = [pid for pid in sorted(running) if _kill(pid, binary, deadline)]
    for pid, daemon in registered.items():
        if pid in killed or not _is_daemon_of(pid, binary):
            _remove_leftovers(daemon)
            (state_dir(root) / "mps" / str(pid)).unlink(missing_ok=True)
    return killed


def mig_devices(nvml: Any, gpu_index: int = 0) -> list[tuple[int, int]]:
    """(GPU instance, compute instance) of each MIG device on GPU ``gpu_index``, as ``nvml`` (pynvml
    on a mock library, or the simulator) lists them now, sorted."""
    nvml.nvmlInit()
    try:
        gpu = nvml.nvmlDeviceGetHandleByIndex(gpu_index)
        found = []
        for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(gpu)):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, slot)
            except (nvml.NVMLError_NotFound, nvml.NVMLError_InvalidArgument):
                continue
            found.append((int(nvml.nvmlDeviceGetGpuInstanceId(mig)), int(nvml.nvmlDeviceGetComputeInstanceId(mig))))
        return sorted(found)
    finally:
        nvml.nvmlShutdown()
