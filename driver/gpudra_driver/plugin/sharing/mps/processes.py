"""Which process is which: a record of a process the MPS supervisor started (PID, start time,
executable), checked against the process now behind that PID, and signals sent only through a
pidfd opened on the recorded process (:mod:`gpudra_driver.plugin.sharing.mps.supervisor`). A PID a tenant wrote
down, or a PID reused since, is never signalled."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import time
from dataclasses import dataclass
from typing import Any

from gpudra_core.procstat import stat_fields, stat_line_fields


@dataclass(frozen=True)
class ProcessRecord:
    """A process as the supervisor saw it when it started it: what makes it that process and no
    other. A PID is reused; a PID with the same start time (clock ticks since boot) is not."""

    pid: int
    start_time: int
    exe: str

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "startTime": self.start_time, "exe": self.exe}

    @classmethod
    def from_json(cls, data: Any) -> ProcessRecord:
        if not isinstance(data, dict) or type(data.get("pid")) is not int or data["pid"] <= 0 \
                or type(data.get("startTime")) is not int or not isinstance(data.get("exe"), str):
            raise ValueError(f"{data!r} is not a process record")
        return cls(data["pid"], data["startTime"], data["exe"])


def start_time_of(stat: bytes) -> int:
    """Field 22 (starttime) of a ``/proc/<pid>/stat`` line."""
    return int(stat_line_fields(stat)[19])


def _executable(path: str) -> str:
    return path.removesuffix(" (deleted)")  # replaced on disk since (a driver upgrade): still that file's process


def same_process(record: ProcessRecord, observed: ProcessRecord | None) -> bool:
    """Whether ``observed`` (the process now behind ``record.pid``) is the one recorded."""
    return observed is not None and observed.pid == record.pid and observed.start_time == record.start_time \
        and _executable(observed.exe) == _executable(record.exe)


def observe(pid: int) -> ProcessRecord | None:
    """The process now behind ``pid``; None when there is none (or a zombie, which has exited)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            line = stat.read()
        exe = os.readlink(f"/proc/{pid}/exe")
        if stat_line_fields(line)[0] == b"Z":
            return None
        return ProcessRecord(pid, start_time_of(line), exe)
    except (OSError, IndexError, ValueError):
        return None


def open_recorded(record: ProcessRecord, executable: str | None = None) -> int | None:
    """A pidfd on the recorded process, or None if it is gone (or the PID is another process's
    now, or, with ``executable``, the record names another program). Checked after the pidfd is
    open: the pidfd pins the process it was opened on, so a match then means every signal sent
    through it reaches the recorded process."""
    if executable is not None and _executable(record.exe) != os.path.realpath(executable):
        return None
    try:
        fd = os.pidfd_open(record.pid)
    except OSError:  # ProcessLookupError: gone
        return None
    if same_process(record, observe(record.pid)):
        return fd
    os.close(fd)
    return None


def exited(pidfd: int) -> bool:
    return bool(select.select([pidfd], [], [], 0)[0])  # a pidfd is readable once its process exited


async def wait_exited(pidfd: int, timeout: float) -> bool:
    """Whether the process of ``pidfd`` exited within ``timeout`` seconds (on the event loop: no thread)."""
    if exited(pidfd):
        return True
    loop = asyncio.get_running_loop()
    gone: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not gone.done():
            gone.set_result(None)

    loop.add_reader(pidfd, readable)
    try:
        await asyncio.wait_for(gone, timeout)
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(pidfd)


def _parent_of(pid: int | str) -> int | None:
    fields = stat_fields(pid)
    return int(fields[1]) if fields else None  # field 4: ppid


def _children(pid: int) -> list[int]:
    """The PIDs whose parent is ``pid`` now (one pass over /proc; one gone meanwhile has none)."""
    return [int(entry.name) for entry in os.scandir("/proc")
            if entry.name.isdigit() and _parent_of(entry.name) == pid]


def _descendants(pidfd: int, pid: int, depth: int = 4) -> list[int]:
    """pidfds on the processes below the live process of ``pidfd``, each opened and then checked
    to be a child of its (still live, still pinned) parent, so none is a reused PID. An MPS server
    that left its control daemon's process group (setsid) is found here."""
    if depth == 0 or exited(pidfd):
        return []
    pinned: list[int] = []
    for child in _children(pid):
        try:
            fd = os.pidfd_open(child)
        except OSError:
            continue
        if _parent_of(child) == pid and not exited(pidfd):
            pinned += [fd, *_descendants(fd, child, depth - 1)]
        else:
            os.close(fd)
    return pinned


STOP_WAIT = 0.2  # seconds kill_group waits for a SIGSTOPped process to be stopped


def _stopped(pid: int) -> bool:
    fields = stat_fields(pid)
    return fields is not None and fields[0] in (b"T", b"t")  # field 3: state


def kill_group(pidfd: int, pid: int) -> None:
    """SIGKILL to the process of ``pidfd`` (whose PID is ``pid``), to every process below it, and,
    when it leads a process group of its own (a session leader: the supervisor starts each daemon
    in a new session), to that group: the MPS servers a control daemon started, which would
    otherwise keep its GPUs. The processes below are pinned by pidfds before anything is killed
    (a killed parent's children are re-parented). The group is signalled only while its leader is
    alive and is that process (the pidfd says so), so the group ID cannot be another's: a PID in
    use as a group ID is never handed out. The process is stopped (SIGSTOP, through its pidfd)
    before its children are looked for: a live daemon could otherwise start another server, in a
    session of its own, after the scan and before its kill, and that server would be reached by
    neither. A fork in flight when the stop arrives still completes, its child visible only then,
    so the scan waits (at most :data:`STOP_WAIT`: a process stuck in the kernel may never stop)
    for the process to be stopped."""
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGSTOP)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + STOP_WAIT
    while not _stopped(pid) and not exited(pidfd) and time.monotonic() < deadline:
        time.sleep(0.001)  # a state change: nothing to wait on but /proc
    below = _descendants(pidfd, pid)
    try:
        for fd in below:
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except ProcessLookupError:
                pass
    finally:
        for fd in below:
            os.close(fd)
    if not exited(pidfd):
        fields = stat_fields(pid)
        if fields and int(fields[2]) == pid and not exited(pidfd):  # field 5: pgrp
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass
