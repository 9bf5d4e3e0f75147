"""References to the device model in a finished CEL expression, found by a small CEL lexer.

Every ``device.attributes["<driver>"].x`` / ``device.capacity["<driver>"]["x"]`` outside string
literals must name an attribute or capacity the agent publishes, so a hand-written name in an
inline template is checked as strictly as one that came through ``attr()``/``capacity()``."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any
from dataclasses import dataclass

from gpudra_core import devicemodel
from gpudra_operator.deviceclasses.errors import TemplateValueError

# -- a small CEL lexer, enough to find attribute references outside string literals -------------

@dataclass(frozen=True)
class Token:
    kind: str  # "ident", "string", "number", "op"
    text: str
    value: str | None = None  # decoded value of a string literal


_CEL_SIMPLE_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t",
                       "v": "\v", "\\": "\\", "?": "?", '"': '"', "'": "'", "`": "`"}
_OPS = ("==", "!=", "<=", ">=", "&&", "||", "+", "-", "*", "/", "%", "!", "<", ">", "?", ":",
        ".", ",", "(", ")", "[", "]", "{", "}")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NUMBER = re.compile(r"0[xX][0-9a-fA-F]+[uU]?|[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)?[uU]?|\.[0-9]+([eE][+-]?[0-9]+)?")


class CelSyntaxError(ValueError):
    pass


def _decode_escapes(body: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(body):
        ch = body[i]
        if ch != "\\":
            out.append(ch)
            i += 1
            continue
        if i + 1 >= len(body):
            raise CelSyntaxError("string ends in a backslash")
        esc = body[i + 1]
        if esc in _CEL_SIMPLE_ESCAPES:
            out.append(_CEL_SIMPLE_ESCAPES[esc])
            i += 2
        elif esc in "xX" or esc in "uU":
            width = {"x": 2, "X": 2, "u": 4, "U": 8}[esc]
            digits = body[i + 2:i + 2 + width]
            if len(digits) != width or not re.fullmatch(r"[0-9a-fA-F]+", digits):
                raise CelSyntaxError(f"bad \\{esc} escape")
            out.append(chr(int(digits, 16)))
            i += 2 + width
        elif esc in "0123":
            digits = body[i + 1:i + 4]
            if not re.fullmatch(r"[0-7]{3}", digits):
                raise CelSyntaxError("bad octal escape")
            out.append(chr(int(digits, 8)))
            i += 4
        else:
            raise CelSyntaxError(f"unknown escape \\{esc}")
    return "".join(out)


def cel_tokens(expression: str) -> list[Token]:
    """Tokens of a CEL expression (comments and whitespace dropped, string literals decoded)."""
    tokens: list[Token] = []
    i, n = 0, len(expression)
    while i < n:
        ch = expression[i]
        if ch.isspace():
            i += 1
            continue
        if expression.startswith("//", i):
            end = expression.find("\n", i)
            i = n if end < 0 else end + 1
            continue
        # string literal, with optional r/b prefixes
        m = re.match(r"([rRbB]{0,2})(\"\"\"|'''|\"|')", expression[i:])
        if m and (not m.group(1) or re.fullmatch(r"[rR]?[bB]?|[bB]?[rR]?", m.group(1))):
            prefix, quote = m.group(1), m.group(2)
            raw = "r" in prefix.lower()
            j = i + len(prefix) + len(quote)
            while True:
                if j >= n:
                    raise CelSyntaxError("unterminated string literal")
                if expression.startswith(quote, j):
                    break
                if len(quote) == 1 and expression[j] in "\r\n":
                    raise CelSyntaxError("newline in a string literal")
                j += 2 if expression[j] == "\\" and not raw else 1
            body = expression[i + len(prefix) + len(quote):j]
            end = j + len(quote)
            tokens.append(Token("string", expression[i:end], body if raw else _decode_escapes(body)))
            i = end
            continue
        if ch == "`":
            end = expression.find("`", i + 1)
            if end < 0:
                raise CelSyntaxError("unterminated quoted identifier")
            tokens.append(Token("ident", expression[i:end + 1], expression[i + 1:end]))
            i = end + 1
            continue
        m = _IDENT.match(expression, i)
        if m:
            tokens.append(Token("ident", m.group(0), m.group(0)))
            i = m.end()
            continue
        m = _NUMBER.match(expression, i)
        if m:
            tokens.append(Token("number", m.group(0)))
            i = m.end()
            continue
        for op in _OPS:
            if expression.startswith(op, i):
                tokens.append(Token("op", op))
                i += len(op)
                break
        else:
            raise CelSyntaxError(f"unexpected character {ch!r} at offset {i}")
    return tokens


# -- references to the device model ------------------------------------------------------------

def token_is(tokens: Sequence[Token], i: int, kind: str, text: str | None = None) -> bool:
    """``tokens[i]`` exists, is of ``kind`` and, when given, reads ``text``."""
    return i < len(tokens) and tokens[i].kind == kind and (text is None or tokens[i].text == text)


def all_model_references(expression: str) -> list[tuple[str, str, str]]:
    """Every ``device.attributes["<domain>"].name`` / ``device.capacity["<domain>"]["name"]``
    reference in ``expression`` as ``("attributes"|"capacity", domain, name)``. Index form, optional
    selection (``.?name``) and quoted identifiers count too."""
    toks = cel_tokens(expression)
    found: list[tuple[str, str, str]] = []
    for i in range(len(toks)):
        if not (token_is(toks, i, "ident", "device") and token_is(toks, i + 1, "op", ".")
                and token_is(toks, i + 2, "ident") and toks[i + 2].value in ("attributes", "capacity")
                and token_is(toks, i + 3, "op", "[") and token_is(toks, i + 4, "string")
                and token_is(toks, i + 5, "op", "]")):
            continue
        j = i + 6
        name: str | None = None
        if token_is(toks, j, "op", "."):
            k = j + 2 if token_is(toks, j + 1, "op", "?") else j + 1
            if token_is(toks, k, "ident"):
                name = toks[k].value
        elif token_is(toks, j, "op", "[") and token_is(toks, j + 1, "string") and token_is(toks, j + 2, "op", "]"):
            name = toks[j + 1].value
        if name is not None:
            found.append((str(toks[i + 2].value), str(toks[i + 4].value), name))
    return found


def model_references(expression: str, driver: str) -> list[tuple[str, str]]:
    """The references to ``driver``'s own domain, as ``("attributes"|"capacity", name)``; other
    domains are not ours to check."""
    return [(where, name) for where, domain, name in all_model_references(expression) if domain == driver]


def check_model_references(expression: str, driver: str) -> None:
    """Raise :class:`TemplateValueError` when ``expression`` names an attribute or capacity of
    ``driver`` that the device model does not declare."""
    try:
        refs = model_references(expression, driver)
    except CelSyntaxError as error:
        raise TemplateValueError(f"CEL expression does not parse: {error}") from None
    for where, name in refs:
        if where == "attributes":
            spec = devicemodel.ATTRIBUTES.get(name)
            if spec is None or spec.domain is not None:
                raise TemplateValueError(
                    f"attribute {name!r} of {driver} is not published by the agent "
                    f"(known: {', '.join(n for n in devicemodel.attribute_names() if '/' not in n)})")
        elif name not in devicemodel.CAPACITIES:
            raise TemplateValueError(
                f"capacity {name!r} of {driver} is not published by the agent "
                f"(known: {', '.join(devicemodel.capacity_names())})")


def device_projection(references: tuple[tuple[str, str, str], ...], driver: str, device: Mapping[str, Any]) -> Any:
    """The values of ``references`` in ``device`` (absent ones as None), hashable."""
    values: list[Any] = [bool(device.get("allowMultipleAllocations"))]
    for where, domain, name in references:
        entries = device.get(where) or {}
        entry = entries.get(f"{domain}/{name}")
        if entry is None and domain == driver:
            entry = entries.get(name)
        values.append(None if entry is None else tuple(sorted((k, str(v)) for k, v in entry.items())))
    return tuple(values)


def selector_references(expressions: Sequence[str]) -> tuple[tuple[str, str, str], ...] | None:
    """Every attribute and capacity ``expressions`` read, as ``(where, domain, name)``, when that is
    all they can read of a device (each ``device.attributes``/``device.capacity`` indexed by a
    literal domain and name); None when one may read more (a map used whole, or indexed by a
    variable). With them, a selector's answer depends only on :func:`device_projection`: callers
    ask Kubernetes' CEL once per distinct projection, not once per device."""
    found: list[tuple[str, str, str]] = []
    for expression in expressions:
        try:
            tokens = cel_tokens(expression)
            refs = all_model_references(expression)
        except CelSyntaxError:
            return None
        uses = sum(1 for i in range(len(tokens) - 2) if tokens[i].kind == "ident" and tokens[i].text == "device"
                   and tokens[i + 1].text == "." and tokens[i + 2].text in ("attributes", "capacity"))
        if uses != len(refs):  # a map used whole, or indexed by a variable
            return None
        found += refs
    return tuple(sorted(set(found)))
