"""Kubernetes quantities: the one parser (what the API server accepts, and the value it stores) and
the one formatter (the canonical form it returns)."""

from __future__ import annotations

import time
from decimal import Decimal

import pytest

from gpudra_core.quantity import format_quantity, int64_value, is_quantity, parse_quantity, quantity_value


@pytest.mark.parametrize(("text", "value"), [
    ("64Gi", 64 * 2**30), ("81559Mi", 81559 * 2**20), ("1.5Ti", 3 * 2**39), ("1Ki", 1024), ("1Ei", 2**60),
    ("80G", 80 * 10**9), ("1k", 1000), ("2", 2), ("68719476736", 68719476736), ("1E", 10**18),
    ("500m", Decimal("0.5")), ("1u", Decimal("1e-6")), ("7n", Decimal("7e-9")),
    ("1e9", 10**9), ("1E3", 1000), ("1e+3", 1000), ("5e-3", Decimal("0.005")),
    ("0.5", Decimal("0.5")), (".5", Decimal("0.5")), ("1.", 1), ("+1", 1), ("-1.5Gi", -3 * 2**29), ("0", 0),
    ("0.0000000001", Decimal("1e-9")), ("-1e-20", Decimal("-1e-9")),  # below a nano: rounded up, away from zero
    ("1.0000000001", Decimal("1.000000001")),
    ("123456789012345678901234567890Ki", 123456789012345678901234567890 * 1024),  # exact, no float
    ("-123456789012345678901234567890.5", Decimal("-123456789012345678901234567890.5")),
    ("16Ei", 2**64),  # uncapped here; quantitylib caps BinarySI at the int64 maximum, as ParseQuantity
    # A number without digits is 0 where ParseQuantity's int64 path takes it (tests/unit/test_quantity_oracle.py)
    ("Mi", 0), ("Ki", 0), ("Ti", 0), ("m", 0), (".", 0), ("+", 0), ("-", 0), ("-.e3", 0), ("E", 0), ("e-9", 0),
    # The exponent is an int64 kept as an int32: 2**32 wraps to 0
    ("1e4294967296", 1), ("1e4294967299", 1000), ("1e-9223372036854775808", 1),
    ("1e9223372036854775807", Decimal("0.1")),
    ("1.5e-2147483648", Decimal("15e2147483647")),  # the int64 path's scale -2**31 - 1 wraps to 2**31 - 1
    # inf.Dec's rounding shifts by the int32 9 - scale, which wraps at a scale of -2**31: 10**2**31 becomes
    # one nano (derived from the Go arithmetic; Kubernetes itself takes minutes to compute 10**2147483639)
    ("1e2147483648", Decimal("1e-9")),
])
def test_parse_gives_the_exact_value_the_api_server_stores(text: str, value: int | Decimal) -> None:
    assert parse_quantity(text) == value
    assert is_quantity(text) and quantity_value(text) == value


@pytest.mark.parametrize("text", [
    "", "lots", "gpu", "64 Gi", " 1", "64GiB", "1K", "1KB", "ki", "1.2.3", "0.0.0", "1.5.Mi", "1e", "1e1.5", "1ee3",
    "1Mi3", "NaN", "Infinity", "1_000", "0x10", '64Gi") || true || ("', "1e9223372036854775808", "\u0663",
    # no digit on ParseQuantity's inf.Dec path (inf.Dec.SetString refuses it)
    "Pi", "Ei", "+Pi", "e-10", ".e-10", "e2147483648",
])
def test_parse_refuses_what_the_api_server_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="quantity|exponent"):
        parse_quantity(text)
    assert not is_quantity(text) and quantity_value(text) is None


def test_quantity_value() -> None:
    assert quantity_value("81559Mi") == 81559 * 2**20
    assert quantity_value("2") == 2 and quantity_value(3) == 3
    assert quantity_value("gpu") is None and quantity_value(None) is None and quantity_value(True) is None
    assert quantity_value(2.5) is None  # JSON carries a quantity as a string or an integer


@pytest.mark.parametrize("amount", [0, 1, 14, 1000, 1536, 2000, 40 * 2**30, 81559 * 2**20, 10**18, 2**62])
def test_a_formatted_quantity_parses_back_to_its_amount(amount: int) -> None:
    for binary in (True, False):
        assert parse_quantity(format_quantity(amount, binary=binary)) == amount


@pytest.mark.parametrize(
    ("amount", "binary", "expected"),
    [
        (81559 * 2**20, True, "81559Mi"),  # H100: 85520809984 bytes
        (40 * 2**30, True, "40Gi"),
        (143771 * 2**20, True, "143771Mi"),
        (1536, True, "1536"),  # not a multiple of 1024: decimal, like the API server
        (1000, True, "1k"),
        (512, True, "512"),
        (0, True, "0"),
        (14, False, "14"),
        (2000, False, "2k"),
        (1024, False, "1024"),
    ],
)
def test_quantity_is_canonical(amount: int, binary: bool, expected: str) -> None:
    assert format_quantity(amount, binary=binary) == expected


def test_negative_amounts_are_not_formatted() -> None:
    with pytest.raises(ValueError):
        format_quantity(-1, binary=True)


@pytest.mark.parametrize(("text", "value"), [
    ("1Gi", 2**30), ("1048576.5", 2**20 + 1), ("-1.5", -2), ("500m", 1), ("9223372036854775807", 2**63 - 1),
    ("-9223372036854775808", -(2**63)), ("8Ei", 2**63 - 1), ("16Ei", 2**63 - 1), ("-16Ei", -(2**63 - 1)),
])
def test_int64_value_is_quantity_value_with_the_binarysi_cap(text: str, value: int) -> None:
    assert int64_value(text) == value


@pytest.mark.parametrize("text", ["9223372036854775808", "1e19", "1e300000", "1e2147483647", "-1e300000", "1E1000000",
                                  "99999999999999999999E", "lots"])
def test_int64_value_refuses_beyond_int64_without_building_the_integer(text: str) -> None:
    started = time.thread_time()
    with pytest.raises(ValueError):
        int64_value(text)
    assert time.thread_time() - started < 0.01  # math.ceil of 1e300000 alone takes seconds
