"""gpudra_core.quantity against Kubernetes' own ``resource.ParseQuantity`` (through gpudra-allocator,
tests/kubecel.py: ``isQuantity`` and ``quantity`` of k8s.io/apiserver's CEL library call it): a
seeded generator of strings over the quantity alphabet (signs, digits, points, suffix letters,
exponents, odd combinations, long digit strings, int64 and int32 edges), and for each one
``is_quantity`` must equal ``isQuantity``, and an accepted one must have Kubernetes' value.

Without the helper binary the test fails with the command that builds it; it never skips."""

from __future__ import annotations

import random
from decimal import Decimal

from kubecel import ask

from gpudra_core.limits import INT64_MAX
from gpudra_core.quantity import is_quantity, parse_quantity

SEED = 1_35_4  # apimachinery v0.35.4
COUNT = 5000
DEVICE = {"driver": "d.io"}
ALPHABET = "+-.0123456789eEinumkKMGTP"
DECIMAL_SUFFIXES = ("n", "u", "m", "k", "M", "G", "T", "P", "E")
BINARY_SUFFIXES = ("Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
BAD_SUFFIXES = ("K", "ki", "KI", "mi", "ei", "iB", "B", "Mii", "mm", "kk", "ee", "eM", "Ee", "x", " ", "_", "\u0663")
INT64_EDGES = ("9223372036854775807", "9223372036854775808", "18446744073709551616", "999999999999999999",
               "1000000000000000000", "99999999999999", "999999999999999", "4611686018427387904")
# Exponents whose int32 wrap is cheap for Kubernetes (a small exponent or a number of zeros); a
# non-zero number with a huge wrapped exponent makes inf.Dec compute 10**(about 2**31) for minutes.
WRAPPING_EXPONENTS = ("4294967296", "4294967299", "-4294967296", "-4294967293", "9223372036854775807",
                      "-9223372036854775808", "9223372036854775808", "-9223372036854775809", "18446744073709551616")
HUGE_EXPONENTS = ("2147483647", "2147483648", "-2147483648", "-2147483649", "-2147483647")
MAX_CHEAP_EXPONENT = 100_000

# Each one was asked of Kubernetes' CEL by hand once; the generator adds them to its strings.
EDGES = (
    "Mi", "m", "e3", "-Mi", "+", "-", ".", "+.", "-.e3", "E", ".Mi", "Ei", "ki", "0.0.0", "1.5.Mi", "",
    "Ki", "Gi", "Ti", "Pi", "+Pi", "-.Ti", "0Pi", "0.5Pi", "99Ti", "100Ti", "16Ei", "-16Ei", "8Ei", "-8Ei",
    "e-9", "e-10", "n", ".e-10", "-.e-9", "0e-10", "0", "-0", "00", "+0.", "1.G", "1.", ".5", "0.0000000001",
    "-1e-20", "1.0000000001", "1e", "1e+", "1e-", "1ee3", "1e1.5", "1Mi3", "1k3", "1+5", "--", "+-1", "..",
    "1e4294967296", "1e4294967299", "e2147483648", "0e2147483648", "-0e-2147483649", "1e9223372036854775808",
    "1e-9223372036854775808", "1e9223372036854775807", "1e00000000000000000000000000003",
    "NaN", "Infinity", "1_000", "0x10", " 1", "1 ", "64 Gi", "64GiB", "\u0663", "1\u0663",
    # beyond Python's int() limit of 4300 digits
    "7" * 4400, "-" + "7" * 4400 + "Ki", "." + "3" * 4400 + "e-5", "0" * 4400 + "1Pi", "1e" + "0" * 4400 + "3",
    "1e-" + "0" * 4400 + "9223372036854775808", "1e" + "0" * 4400 + "9223372036854775808",
)
# Values no canonical string can be compared with cheaply (int32 edges): Kubernetes' own answers.
HUGE_VALUES = (
    ("1.5e-2147483648", "15e2147483647"),  # int64 path: scale -2147483648 - 1 wraps to 2147483647
    ("1e2147483647", "10e2147483646"),
)


def literal(text: str) -> str:
    assert '"' not in text and "\\" not in text
    return f'"{text}"'


def _digits(rng: random.Random, low: int, high: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(low, high)))


def _number(rng: random.Random) -> str:
    sign = rng.choice(("", "", "", "+", "-"))
    kind = rng.randrange(8)
    integer = ("", "0", "00", _digits(rng, 1, 3), _digits(rng, 4, 20), _digits(rng, 21, 45),
               rng.choice(INT64_EDGES), "0" * rng.randint(1, 5) + _digits(rng, 1, 19))[kind]
    point = rng.random() < 0.45
    fraction = rng.choice(("", "0", _digits(rng, 1, 3), _digits(rng, 4, 12), _digits(rng, 13, 40))) if point else ""
    return sign + integer + ("." if point else "") + fraction


def _exponent(rng: random.Random) -> str:
    letter = rng.choice("eE")
    sign = rng.choice(("", "", "+", "-"))
    choice = rng.randrange(10)
    if choice < 6:
        digits = str(rng.randint(0, 30))
    elif choice == 6:
        digits = rng.choice(("9", "10", "11", "18", "19", "20", "007", "0"))
    elif choice == 7:
        digits = str(rng.randint(31, 400))
    elif choice == 8:
        digits = rng.choice(WRAPPING_EXPONENTS).lstrip("-")
        sign = "-" if rng.random() < 0.5 else sign
    else:
        digits = rng.choice(HUGE_EXPONENTS).lstrip("-")  # kept only on a number of zeros (see cheap)
        sign = "-" if rng.random() < 0.5 else sign
    return letter + sign + digits


def _suffix(rng: random.Random) -> str:
    kind = rng.randrange(10)
    if kind < 2:
        return ""
    if kind < 4:
        return rng.choice(DECIMAL_SUFFIXES)
    if kind < 6:
        return rng.choice(BINARY_SUFFIXES)
    if kind < 9:
        return _exponent(rng)
    return rng.choice(BAD_SUFFIXES)


def _junk(rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 7)))


def _mutate(rng: random.Random, text: str) -> str:
    """One odd edit: a character inserted, dropped, doubled or swapped."""
    at = rng.randint(0, len(text))
    edit = rng.randrange(3)
    if edit == 0 or not text:
        return text[:at] + rng.choice(ALPHABET) + text[at:]
    at = min(at, len(text) - 1)
    if edit == 1:
        return text[:at] + text[at + 1:]
    return text[:at] + text[at] + text[at:]


def _exponent_of(text: str) -> int | None:
    """The int32 an e-exponent suffix holds (None without one), independently of the parser."""
    for at in range(len(text) - 1, -1, -1):
        if text[at] in "eE":
            tail = text[at + 1:]
            body = tail[1:] if tail[:1] in ("+", "-") else tail
            if not (body and body.isascii() and body.isdigit() and len(body.lstrip("0")) <= 19):
                return None
            exponent = int(body.lstrip("0") or "0") * (-1 if tail[:1] == "-" else 1)
            return (exponent + 2**31) % 2**32 - 2**31 if -(2**63) <= exponent < 2**63 else None
    return None


def cheap(text: str) -> bool:
    """Kubernetes answers isQuantity at once: no non-zero digit under a huge (wrapped) exponent.
    (Comparing even a zero under one is slow: int64Amount.Cmp rescales step by step.)"""
    exponent = _exponent_of(text)
    return exponent is None or abs(exponent) <= MAX_CHEAP_EXPONENT or not any(c in "123456789" for c in text)


def generate() -> list[str]:
    rng = random.Random(SEED)
    strings = dict.fromkeys(EDGES)
    while len(strings) < COUNT:
        mode = rng.randrange(10)
        if mode < 6:
            text = _number(rng) + _suffix(rng)
        elif mode < 8:
            text = _junk(rng)
        else:
            number = _number(rng) if rng.random() < 0.5 else _junk(rng)
            text = _mutate(rng, number + _suffix(rng))
        if cheap(text):
            strings.setdefault(text)
    return list(strings)


def expected_value(text: str) -> Decimal:
    """parse_quantity's value with ParseQuantity's BinarySI cap at the int64 maximum (either sign)."""
    value = parse_quantity(text)
    if text.endswith("i") and abs(value) > INT64_MAX:
        value = Decimal(INT64_MAX).copy_sign(value)
    return value


def canonical(value: Decimal) -> str:
    """``value`` as digits and a decimal exponent, a form ParseQuantity reads exactly and at once.
    The strings compared have a small exponent and at most a few thousand digits, so a value with a
    huge exponent is wrong as it stands (and "1e4294967296" would read as 1 again)."""
    if not value:
        return "0"
    sign, digits, exponent = value.as_tuple()
    assert isinstance(exponent, int) and abs(exponent) <= MAX_CHEAP_EXPONENT + 10_000, value
    return f"{'-' if sign else ''}{''.join(map(str, digits))}e{exponent}"


def test_quantities_are_what_kubernetes_parses_with_its_value() -> None:
    strings = generate()
    accepted = [s for s in strings if is_quantity(s)]
    valued = [(s, canonical(expected_value(s))) for s in accepted if abs(_exponent_of(s) or 0) <= MAX_CHEAP_EXPONENT]
    valued += HUGE_VALUES
    queries = [(f"isQuantity({literal(s)})", DEVICE) for s in strings]
    queries += [(f"quantity({literal(s)}).compareTo(quantity({literal(c)})) == 0", DEVICE) for s, c in valued]
    answers = ask(queries)

    broken = [(q, a) for (q, _), a in zip(queries, answers) if a.error]
    assert not broken, broken[:10]
    kubernetes = {s: a.matches for s, a in zip(strings, answers)}
    disagree = [(s, f"gpudra {is_quantity(s)}, Kubernetes {kubernetes[s]}")
                for s in strings if is_quantity(s) != kubernetes[s]]
    assert not disagree, f"{len(disagree)} of {len(strings)} strings: {disagree[:20]}"
    values = answers[len(strings):]
    wrong = [(s, c, str(parse_quantity(s))) for (s, c), a in zip(valued, values) if not a.matches]
    assert not wrong, f"{len(wrong)} of {len(valued)} values: {wrong[:20]}"

    # The generator reaches both sides, digit-less numbers and both ParseQuantity paths.
    assert len(strings) == COUNT and len(valued) > COUNT // 3
    assert len(strings) - len(accepted) > COUNT // 4
    assert {"Mi", "e3", "+."} <= set(accepted) and not {"Ei", "Pi", "e-10"} & set(accepted)
    assert sum(1 for s in accepted if len(s) > 25) > 50  # long digit strings: the inf.Dec path
