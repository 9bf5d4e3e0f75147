"""What cel-go's two-variable comprehensions (``ext.TwoVarComprehensions``, in the Kubernetes base
environment since 1.32: k8s.io/apiserver/pkg/cel/environment/base.go) need at run time here.

The macros themselves (``all``/``exists``/``existsOne`` with two variables, ``transformList``,
``transformMap``, ``transformMapEntry``) are cel-cpp's ``two-var-comprehensions`` extension,
enabled in the environment config; they expand at parse time, as cel-go's do (cel-go
ext/comprehensions.go). ``transformMap`` and ``transformMapEntry`` accumulate with
``cel.@mapInsert``, which cel-cpp's Python binding declares but does not link a runtime function
for: selectors that call it run in an environment that declares it with :func:`functions`
(``SelectorEnvironment.compile``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cel_expr_python import cel

from gpudra_operator.cel import astwalk
from gpudra_operator.cel.gen import checked_ast_pb2 as ast
from gpudra_operator.deviceclasses.celrefs import Token, matching_bracket, split_arguments

MAP_INSERT = "cel.@mapInsert"
_KEY_VALUE = "@mapInsert_map_key_value"
_MAP = "@mapInsert_map_map"


# What a Python dict cannot hold: CEL's map keys ``true`` and ``1`` are two keys, Python's one.
MIXED_KEYS = "a map with both a bool key and an int key"


def _inserted(target: Mapping[Any, Any], key: Any, value: Any) -> dict[Any, Any]:
    """cel-go common/types ``InsertMapKeyValue``: a copy with the entry added; an error when the
    key is there already."""
    for existing in target:
        if existing == key:
            if isinstance(existing, bool) != isinstance(key, bool):
                raise ValueError(f"{MIXED_KEYS} ({existing!r}, {key!r}) is more than this evaluator can build")
            raise ValueError(f"insert failed: key {_spelled(key)} already exists")
    return {**target, key: value}


def _spelled(key: Any) -> str:
    """A key as Go's ``%v`` prints a CEL value."""
    return ("true" if key else "false") if isinstance(key, bool) else str(key)


def map_insert_entry(target: Mapping[Any, Any], key: Any, value: Any) -> dict[Any, Any]:
    """``cel.@mapInsert(map, key, value)``: ``transformMap``'s step."""
    return _inserted(target, key, value)


def map_insert_map(target: Mapping[Any, Any], update: Mapping[Any, Any]) -> dict[Any, Any]:
    """``cel.@mapInsert(map, map)``: ``transformMapEntry``'s step, the update's entries one by one."""
    result = dict(target)
    for key, value in update.items():
        result = _inserted(result, key, value)
    return result


def functions() -> list[tuple[str, list[cel.Overload]]]:
    """``cel.@mapInsert`` with cel-go's overload IDs, for the environment selectors run in."""
    T = cel.Type
    any_map = T.Map(T.DYN, T.DYN)
    return [(MAP_INSERT, [
        cel.Overload(_KEY_VALUE, any_map, [any_map, T.DYN, T.DYN], impl=map_insert_entry),
        cel.Overload(_MAP, any_map, [any_map, any_map], impl=map_insert_map),
    ])]


def inserts_into_maps(checked: ast.CheckedExpr) -> bool:
    """The selector builds a map with ``transformMap``/``transformMapEntry``."""
    return any(node.WhichOneof("expr_kind") == "call_expr" and node.call_expr.function == MAP_INSERT
               for node in astwalk.nodes(checked.expr))


def spell_exists_one(tokens: Sequence[Token]) -> list[Token]:
    """``tokens`` with each three-argument ``.exists_one(`` called ``.existsOne(`` (cel-go
    ext/comprehensions.go registers both names for the two-variable form; cel-cpp only the
    second). The one-variable ``exists_one`` is the standard macro, which cel-cpp has."""
    renamed = list(tokens)
    for i in range(1, len(renamed) - 1):
        if renamed[i - 1].text == "." and renamed[i].text == "exists_one" and renamed[i + 1].text == "(":
            if len(split_arguments(renamed[i + 2:matching_bracket(renamed, i + 1)])) == 3:
                renamed[i] = Token(renamed[i].kind, "existsOne", "existsOne")
    return renamed
