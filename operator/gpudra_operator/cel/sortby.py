"""``sortBy``, cel-go's lists extension's macro (ext/lists.go ``sortByMacro``, version 2 and up),
which cel-cpp's Python binding cannot declare: ``target.sortBy(e, key)`` is written out, before
compiling, as upstream's parser expands it,

    cel.bind(__sortBy_input__, target,
             __sortBy_input__.__sortByAssociatedKeys__(__sortBy_input__.map(e, key)))

so the checked tree, its cost and its run are upstream's (the bound variable and the function have
source-spellable names here). The target is the postfix expression before ``.sortBy``, found on
the selector's tokens."""

from __future__ import annotations

from collections.abc import Sequence

from gpudra_operator.cel.listlib import SORT_BY_KEYS
from gpudra_operator.deviceclasses.celrefs import Token, matching_bracket, split_arguments

INPUT = "__sortBy_input__"
_CLOSERS = (")", "]", "}")
_OPERAND_ENDS = ("ident", "string", "number")


class SortByError(ValueError):
    """A ``sortBy`` upstream's macro refuses, with its message."""


def expand_sort_by(tokens: Sequence[Token]) -> list[Token]:
    """``tokens`` with every ``.sortBy(e, key)`` expanded (the innermost ones too)."""
    tokens = list(tokens)
    for k in range(len(tokens) - 2):
        if tokens[k].text == "." and tokens[k + 1].text == "sortBy" and tokens[k + 2].text == "(":
            break
    else:
        return tokens
    end = matching_bracket(tokens, k + 2)
    arguments = split_arguments(tokens[k + 3:end])
    if len(arguments) != 2 or len(arguments[0]) != 1 or arguments[0][0].kind != "ident":
        raise SortByError("sortBy(var, expression) takes a variable name and an expression")
    start = _postfix_start(tokens, k - 1)
    target = tokens[start:k]
    if _is_literal(target):
        raise SortByError("sortBy can only be applied to a list, identifier, comprehension, call or select expression")
    variable, key = arguments[0][0], expand_sort_by(arguments[1])
    bound = Token("ident", INPUT, INPUT)
    expanded = [
        Token("ident", "cel", "cel"), Token("op", "."), Token("ident", "bind", "bind"), Token("op", "("),
        bound, Token("op", ","), *expand_sort_by(target), Token("op", ","),
        bound, Token("op", "."), Token("ident", SORT_BY_KEYS, SORT_BY_KEYS), Token("op", "("),
        bound, Token("op", "."), Token("ident", "map", "map"), Token("op", "("), variable, Token("op", ","), *key,
        Token("op", ")"), Token("op", ")"), Token("op", ")")]
    return expand_sort_by(tokens[:start] + expanded + tokens[end + 1:])  # the next one, chained or not


def _ends_operand(token: Token) -> bool:
    return token.kind in _OPERAND_ENDS or token.text in _CLOSERS


def _postfix_start(tokens: Sequence[Token], last: int) -> int:
    """Where the postfix expression (member selects, calls, indexes on a primary) that ends at
    ``tokens[last]`` starts: what a member call such as ``.sortBy`` applies to."""
    i = last
    while True:
        if tokens[i].text in _CLOSERS:
            opener = matching_bracket(tokens, i)
            if tokens[opener].text == "[" and opener > 0 and _ends_operand(tokens[opener - 1]):
                i = opener - 1  # an index: its operand ends just before
                continue
            i = opener
            if tokens[i].text in ("(", "{") and i > 0 and tokens[i - 1].kind == "ident":
                i -= 1  # a call's (or a message's) name
        if i >= 2 and tokens[i - 1].text == "." and _ends_operand(tokens[i - 2]):
            i -= 2  # a member of what ends before the dot
            continue
        return i


def _is_literal(target: Sequence[Token]) -> bool:
    """Upstream refuses a literal or a map or message literal as the target; a parenthesised
    target is judged by what is inside."""
    inner = list(target)
    while len(inner) >= 2 and inner[0].text == "(" and matching_bracket(inner, 0) == len(inner) - 1:
        inner = inner[1:-1]
    if len(inner) == 1:
        return inner[0].kind in ("string", "number") or inner[0].text in ("true", "false", "null")
    return bool(inner) and inner[-1].text == "}"
