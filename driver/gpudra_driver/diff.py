"""Compare desired state with what the API server holds, so unchanged objects cost no write."""

from __future__ import annotations

from typing import Any


def contains(live: Any, desired: Any) -> bool:
    """True when every field set in ``desired`` has the same value in ``live``.

    Fields only ``live`` has (server defaults, status, other managers' fields) are ignored; lists
    must match element by element, as the atomic lists of DRA objects are replaced whole."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and contains(live[k], v) for k, v in desired.items())
    if isinstance(desired, list):
        return (isinstance(live, list) and len(live) == len(desired)
                and all(contains(a, b) for a, b in zip(live, desired)))
    return live == desired
