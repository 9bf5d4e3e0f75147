"""``semver()`` and its members, as k8s.io/apiserver/pkg/cel/library/semverlib.go (``SemverLib``,
version 1, which the base environment enables from Kubernetes 1.33) declares them: ``semver`` and
``isSemver`` (each with an optional ``normalize`` bool), and the members ``isGreaterThan``,
``isLessThan``, ``compareTo``, ``major``, ``minor`` and ``patch``. Parsing and precedence follow
github.com/blang/semver/v4 (``Parse``, ``Version.Compare``), which upstream uses."""

from __future__ import annotations

import re
from typing import Any

from cel_expr_python import cel

from gpudra_driver import limits
from gpudra_operator.cel.opaque import SEMVER_TYPE, SemverMessage

SEMVER = cel.Type(SEMVER_TYPE)
_UINT64_MAX = 2**64 - 1
_PARTS = re.compile(r"([0-9]+)\.([0-9]+)\.([0-9]+)(?:-([0-9A-Za-z.-]+))?(?:\+[0-9A-Za-z.-]+)?")


def parse(text: str) -> Any:
    """``semver.Parse``: a Semver message, or ``ValueError``."""
    match = _PARTS.fullmatch(text) if limits.is_semver(text) else None
    if match is None:
        raise ValueError(f"{text!r} is not a semantic version")
    major, minor, patch = (int(match[i]) for i in (1, 2, 3))
    if max(major, minor, patch) > _UINT64_MAX:
        raise ValueError(f"{text!r}: version number out of range")
    return SemverMessage(major=major, minor=minor, patch=patch, pre=match[4] or "")


def normalize(text: str) -> str:
    """semverlib.go ``normalizeAndParse``'s normalisation: no "v" prefix, no leading zeros, missing
    minor and patch filled with 0."""
    parts = text.removeprefix("v").split(".", 2)
    for i, part in enumerate(parts):
        if len(part) > 1:
            part = part.lstrip("0")
            if not part or not part[0].isdigit():
                part = "0" + part
            parts[i] = part
    if len(parts) < 3:
        if any(c in parts[-1] for c in "+-"):
            raise ValueError("short version cannot contain PreRelease/Build meta data")
        parts += ["0"] * (3 - len(parts))
    return ".".join(parts)


def _parse_normalized(text: str, normalized: bool) -> Any:
    return parse(normalize(text) if normalized else text)


def _is_semver(text: str, normalized: bool = False) -> bool:
    try:
        _parse_normalized(text, normalized)
    except ValueError:
        return False
    return True


def _pre_key(identifier: str) -> tuple[int, int, str]:
    # blang PRVersion.Compare: numeric identifiers sort before alphanumeric ones, numerically.
    return (0, int(identifier), "") if identifier.isdigit() else (1, 0, identifier)


def compare(left: Any, right: Any) -> int:
    """blang ``Version.Compare``: -1, 0 or 1."""
    a = (left.major, left.minor, left.patch)
    b = (right.major, right.minor, right.patch)
    if a != b:
        return 1 if a > b else -1
    if not left.pre or not right.pre:
        return (not left.pre) - (not right.pre)
    pa, pb = left.pre.split("."), right.pre.split(".")
    for x, y in zip(pa, pb):
        kx, ky = _pre_key(x), _pre_key(y)
        if kx != ky:
            return 1 if kx > ky else -1
    return (len(pa) > len(pb)) - (len(pa) < len(pb))


def functions() -> list[tuple[str, list[cel.Overload]]]:
    """(function name, overloads), merged with the other libraries' by :mod:`.environment`."""
    T = cel.Type
    return [
        ("semver", [
            cel.Overload("string_to_semver", SEMVER, [T.STRING], impl=parse),
            cel.Overload("string_bool_to_semver", SEMVER, [T.STRING, T.BOOL], impl=_parse_normalized)]),
        ("isSemver", [
            cel.Overload("is_semver_string", T.BOOL, [T.STRING], impl=_is_semver),
            cel.Overload("is_semver_string_bool", T.BOOL, [T.STRING, T.BOOL], impl=_is_semver)]),
        ("major", [cel.Overload("semver_major", T.INT, [SEMVER], is_member=True, impl=lambda v: v.major)]),
        ("minor", [cel.Overload("semver_minor", T.INT, [SEMVER], is_member=True, impl=lambda v: v.minor)]),
        ("patch", [cel.Overload("semver_patch", T.INT, [SEMVER], is_member=True, impl=lambda v: v.patch)]),
    ]
