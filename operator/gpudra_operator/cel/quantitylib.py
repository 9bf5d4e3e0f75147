"""``quantity()`` and its members, as k8s.io/apiserver/pkg/cel/library/quantity.go (Kubernetes
1.35) declares them: ``quantity``, ``isQuantity``, ``sign`` (a global function there, not a member),
and the members ``isGreaterThan``, ``isLessThan``, ``compareTo``, ``asApproximateFloat``,
``asInteger``, ``isInteger``, ``add`` and ``sub`` (each with a quantity or an int).

Parsing is :func:`gpudra_driver.quantity.parse_quantity` (apimachinery's ``ParseQuantity``), plus
its cap of BinarySI values at the int64 maximum. Arithmetic is exact, as ``Quantity.Add``/``Sub``.

One known difference: upstream's ``isInteger``/``asInteger`` answer from the quantity's internal
form (``int64Amount`` or ``inf.Dec``), so ``quantity("1.0").isInteger()`` and
``quantity("1Pi").isInteger()`` are false there although both values are integers. A value-equal
CEL ``==`` needs a message without that form, so here they answer from the value: an integer that
fits in int64."""

from __future__ import annotations

from decimal import Context, Decimal
from typing import Any

from cel_expr_python import cel

from gpudra_driver import limits
from gpudra_driver.quantity import is_quantity, parse_quantity
from gpudra_operator.cel.opaque import QUANTITY_TYPE, quantity_message, quantity_of

QUANTITY = cel.Type(QUANTITY_TYPE)
_EXACT = Context(prec=200)  # sums of two quantities stay exact (values have < 100 digits)


def parse(text: str) -> Any:
    """``resource.ParseQuantity`` as a Quantity message; ``ValueError`` when ``text`` is not one."""
    value = parse_quantity(text)
    # quantity.go ParseQuantity: "The max is just a simple cap" for BinarySI (an "…i" suffix).
    # The cap is on the magnitude; the sign is put back after it.
    if text.endswith("i") and abs(value) > limits.INT64_MAX:
        value = Decimal(limits.INT64_MAX).copy_sign(value)
    return quantity_message(value)


def compare(left: Any, right: Any) -> int:
    """``Quantity.Cmp``: -1, 0 or 1 (``compareTo``; ``isGreaterThan``/``isLessThan`` are 1/-1)."""
    a, b = quantity_of(left), quantity_of(right)
    return (a > b) - (a < b)


def _as_int64(message: Any) -> int | None:
    value = quantity_of(message)
    if value != value.to_integral_value() or not limits.INT64_MIN <= value <= limits.INT64_MAX:
        return None
    return int(value)


def _as_integer(message: Any) -> int:
    value = _as_int64(message)
    if value is None:
        raise ValueError("cannot convert value to integer")
    return value


def _sign(message: Any) -> int:
    value = quantity_of(message)
    return (value > 0) - (value < 0)


def _add(left: Any, right: Any) -> Any:
    other = Decimal(right) if isinstance(right, int) else quantity_of(right)
    return quantity_message(_EXACT.add(quantity_of(left), other))


def _sub(left: Any, right: Any) -> Any:
    other = Decimal(right) if isinstance(right, int) else quantity_of(right)
    return quantity_message(_EXACT.subtract(quantity_of(left), other))


def functions() -> list[tuple[str, list[cel.Overload]]]:
    """(function name, overloads), merged with the other libraries' by :mod:`.environment`."""
    T = cel.Type
    member = True
    return [
        ("quantity", [cel.Overload("string_to_quantity", QUANTITY, [T.STRING], impl=parse)]),
        ("isQuantity", [cel.Overload("is_quantity_string", T.BOOL, [T.STRING], impl=is_quantity)]),
        ("sign", [cel.Overload("quantity_sign", T.INT, [QUANTITY], impl=_sign)]),
        ("asApproximateFloat", [cel.Overload(
            "quantity_get_float", T.DOUBLE, [QUANTITY], is_member=member, impl=lambda q: float(quantity_of(q)))]),
        ("asInteger", [cel.Overload(
            "quantity_get_int", T.INT, [QUANTITY], is_member=member, impl=_as_integer)]),
        ("isInteger", [cel.Overload(
            "quantity_is_integer", T.BOOL, [QUANTITY], is_member=member, impl=lambda q: _as_int64(q) is not None)]),
        ("add", [
            cel.Overload("quantity_add", QUANTITY, [QUANTITY, QUANTITY], is_member=member, impl=_add),
            cel.Overload("quantity_add_int", QUANTITY, [QUANTITY, T.INT], is_member=member, impl=_add)]),
        ("sub", [
            cel.Overload("quantity_sub", QUANTITY, [QUANTITY, QUANTITY], is_member=member, impl=_sub),
            cel.Overload("quantity_sub_int", QUANTITY, [QUANTITY, T.INT], is_member=member, impl=_sub)]),
    ]
