"""``find`` and ``findAll``, as k8s.io/apiserver/pkg/cel/library/regex.go (Kubernetes 1.35, in every
base environment) declares them: ``<string>.find(<regex>)``, ``<string>.findAll(<regex>)`` and
``<string>.findAll(<regex>, <limit>)``.

The patterns are Go's RE2 syntax (``regexp.Compile``), run here by the RE2 library itself
(google-re2, the C++ engine Go's package was ported from): the same syntax, leftmost-first
matching and Unicode classes. What differs is bridged:

* Go refuses ``\\C`` (any byte), which C++ RE2 accepts: refused here, with Go's error, where Go's
  parser would stop on it;
* the error messages: C++ RE2's words are mapped to Go's ``regexp/syntax`` ones, so an invalid
  pattern reads ``Illegal regex: error parsing regexp: missing closing ): `(```` as upstream;
* ``findAll`` is Go's ``FindAllString`` loop: after an empty match the search moves on by one
  character, and an empty match right where the previous match ended is dropped;
* a literal pattern is compiled when the selector is (cel-go's ``RegexOptimization``: a bad one
  fails the program's creation, so the API server refuses the selector): :func:`literal_error`.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import re2
from cel_expr_python import cel

from gpudra_operator.cel import astwalk
from gpudra_operator.cel.gen import checked_ast_pb2 as ast

# C++ RE2's error texts (re2/regexp.cc kErrorStrings) and Go's (regexp/syntax ErrorCode).
_GO_ERROR = {
    "unexpected error": "regexp/syntax: internal error",
    "invalid escape sequence": "invalid escape sequence",
    "invalid character class": "invalid character class",
    "invalid character class range": "invalid character class range",
    "missing ]": "missing closing ]",
    "missing )": "missing closing )",
    "unexpected )": "unexpected )",
    "trailing \\": "trailing backslash at end of expression",
    "no argument for repetition operator": "missing argument to repetition operator",
    "invalid repetition size": "invalid repeat count",
    "bad repetition operator": "invalid nested repetition operator",
    "invalid perl operator": "invalid or unsupported Perl syntax",
    "invalid UTF-8": "invalid UTF-8",
    "invalid named capture group": "invalid named capture",
}
_MAX_MEM = 64 << 20  # C++ RE2's default (8 MiB) refuses programs Go compiles; Go has no such cap


class RegexError(ValueError):
    """regexp.Compile's error: ``error parsing regexp: <code>: `<fragment>```."""

    def __init__(self, code: str, fragment: str) -> None:
        super().__init__(f"error parsing regexp: {code}: `{fragment}`")


def _go_error(error: re2.error, pattern: str) -> RegexError:
    text = error.args[0].decode(errors="replace") if error.args and isinstance(error.args[0], bytes) else str(error)
    for cpp, go in _GO_ERROR.items():
        if text == cpp or text.startswith(cpp + ": "):
            return RegexError(go, text[len(cpp) + 2:])
    return RegexError("expression too large", pattern)  # "pattern too large - compile failed"


def _marked(pattern: str) -> tuple[str, str | None]:
    """The pattern with each ``\\C`` (outside ``\\Q...\\E``) made ``\\8``, an escape C++ RE2 refuses
    too, so its parser stops at the first error where Go's does; and which of the two escapes comes
    first (what an "invalid escape sequence: \\8" then names)."""
    out: list[str] = []
    first: str | None = None
    i = 0
    while i < len(pattern):
        if pattern.startswith("\\Q", i):
            end = pattern.find("\\E", i + 2)
            end = len(pattern) if end < 0 else end + 2
            out.append(pattern[i:end])
            i = end
            continue
        escape = pattern[i:i + 2] if pattern[i] == "\\" else pattern[i]
        if escape in ("\\C", "\\8"):
            first = first or escape
            escape = "\\8"
        out.append(escape)
        i += len(escape)
    return "".join(out), first


@lru_cache(maxsize=256)
def compiled(pattern: str) -> Any:
    """regexp.Compile: the RE2 program, or :class:`RegexError` with Go's message."""
    options = re2.Options()
    options.log_errors = False  # the error is the caller's, not stderr's
    options.max_mem = _MAX_MEM
    marked, first = _marked(pattern)
    try:
        return re2.compile(marked, options)
    except re2.error as error:
        go_error = _go_error(error, pattern)
    if first and str(go_error) == str(RegexError("invalid escape sequence", "\\8")):
        raise RegexError("invalid escape sequence", first)
    raise go_error


def _program(pattern: str) -> Any:
    try:
        return compiled(pattern)
    except RegexError as error:
        raise ValueError(f"Illegal regex: {error}") from None


def _find(text: str, pattern: str) -> str:
    match = _program(pattern).search(text)
    return "" if match is None else str(match.group())


def _find_all(text: str, pattern: str, limit: int = -1) -> list[str]:
    """Go's Regexp.FindAllString (allMatches); a negative limit is no limit."""
    program = _program(pattern)
    if limit < 0:
        limit = len(text.encode()) + 1
    found: list[str] = []
    position, previous_end = 0, -1
    while len(found) < limit and position <= len(text):
        match = program.search(text, position)
        if match is None:
            break
        start, end = match.span()
        accept = True
        if end == position:  # an empty match
            accept = start != previous_end  # none right after the previous match
            position += 1
        else:
            position = end
        previous_end = end
        if accept:
            found.append(str(match.group()))
    return found


def literal_error(checked: ast.CheckedExpr) -> str | None:
    """What fails the program's creation upstream: a ``find``/``findAll`` whose pattern is a
    string literal that does not compile (regex.go ``FindRegexOptimization``,
    ``FindAllRegexOptimization``); else None."""
    for node in astwalk.nodes(checked.expr):
        call = node.call_expr if node.WhichOneof("expr_kind") == "call_expr" else None
        if call is None or call.function not in ("find", "findAll") or not call.HasField("target") or not call.args:
            continue
        pattern = astwalk.string_constant(call.args[0])
        if pattern is None:
            continue
        try:
            compiled(pattern)
        except RegexError as error:
            return f"program instantiation failed: {error}"
    return None


def functions() -> list[tuple[str, list[cel.Overload]]]:
    """(function name, overloads), merged with the other libraries' by :mod:`.environment`."""
    T = cel.Type
    return [
        ("find", [cel.Overload("string_find_string", T.STRING, [T.STRING, T.STRING], is_member=True, impl=_find)]),
        ("findAll", [
            cel.Overload("string_find_all_string", T.List(T.STRING), [T.STRING, T.STRING], is_member=True,
                         impl=_find_all),
            cel.Overload("string_find_all_string_int", T.List(T.STRING), [T.STRING, T.STRING, T.INT],
                         is_member=True, impl=_find_all)]),
    ]
