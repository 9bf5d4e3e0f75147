"""The list functions the Kubernetes CEL base environment enables (k8s.io/apiserver/pkg/cel/
environment/base.go, 1.35), for the list values a selector can build:

* the Kubernetes list library, k8s.io/apiserver/pkg/cel/library/lists.go: ``isSorted``, ``sum``,
  ``min``, ``max``, ``indexOf``, ``lastIndexOf`` (string ``indexOf``/``lastIndexOf`` are cel-go's
  strings extension, which cel-cpp provides), and ``includes`` (:func:`includes_functions`: its
  version 1's from Kubernetes 1.37, the DRA compiler's in 1.36);
* cel-go's sets extension (ext/sets.go): ``sets.contains``, ``sets.equivalent``, ``sets.intersects``;
* cel-go's lists extension, version 3 (ext/lists.go): ``lists.range``, ``distinct``, ``flatten``,
  ``reverse``, ``slice``, ``sort``, and ``sortBy``: a macro upstream, expanded here as upstream
  expands it (:mod:`.sortby`) into ``__sortByAssociatedKeys__``, this module's
  ``@sortByAssociatedKeys``. (``first`` and ``last`` are cel-go's optional library's, version 2,
  which cel-cpp's optional extension has too.)

cel-cpp dispatches Python functions by runtime kind, so each function has one ``list`` overload
typed ``dyn`` and checks its elements itself, as upstream's type-checked overloads would."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cel_expr_python import cel

from gpudra_operator.cel import gosort


def cel_equal(a: Any, b: Any) -> bool:
    """CEL's heterogeneous equality: numbers compare by value across int/uint/double, a bool is
    never equal to a number, lists and maps compare element by element."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(cel_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(cel_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and bool(a == b)


def _comparable(values: list[Any]) -> list[Any]:
    for value in values:
        if not isinstance(value, (int, float, str, bytes)):
            raise TypeError(f"no such overload: {type(value).__name__} is not comparable")
    return values


def _is_sorted(values: list[Any]) -> bool:
    items = _comparable(values)
    return all(items[i] <= items[i + 1] for i in range(len(items) - 1))


def _sum(values: list[Any]) -> Any:
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"no such overload: sum over {type(value).__name__}")
    return sum(values) if values else 0


def _extreme(name: str, pick: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    def extreme(values: list[Any]) -> Any:
        if not values:
            raise ValueError(f"{name} called on empty list")  # lists.go cmp()
        return pick(_comparable(values))
    return extreme


def _index_of(values: list[Any], item: Any) -> int:
    return next((i for i, value in enumerate(values) if cel_equal(value, item)), -1)


def _last_index_of(values: list[Any], item: Any) -> int:
    return next((i for i in range(len(values) - 1, -1, -1) if cel_equal(values[i], item)), -1)


def _contains(values: list[Any], subset: list[Any]) -> bool:
    return all(any(cel_equal(x, y) for y in values) for x in subset)


def _intersects(a: list[Any], b: list[Any]) -> bool:
    return any(any(cel_equal(x, y) for y in b) for x in a)


def _distinct(values: list[Any]) -> list[Any]:
    out: list[Any] = []
    for value in values:
        if not any(cel_equal(value, seen) for seen in out):
            out.append(value)
    return out


def _flatten(values: list[Any], depth: int = 1) -> list[Any]:
    if depth < 0:
        raise ValueError("level must be non-negative")  # ext/lists.go flatten
    out: list[Any] = []
    for value in values:
        if isinstance(value, list) and depth > 0:
            out.extend(_flatten(value, depth - 1))
        else:
            out.append(value)
    return out


def _slice(values: list[Any], start: int, end: int) -> list[Any]:
    # ext/lists.go slice: the same errors, in the same order.
    if start < 0 or end < 0:
        raise ValueError(f"cannot slice({start}, {end}), negative indexes not supported")
    if start > end:
        raise ValueError(f"cannot slice({start}, {end}), start index must be less than or equal to end index")
    if len(values) < end:
        raise ValueError(f"cannot slice({start}, {end}), list is length {len(values)}")
    return values[start:end]


def _sort_by_associated_keys(values: list[Any], keys: list[Any]) -> list[Any]:
    # ext/lists.go sortListByAssociatedKeys: the same checks and messages, and Go's sort.Slice on
    # the indices (equal keys end up in its order, which is not a stable sort's).
    if len(values) != len(keys):
        raise ValueError("@sortByAssociatedKeys() expected a list of the same size as the associated keys list, "
                         f"but got {len(values)} and {len(keys)} elements respectively")
    if not values:
        return values
    if not isinstance(keys[0], (int, float, str, bytes)):
        raise ValueError("list elements must be comparable")
    if any(type(key) is not type(keys[0]) for key in keys):
        raise ValueError("list elements must have the same type")
    order = list(range(len(values)))

    def swap(i: int, j: int) -> None:
        order[i], order[j] = order[j], order[i]

    gosort.sort_slice(len(order), lambda i, j: keys[order[i]] < keys[order[j]], swap)
    return [values[i] for i in order]


# The name sortBy's expansion calls (upstream's "@sortByAssociatedKeys", which source cannot spell).
SORT_BY_KEYS = "__sortByAssociatedKeys__"


def _range(n: int) -> list[int]:
    return list(range(n))


# resourceapi.ResourceSliceMaxAttributeValuesPerDevice: 1.36's includes refuses longer lists.
MAX_ATTRIBUTE_VALUES = 48


def _includes(target: Any, element: Any) -> bool:
    """lists.go ``includes``: a list holds the element, or any other value equals it."""
    if isinstance(target, list):
        return any(cel_equal(item, element) for item in target)
    return cel_equal(target, element)


def _includes_limited(target: Any, element: Any) -> bool:
    """compile.go ``includesFunc`` (1.36): as :func:`_includes`, but a list searched past its 48th
    value is an error."""
    if isinstance(target, list) and len(target) > MAX_ATTRIBUTE_VALUES:
        if _includes(target[:MAX_ATTRIBUTE_VALUES], element):
            return True
        raise ValueError(f"'includes' function cannot be applied to lists longer than {MAX_ATTRIBUTE_VALUES} values")
    return _includes(target, element)


def includes_functions(limited: bool) -> list[tuple[str, list[cel.Overload]]]:
    """``<dyn>.includes(<dyn>)``: 1.36's (``limited``, the DRA compiler's) or 1.37's (the list
    library's version 1), with their overload IDs."""
    T = cel.Type
    overload, impl = ("dra_includes_dyn_dyn", _includes_limited) if limited else ("list_includes_dyn_dyn", _includes)
    return [("includes", [cel.Overload(overload, T.BOOL, [T.DYN, T.DYN], is_member=True, impl=impl)])]


def functions() -> list[tuple[str, list[cel.Overload]]]:
    """(function name, overloads), merged with the other libraries' by :mod:`.environment`."""
    T = cel.Type
    LIST = T.List(T.DYN)

    def member(name: str, overload: str, result: cel.Type, params: list[cel.Type],
               impl: Callable[..., Any]) -> tuple[str, list[cel.Overload]]:
        return name, [cel.Overload(overload, result, params, is_member=True, impl=impl)]

    def glob(name: str, overload: str, result: cel.Type, params: list[cel.Type],
             impl: Callable[..., Any]) -> tuple[str, list[cel.Overload]]:
        return name, [cel.Overload(overload, result, params, impl=impl)]

    return [
        member("isSorted", "list_is_sorted_bool", T.BOOL, [LIST], _is_sorted),
        member("sum", "list_sum", T.DYN, [LIST], _sum),
        member("min", "list_min", T.DYN, [LIST], _extreme("min", min)),
        member("max", "list_max", T.DYN, [LIST], _extreme("max", max)),
        member("indexOf", "list_a_index_of_int", T.INT, [LIST, T.DYN], _index_of),
        member("lastIndexOf", "list_a_last_index_of_int", T.INT, [LIST, T.DYN], _last_index_of),
        glob("sets.contains", "list_sets_contains_list", T.BOOL, [LIST, LIST], _contains),
        glob("sets.equivalent", "list_sets_equivalent_list", T.BOOL, [LIST, LIST],
             lambda a, b: _contains(a, b) and _contains(b, a)),
        glob("sets.intersects", "list_sets_intersects_list", T.BOOL, [LIST, LIST], _intersects),
        glob("lists.range", "lists_range", T.List(T.INT), [T.INT], _range),  # list(int), as ext/lists.go
        member("distinct", "list_distinct", LIST, [LIST], _distinct),
        ("flatten", [
            cel.Overload("list_flatten", LIST, [LIST], is_member=True, impl=_flatten),
            cel.Overload("list_flatten_int", LIST, [LIST, T.INT], is_member=True, impl=_flatten)]),
        member("reverse", "list_reverse", LIST, [LIST], lambda values: values[::-1]),
        member("slice", "list_slice", LIST, [LIST, T.INT, T.INT], _slice),
        member("sort", "list_sort", LIST, [LIST], lambda values: sorted(_comparable(values))),
        member(SORT_BY_KEYS, "list_sortByAssociatedKeys", LIST, [LIST, LIST], _sort_by_associated_keys),
    ]
