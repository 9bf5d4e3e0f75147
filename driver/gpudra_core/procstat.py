"""``/proc/<pid>/stat``, read the one way both components need it: the agent to recognise the
processes it started (MPS daemons), the operator to watch its template workers."""

from __future__ import annotations


def stat_line_fields(stat: bytes) -> list[bytes]:
    """The fields of a ``/proc/<pid>/stat`` line after the command name (field 2), which may hold
    spaces and parentheses: they are counted after its last ')'. Field n is index n - 3."""
    return stat.rsplit(b")", 1)[1].split()


def stat_fields(pid: int | str) -> list[bytes] | None:
    """The fields of process ``pid``'s ``/proc/<pid>/stat`` after the command name (field n is
    index n - 3); None when it is gone or the line cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat_line_fields(stat.read())
    except (OSError, IndexError):
        return None
