"""``find`` and ``findAll``, as k8s.io/apiserver/pkg/cel/library/regex.go (Kubernetes 1.35, in every
base environment) declares them: ``<string>.find(<regex>)``, ``<string>.findAll(<regex>)`` and
``<string>.findAll(<regex>, <limit>)``.

The patterns are Go's RE2 syntax (``regexp.Compile``), run here by the RE2 library itself
(google-re2, the C++ engine Go's package was ported from): the same syntax, leftmost-first
matching and Unicode classes. What differs is bridged:

* Go refuses ``\\C`` (any byte), which C++ RE2 accepts: refused here, with Go's error, where Go's
  parser would stop on it;
* Go 1.25's ``\\p{...}`` names (case-insensitive, Unicode's long category names, ``Any``,
  ``ASCII``, ``Assigned``, ``LC``, ``Cn``, and a ``C`` that includes ``Cn``) are spelled as C++
  RE2 spells them (:func:`_unicode_class`); a name Go does not resolve is refused with its error;
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
        self.code, self.fragment = code, fragment


def _go_error(error: re2.error, pattern: str) -> RegexError:
    text = error.args[0].decode(errors="replace") if error.args and isinstance(error.args[0], bytes) else str(error)
    for cpp, go in _GO_ERROR.items():
        if text == cpp or text.startswith(cpp + ": "):
            return RegexError(go, text[len(cpp) + 2:])
    return RegexError("expression too large", pattern)  # "pattern too large - compile failed"


# Go 1.25's \p{...} names (regexp/syntax parse.go unicodeTable) that C++ RE2 spells otherwise or
# lacks: Go looks names up case-insensitively, without spaces, "_" and "-", takes Unicode's long
# category names, and has Any, ASCII, Assigned, LC and Cn; its C includes Cn (C++ RE2's does not).
_GO_ALIASES = {  # unicode.CategoryAliases, by canonical name
    "Casedletter": "LC", "Closepunctuation": "Pe", "Combiningmark": "M", "Connectorpunctuation": "Pc",
    "Control": "Cc", "Currencysymbol": "Sc", "Dashpunctuation": "Pd", "Decimalnumber": "Nd", "Enclosingmark": "Me",
    "Finalpunctuation": "Pf", "Format": "Cf", "Initialpunctuation": "Pi", "Letter": "L", "Letternumber": "Nl",
    "Lineseparator": "Zl", "Lowercaseletter": "Ll", "Mark": "M", "Mathsymbol": "Sm", "Modifierletter": "Lm",
    "Modifiersymbol": "Sk", "Nonspacingmark": "Mn", "Number": "N", "Openpunctuation": "Ps", "Other": "C",
    "Otherletter": "Lo", "Othernumber": "No", "Otherpunctuation": "Po", "Othersymbol": "So",
    "Paragraphseparator": "Zp", "Privateuse": "Co", "Punctuation": "P", "Separator": "Z", "Spaceseparator": "Zs",
    "Spacingmark": "Mc", "Surrogate": "Cs", "Symbol": "S", "Titlecaseletter": "Lt", "Unassigned": "Cn",
    "Uppercaseletter": "Lu", "Cntrl": "Cc", "Digit": "Nd", "Punct": "P",
}
_NOT_C = ("\\p{L}", "\\p{M}", "\\p{N}", "\\p{P}", "\\p{S}", "\\p{Z}")
_ASSIGNED = (*_NOT_C, "\\p{Cc}", "\\p{Cf}", "\\p{Co}", "\\p{Cs}")
# The sets C++ RE2 has no name for, as unions it can write: (the set, its complement), each None
# where no union of C++ RE2's classes and ranges says it.
_SETS: dict[str, tuple[tuple[str, ...] | None, tuple[str, ...] | None]] = {
    "Ascii": (("\\x00-\\x7F",), ("\\x80-\\x{10FFFF}",)),
    "LC": (("\\p{Lu}", "\\p{Ll}", "\\p{Lt}"), None),
    "Assigned": (_ASSIGNED, None),
    "Cn": (None, _ASSIGNED),
    "C": (None, _NOT_C),
}


def _canonical(name: str) -> str:
    """parse.go canonicalName: "_", "-" and " " dropped, an upper-case first letter, the rest lower."""
    out: list[str] = []
    for c in name:
        if c in "_- ":
            continue
        out.append(c.upper() if not out and "a" <= c <= "z" else c.lower() if out and "A" <= c <= "Z" else c)
    return "".join(out)


def _unicode_class(name: str, negated: bool, in_class: bool) -> str | None:
    """C++ RE2 syntax for Go's ``\\p{name}`` (``\\P`` when ``negated``); None where C++ RE2 cannot
    say it: a negated LC or Assigned, or a Cn, inside ``[...]`` (refused then). Inside ``[...]``,
    Go's C is C++ RE2's, which leaves out the unassigned code points."""
    canonical = _canonical(name)
    key = {"Lc": "LC"}.get(canonical, _GO_ALIASES.get(canonical, canonical))
    if key not in _SETS:
        return f"\\{'P' if negated else 'p'}{{{key}}}"  # a category, a script or Any, as C++ RE2 names them
    positive, negative = _SETS[key][::-1] if negated else _SETS[key]
    if in_class:
        return "".join(positive) if positive else "\\p{C}" if key == "C" else None
    return f"[{''.join(positive)}]" if positive else f"[^{''.join(negative or ())}]"


def _tokens(pattern: str) -> list[tuple[str, str]]:
    """The pattern as (Go's text, C++ RE2's text) pieces: ``\\p`` names as :func:`_unicode_class`
    spells them, and ``\\C`` (which Go refuses and C++ RE2 takes) as ``\\8``, which both refuse."""
    pieces: list[tuple[str, str]] = []
    in_class = False
    i = 0
    while i < len(pattern):
        c = pattern[i]
        token, spelled = c, c
        if pattern.startswith("\\Q", i) and not in_class:
            end = pattern.find("\\E", i + 2)
            token = spelled = pattern[i:len(pattern) if end < 0 else end + 2]
        elif c == "\\" and pattern[i + 1:i + 2] in ("p", "P") and (pattern[i + 2:i + 3] != "{" or "}" in pattern[i:]):
            brace = pattern.find("}", i) if pattern[i + 2:i + 3] == "{" else -1
            token = pattern[i:brace + 1] if brace >= 0 else pattern[i:i + 3]
            name = token[3:-1] if brace >= 0 else token[2:]
            negated = (token[1] == "P") != name.startswith("^")
            spelled = (_unicode_class(name.removeprefix("^"), negated, in_class) if name else None) or token
        elif c == "\\":
            token = pattern[i:i + 2]
            spelled = "\\8" if token == "\\C" else token
        elif c == "[" and not in_class:
            in_class = True
            token = "[^" if pattern.startswith("[^", i) else "["
            if pattern.startswith("]", i + len(token)):  # a leading "]" is a literal
                token += "]"
            spelled = token
        elif c == "[" and pattern.startswith("[:", i) and pattern.find(":]", i + 2) >= 0:
            token = spelled = pattern[i:pattern.find(":]", i + 2) + 2]
        elif c == "]":
            in_class = False
        pieces.append((token, spelled))
        i += len(token)
    return pieces


def _go_fragment(fragment: str, pieces: list[tuple[str, str]]) -> str:
    """The Go text of a fragment of the C++ RE2 text (an error's), whole pieces where it cuts one."""
    spelled = "".join(c for _, c in pieces)
    start = spelled.find(fragment)
    if start < 0:
        return fragment
    end, out, position = start + len(fragment), [], 0
    for token, piece in pieces:
        if position < end and position + len(piece) > start:
            whole = token != piece or (position >= start and position + len(piece) <= end)
            out.append(token if whole else piece[max(start - position, 0):end - position])
        position += len(piece)
    return "".join(out)


@lru_cache(maxsize=256)
def compiled(pattern: str) -> Any:
    """regexp.Compile: the RE2 program, or :class:`RegexError` with Go's message."""
    options = re2.Options()
    options.log_errors = False  # the error is the caller's, not stderr's
    options.max_mem = _MAX_MEM
    pieces = _tokens(pattern)
    try:
        return re2.compile("".join(piece for _, piece in pieces), options)
    except re2.error as error:
        go_error = _go_error(error, pattern)
    if go_error.code == "invalid UTF-8" and pattern.endswith("\\x{"):
        raise RegexError("invalid escape sequence", "\\x{")  # C++ RE2 calls a trailing \x{ invalid UTF-8
    fragment = _go_fragment(go_error.fragment, pieces)
    if go_error.code == "invalid escape sequence" and fragment[:2] in ("\\p", "\\P"):
        fragment = fragment[:2]  # a class as a range's end: Go's parseEscape names the escape alone
    raise RegexError(go_error.code, fragment)


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
