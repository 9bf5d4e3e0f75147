"""Kubernetes resource quantities (``64Gi``, ``500m``, ``1e9``): one parser and one formatter, with
apimachinery's semantics, for every place that reads or writes one.

Grammar, as ``resource.ParseQuantity`` (apimachinery pkg/api/resource/quantity.go) reads it:
``[sign] [digits] [. [digits]] [suffix]``. Every part may be empty, so a number without digits
(``+``, ``.``, ``-.``, ``Mi``, ``m``, ``e3``) is 0; the empty string is not a quantity. The suffix is
binary ``Ki Mi Gi Ti Pi Ei`` (powers of 1024), decimal ``n u m k M G T P E`` (powers of 1000; ``E``
is exa, not an exponent), or an exponent ``e``/``E`` with an int64 (``e3``, ``E-3``, ``e+0``) that is
kept modulo 2**32 as an int32 (``1e4294967296`` is 1). Nothing else: no spaces, ``K``, ``ki``,
``1.2.3``, ``NaN``, ``1_0``.

Which digit-less numbers pass depends on ParseQuantity's two paths. Its int64 fast path takes a
decimal suffix up to 18 digits whose scale (the exponent less the fraction's length) is at least
nano, or ``Ki``/``Mi``/``Gi``/``Ti`` on a short integer, and reads an empty number as 0; every other
quantity goes through ``inf.Dec.SetString`` of the number's own text, which needs a digit, so
``Pi``, ``Ei``, ``+Pi``, ``e-10`` and ``.e-10`` are refused while ``Ti``, ``n`` and ``e-9`` pass.

The value is exact, rounded up (away from zero) to a whole nano, as the API server stores it,
including the int32 wrap of the scale arithmetic. It is not capped: BinarySI values above the int64
maximum stay as written; Kubernetes caps them at the int64 maximum, and callers that compare
with Kubernetes' value apply that cap (tests/unit/test_quantity_oracle.py).
No library fits: kubernetes_asyncio has no parser, and the sync client's
``kubernetes.utils.parse_quantity`` accepts what the API server refuses (``1K``, ``NaN``, ``1_0``)."""

from __future__ import annotations

import re
from decimal import MAX_EMAX, MIN_EMIN, ROUND_UP, Context, Decimal
from typing import Any, NamedTuple

from gpudra_core.limits import INT64_MAX, INT64_MIN

_DIGITS = frozenset("0123456789")  # ASCII only: str.isdigit and int() take other scripts' digits too
_SUFFIX_LETTERS = frozenset("eEinumkKMGTP")
_EXPONENT = re.compile(r"[+-]?[0-9]+")  # what strconv.ParseInt(s, 10, 64) reads, before its range check
_BINARY_EXPONENTS = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}  # of 2
_DECIMAL_EXPONENTS = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BINARY_SUFFIXES = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
_DECIMAL_SUFFIXES = ("", "k", "M", "G", "T", "P", "E")
_NANO = -9  # resource.Nano, the finest scale a quantity keeps
_MAX_INT64_FACTORS = 18  # math.go maxInt64Factors: decimal digits that always fit an int64


class _Parts(NamedTuple):
    """parseQuantityString's results: ``value`` is the number's text as written (sign, digits and
    point; "0" for a string of zeros), ``num`` its integer digits without leading zeros ("0" when
    none), ``denom`` its fraction digits."""

    positive: bool
    value: str
    num: str
    denom: str
    suffix: str


def _int32(number: int) -> int:
    """``number`` as Go's int32 holds it: modulo 2**32, two's complement."""
    return (number + 2**31) % 2**32 - 2**31


def _scan_digits(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _DIGITS:
        pos += 1
    return pos


def _split(text: str) -> _Parts | None:
    """quantity.go ``parseQuantityString``; None for its ``ErrFormatWrong``."""
    end = len(text)
    positive = not text.startswith("-")
    pos = 1 if text[:1] in ("+", "-") else 0
    while pos < end and text[pos] == "0":  # leading zeros
        pos += 1
    if pos == end:  # nothing but a sign and zeros (or not even those)
        return _Parts(positive, "0", "0", "", "")
    start, pos = pos, _scan_digits(text, pos)
    num = text[start:pos]
    if pos == end:
        return _Parts(positive, text, num, "", "")
    num = num or "0"
    denom = ""
    if text[pos] == ".":
        start = pos + 1
        pos = _scan_digits(text, start)
        denom = text[start:pos]  # may be empty: "1.", "1.G" and "." pass
        if pos == end:
            return _Parts(positive, text, num, denom, "")
    value, suffix_start = text[:pos], pos
    while pos < end and text[pos] in _SUFFIX_LETTERS:  # any run of suffix letters, judged later
        pos += 1
    if pos < end and text[pos] in ("+", "-"):  # then an exponent's sign and digits
        pos += 1
    if _scan_digits(text, pos) != end:
        return None
    return _Parts(positive, value, num, denom, text[suffix_start:])


def _interpret(suffix: str) -> tuple[int, int] | None:
    """suffix.go ``quantitySuffixer.interpret`` (``fastLookup``, then ``suffixHandler``): the base (10
    or 2) and its exponent; None for ``ErrSuffix``. An ``e`` exponent is parsed as an int64 and
    then converted to int32, so it wraps."""
    if suffix in _DECIMAL_EXPONENTS:
        return 10, _DECIMAL_EXPONENTS[suffix]
    if suffix in _BINARY_EXPONENTS:
        return 2, _BINARY_EXPONENTS[suffix]
    if len(suffix) > 1 and suffix[0] in "eE" and _EXPONENT.fullmatch(suffix[1:]):
        sign = "-" if suffix[1] == "-" else ""
        digits = suffix[1:].lstrip("+-").lstrip("0") or "0"  # int() refuses more than 4300 digits
        parsed = int(sign + digits) if len(digits) <= 19 else None
        if parsed is not None and INT64_MIN <= parsed <= INT64_MAX:
            return 10, _int32(parsed)
    return None


def _int64_path(parts: _Parts, base: int, exponent: int, exact: Context) -> Decimal | None:
    """ParseQuantity's fast path (an ``int64Amount``): the value when it applies, else None for the
    ``inf.Dec`` path. Scales are int32, as there."""
    if base == 10:
        scale, mantissa = exponent, 1
        precision = _MAX_INT64_FACTORS - (len(parts.num) + len(parts.denom))
    elif not parts.denom:  # binary: only integers (exponent >= 0 always holds for the suffixes)
        scale, mantissa = 0, 1 << exponent
        # "1Mi (2^20) has ~6 digits of decimal precision": int32(float32(exponent)*3/10), exact here
        precision = 15 - len(parts.num) - exponent * 3 // 10 - 1
    else:
        return None
    if precision < 0:
        return None
    scale = _int32(scale - len(parts.denom))
    if scale < _NANO:
        return None
    shifted = int(parts.num + parts.denom)
    if shifted > INT64_MAX:  # strconv.ParseInt fails: ErrNumeric (never within the precision checked)
        raise ValueError(f"{parts.value!r}: the quantity's number does not fit an int64")
    product = shifted * mantissa
    if product > INT64_MAX:  # int64Multiply overflows: the inf.Dec path takes it
        return None
    return Decimal(product if parts.positive else -product).scaleb(scale, exact)


def _dec_path(parts: _Parts, base: int, exponent: int, exact: Context) -> Decimal | None:
    """ParseQuantity's ``inf.Dec`` path; None when ``inf.Dec.SetString(value)`` refuses the number's
    text, which it does when there is no digit in it (``Ei``, ``+Pi``, ``-.e-10``)."""
    if not _DIGITS.intersection(parts.value):
        return None
    integer, _, fraction = parts.value.partition(".")
    # A sign, then ASCII digits. Decimal, not int: int() refuses more than 4300 digits.
    unscaled = Decimal(integer + fraction)
    scale = len(fraction)  # inf.Dec: value = unscaled * 10**-scale, the scale an int32
    if base == 10:
        scale = _int32(scale + _int32(-exponent))  # SetScale(Scale() + Scale(exponent).infScale())
    else:
        unscaled = exact.multiply(unscaled, Decimal(2**exponent))  # UnscaledBig() * 2**exponent
    negative, unscaled = unscaled.is_signed(), unscaled.copy_abs()
    if not unscaled:
        return Decimal(0)
    # amount.Round(amount, Nano.infScale(), inf.RoundUp): inf's quoRem shifts the unscaled integer
    # by the int32 ``9 - scale`` (which wraps below a scale of -2147483638) and rounds the
    # quotient away from zero; rounding never applies at or above a nano.
    shift = _int32(-_NANO - scale)
    rounded = Decimal(unscaled).scaleb(shift, exact)
    if shift < 0:
        rounded = rounded.quantize(Decimal(1), ROUND_UP, exact)
    value = rounded.scaleb(_NANO, exact)
    return value.copy_negate() if negative else value  # exact: unary minus would round to 28 digits


def parse_quantity(text: str) -> Decimal:
    """The exact value of the quantity ``text``, as ``resource.ParseQuantity`` reads it, before its
    BinarySI cap at the int64 maximum; ``ValueError`` when it is not one."""
    parts = _split(text) if isinstance(text, str) and text else None
    interpreted = _interpret(parts.suffix) if parts is not None else None
    if parts is None or interpreted is None:
        raise ValueError(f"{text!r} is not a Kubernetes quantity (e.g. 64Gi, 80G, 500m, 1e9)")
    base, exponent = interpreted
    # Exact arithmetic: digits for the mantissa and the largest multiplier (2**60), any exponent.
    exact = Context(prec=len(text) + 40, Emax=MAX_EMAX, Emin=MIN_EMIN)
    value = _int64_path(parts, base, exponent, exact)
    if value is None:
        value = _dec_path(parts, base, exponent, exact)
    if value is None:
        raise ValueError(f"{text!r} is not a Kubernetes quantity: a number without digits here")
    return value if value else Decimal(0)


def int64_value(text: str) -> int:
    """``text`` as apimachinery's ``Quantity.Value()`` gives it: the value ParseQuantity stores
    (BinarySI capped at the int64 maximum), rounded up away from zero to a whole number;
    ``ValueError`` when ``text`` is not a quantity or its value lies beyond int64.

    The range is judged on the exact value's digits and exponent (a Decimal compared with an int
    looks at the exponent of the most significant digit first), and an integer is built only for
    a value known to fit: building one for ``1e300000`` takes seconds, for ``1e2147483647`` it
    never ends. Parsing itself costs time linear in the text, so callers bound its length."""
    value = parse_quantity(text)
    if text.endswith("i") and abs(value) > INT64_MAX:  # quantity.go: "The max is just a simple cap"
        value = Decimal(INT64_MAX).copy_sign(value)
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{text[:40]!r} is beyond the int64 range of a quantity's value")
    return int(value.to_integral_value(ROUND_UP))


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
