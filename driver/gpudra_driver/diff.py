"""Compare desired state with what the API server holds, so unchanged objects cost no write."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+|[KMGTPE]i|[numkMGTPE])?$")
_SUFFIX: dict[str, int | Decimal] = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}


def quantity_value(value: Any) -> Decimal | None:
    """The number a Kubernetes quantity stands for (``"1Gi"``, ``"500m"``, ``2``); None otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return None
    match = _QUANTITY.fullmatch(str(value))
    if not match:
        return None
    number, suffix = match.group(1), match.group(2) or ""
    try:
        if suffix[:1] in ("e", "E"):
            return Decimal(number + suffix)
        return Decimal(number) * Decimal(_SUFFIX[suffix])
    except (InvalidOperation, KeyError):
        return None


def contains(live: Any, desired: Any) -> bool:
    """True when every field set in ``desired`` has the same value in ``live``.

    Fields only ``live`` has (server defaults, status, other managers' fields) are ignored; lists
    must match element by element, as the atomic lists of DRA objects are replaced whole. A
    quantity the server stored canonically (``"0.5"`` as ``"500m"``, ``1024Mi`` as ``1Gi``) equals
    what was asked for."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and contains(live[k], v) for k, v in desired.items())
    if isinstance(desired, list):
        return (isinstance(live, list) and len(live) == len(desired)
                and all(contains(a, b) for a, b in zip(live, desired)))
    if live == desired:
        return True
    wanted = quantity_value(desired)
    return wanted is not None and quantity_value(live) == wanted
