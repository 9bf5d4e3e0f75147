"""Reading the local API server's audit log (``ControlPlane(audit_log=True)``: one JSON line per
request, at ResponseComplete, written before the response is sent). Benches count requests with
it; tests tell from it which client wrote what, and when."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

READS = frozenset({"get", "list", "watch"})


class AuditLog:
    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0

    def mark(self) -> None:
        """Later reads see only what was logged from now on (from the end of the last whole line:
        the API server may be halfway through writing one)."""
        data = self.path.read_bytes()
        self.offset = data.rfind(b"\n") + 1

    def entries(self, *, user: str | None = None, user_agent: str | None = None) -> Iterator[dict[str, Any]]:
        """The requests logged since the mark; those of ``user`` (the authenticated name) and
        ``user_agent`` (a prefix) when given."""
        with self.path.open("rb") as f:
            f.seek(self.offset)
            for line in f:
                if not line.endswith(b"\n"):  # still being written: not logged yet
                    break
                entry = json.loads(line)
                if entry.get("stage") != "ResponseComplete":
                    continue
                if user is not None and (entry.get("user") or {}).get("username") != user:
                    continue
                if user_agent is not None and not (entry.get("userAgent") or "").startswith(user_agent):
                    continue
                yield entry

    def verbs(self, **who: str) -> dict[str, int]:
        """Requests since the mark by verb (get, list, watch, create, update, patch, delete)."""
        return dict(Counter(e["verb"] for e in self.entries(**who)))

    def writes(self, **who: str) -> list[dict[str, Any]]:
        return [e for e in self.entries(**who) if e["verb"] not in READS]


def is_dry_run(entry: dict[str, Any]) -> bool:
    return "dryRun=All" in entry.get("requestURI", "")


def received(entry: dict[str, Any]) -> float:
    """When the API server received the request (Unix time)."""
    return datetime.fromisoformat(entry["requestReceivedTimestamp"].replace("Z", "+00:00")).timestamp()
