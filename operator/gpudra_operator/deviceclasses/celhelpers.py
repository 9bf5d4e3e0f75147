"""The helpers templates build CEL with: each checks its value before it becomes CEL.

:func:`quantity_literal` (a Kubernetes quantity, checked by :mod:`gpudra_core.quantity`),
:func:`semver_literal` (a semantic version, ``8.0`` normalised to ``8.0.0``), :func:`attribute_ref`
and :func:`capacity_ref` (names the agent publishes, from :mod:`gpudra_core.devicemodel`) and
:func:`driver_match` (the guard every built-in starts with)."""

from __future__ import annotations

import re

from gpudra_core import devicemodel, limits
from gpudra_core.quantity import is_quantity
from gpudra_operator.deviceclasses.errors import TemplateValueError
from gpudra_operator.deviceclasses.escape import cel_string

_NUMERIC_VERSION = re.compile(r"^v?[0-9]+(\.[0-9]+){0,2}$")


def quantity_literal(value: object) -> str:
    """``quantity("<value>")`` after checking that ``value`` is one, as the API server parses it."""
    text = value if isinstance(value, str) else str(value) if type(value) is int else None
    if text is None or not is_quantity(text):
        raise TemplateValueError(f"{value!r} is not a Kubernetes quantity (e.g. 64Gi, 80G, 1.5Ti)")
    return f"quantity({cel_string(text)})"


def normalize_semver(value: object) -> str:
    """A semantic version from a parameter: full semver as is, ``8``/``8.0``/``v8.0`` padded to
    ``8.0.0`` (leading zeros dropped)."""
    if not isinstance(value, str):
        raise TemplateValueError(f"a version must be a string, got {type(value).__name__} {value!r}")
    text = value.strip()
    if limits.is_semver(text):
        return text
    if _NUMERIC_VERSION.fullmatch(text):
        return devicemodel.normalize_version(text.lstrip("v"))
    raise TemplateValueError(f"{value!r} is not a version (MAJOR[.MINOR[.PATCH]], e.g. 8.0)")


def semver_literal(value: object) -> str:
    """``semver("<normalised value>")``."""
    return f"semver({cel_string(normalize_semver(value))})"


def attribute_ref(name: str, driver: str) -> str:
    """CEL for one published attribute; unknown names raise :class:`TemplateValueError`."""
    if not isinstance(name, str) or devicemodel.attribute_type(name, driver) is None:
        known = ", ".join(devicemodel.attribute_names())
        raise TemplateValueError(f"attribute {name!r} is not published by the agent (known: {known})")
    domain, _, bare = name.rpartition("/")
    return f"device.attributes[{cel_string(domain or driver)}].{bare}"


def capacity_ref(name: str, driver: str) -> str:
    """CEL for one published capacity; unknown names raise :class:`TemplateValueError`."""
    if not isinstance(name, str) or not devicemodel.is_capacity(name, driver):
        known = ", ".join(devicemodel.capacity_names())
        raise TemplateValueError(f"capacity {name!r} is not published by the agent (known: {known})")
    return f"device.capacity[{cel_string(driver)}].{name.rpartition('/')[2]}"


def driver_match(driver: str) -> str:
    """``device.driver == "<driver>"``: the guard every built-in starts with, so the rest of the
    expression is never evaluated (and never errors) on another driver's devices."""
    return f"device.driver == {cel_string(driver)}"
