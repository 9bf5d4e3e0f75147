"""Kubernetes resource quantities (``64Gi``, ``500m``, ``1e9``): one parser and one formatter, with
apimachinery's semantics, for every place that reads or writes one.

Grammar (``resource.ParseQuantity``): an optional sign, digits with an optional fraction (``1``,
``1.5``, ``.5``, ``1.``), then at most one suffix: binary ``Ki Mi Gi Ti Pi Ei`` (powers of 1024),
decimal ``n u m k M G T P E`` (powers of 1000; ``E`` is exa, not an exponent), or an integer
exponent ``e3``/``E-3``. The value is exact, rounded up (away from zero) to a whole nano, as the
API server stores it. No library fits: kubernetes_asyncio has no parser, and the sync client's
``kubernetes.utils.parse_quantity`` accepts what the API server refuses (``1K``, ``NaN``, ``1_0``)."""

from __future__ import annotations

import re
from decimal import MAX_EMAX, MIN_EMIN, ROUND_UP, Context, Decimal
from typing import Any

_QUANTITY = re.compile(
    r"(?P<number>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?:(?P<binary>[KMGTPE]i)|(?P<decimal>[numkMGTPE])|[eE](?P<exponent>[+-]?[0-9]+))?")
_BINARY_POWERS = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}  # of 1024
_DECIMAL_EXPONENTS = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BINARY_SUFFIXES = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
_DECIMAL_SUFFIXES = ("", "k", "M", "G", "T", "P", "E")
_NANO = Decimal("1e-9")
_MAX_EXPONENT = 2**31 - 1


def parse_quantity(text: str) -> Decimal:
    """The exact value of the quantity ``text``; ``ValueError`` when it is not one."""
    match = _QUANTITY.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"{text!r} is not a Kubernetes quantity (e.g. 64Gi, 80G, 500m, 1e9)")
    number = Decimal(match["number"])
    # Exact arithmetic: digits for the mantissa and the largest multiplier (1024**6), no exponent bound.
    exact = Context(prec=len(text) + 40, Emax=MAX_EMAX, Emin=MIN_EMIN)
    if match["binary"]:
        value = exact.multiply(number, Decimal(1024 ** _BINARY_POWERS[match["binary"]]))
    else:
        exponent = int(match["exponent"]) if match["exponent"] else _DECIMAL_EXPONENTS.get(match["decimal"] or "", 0)
        if abs(exponent) > _MAX_EXPONENT:  # apimachinery keeps the exponent in an int32
            raise ValueError(f"{text!r}: exponent out of range")
        value = number.scaleb(exponent, exact)
    digits = value.as_tuple().exponent
    if isinstance(digits, int) and digits < -9:  # finer than a nano: the API server rounds up
        value = value.quantize(_NANO, ROUND_UP, exact)
    return value


def is_quantity(text: str) -> bool:
    """True when ``text`` parses as a quantity."""
    try:
        parse_quantity(text)
    except ValueError:
        return False
    return True


def quantity_value(value: Any) -> Decimal | None:
    """The number a quantity stands for, given as the API carries it (``"1Gi"``, ``"500m"`` or a
    JSON integer); None for anything else, a boolean included."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return None
    try:
        return parse_quantity(str(value))
    except ValueError:
        return None


def format_quantity(amount: int, *, binary: bool) -> str:
    """An exact integer as the canonical Kubernetes quantity string, the form the API server
    returns, so desired and observed objects compare equal: bytes in BinarySI
    (85520809984 -> "81559Mi", 42949672960 -> "40Gi", below 1024 or not a multiple -> decimal),
    counts in DecimalSI (14 -> "14", 2000 -> "2k")."""
    if amount < 0:
        raise ValueError("quantities here are non-negative")
    if binary and amount >= 1024:
        for power in range(len(_BINARY_SUFFIXES) - 1, 0, -1):
            if amount % 1024**power == 0:
                return f"{amount // 1024**power}{_BINARY_SUFFIXES[power]}"
    if amount == 0:
        return "0"
    power = 0
    while power < len(_DECIMAL_SUFFIXES) - 1 and amount % 1000 ** (power + 1) == 0:
        power += 1
    return f"{amount // 1000**power}{_DECIMAL_SUFFIXES[power]}"
