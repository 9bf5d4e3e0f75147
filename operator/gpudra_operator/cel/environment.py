"""The CEL environment of a DRA selector: the base set of k8s.io/apiserver/pkg/cel/environment/
base.go (Kubernetes 1.35) as far as DRA selectors can use it, plus what the DRA compiler adds
(k8s.io/dynamic-resource-allocation/cel/compile.go ``newCompiler``): the ``device`` variable and
``cel.bind`` (ext.Bindings).

From the base set: optional types; cel-go's strings extension at version 2 (``charAt``,
``indexOf``, ``lastIndexOf``, ``lowerAscii``, ``upperAscii``, ``replace``, ``split``, ``substring``,
``trim``, ``format``, ``quote``, ``join``), from cel-cpp; the Kubernetes quantity, semver and list
libraries and cel-go's sets and lists extensions, from this package.

Not here (a selector using one gets :class:`~gpudra_operator.cel.selector.SelectorCompileError`
with ``unsupported=True``, never a wrong answer): the URL, IP, CIDR, regex ``find``/``findAll``
and named-format libraries (no DRA attribute holds such values), the two-variable comprehensions,
and the compile-time cross-type numeric comparison of literals (``1 < 1.5``; at run time, on the
``dyn`` attribute values a selector compares, cel-cpp compares across types as cel-go does).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from functools import cache
from typing import Any

from cel_expr_python import cel
from cel_expr_python.ext import ext_bindings, ext_optional, ext_strings

from gpudra_operator.cel import listlib, quantitylib, semverlib
from gpudra_operator.cel.opaque import POOL, QuantityMessage, SemverMessage

# Functions of the Kubernetes environment this evaluator does not provide (see the module doc).
UNSUPPORTED_FUNCTIONS = frozenset({
    "url", "isURL", "getScheme", "getHost", "getHostname", "getPort", "getEscapedPath", "getQuery",
    "ip", "isIP", "cidr", "isCIDR", "find", "findAll", "format", "sortBy", "first", "last",
    "transformList", "transformMap", "transformMapEntry", "ip.isCanonical",
})


def _ordering(finish: Callable[[int], Any]) -> Callable[[Any, Any], Any]:
    """``isGreaterThan``/``isLessThan``/``compareTo`` of quantities (quantity.go) and semvers
    (semverlib.go) in one function: cel-cpp dispatches Python functions by runtime kind, and both
    types are messages, so one overload takes both and picks by type here."""
    def ordering(left: Any, right: Any) -> Any:
        for message, compare in ((QuantityMessage, quantitylib.compare), (SemverMessage, semverlib.compare)):
            if isinstance(left, message) and isinstance(right, message):
                return finish(compare(left, right))
        raise TypeError(f"no such overload: {type(left).__name__}, {type(right).__name__}")
    return ordering


def _orderings() -> list[tuple[str, list[cel.Overload]]]:
    T = cel.Type
    return [
        ("isGreaterThan", [cel.Overload("ordered_is_greater_than", T.BOOL, [T.DYN, T.DYN], is_member=True,
                                        impl=_ordering(lambda c: c == 1))]),
        ("isLessThan", [cel.Overload("ordered_is_less_than", T.BOOL, [T.DYN, T.DYN], is_member=True,
                                     impl=_ordering(lambda c: c == -1))]),
        ("compareTo", [cel.Overload("ordered_compare_to", T.INT, [T.DYN, T.DYN], is_member=True,
                                    impl=_ordering(int))]),
    ]


@cache
def selector_environment() -> cel.Env:
    """One environment for every selector: ``device`` is a map (its fields are checked at run
    time; the API server has type-checked every stored selector already)."""
    overloads: defaultdict[str, list[cel.Overload]] = defaultdict(list)
    for name, declared in [*quantitylib.functions(), *semverlib.functions(), *listlib.functions(), *_orderings()]:
        overloads[name].extend(declared)
    kubernetes = cel.CelExtension(
        "kubernetes", [cel.FunctionDecl(name, declared) for name, declared in overloads.items()])
    return cel.NewEnv(
        POOL,
        variables={"device": cel.Type.Map(cel.Type.STRING, cel.Type.DYN)},
        extensions=[ext_strings.ExtStrings(2), ext_bindings.ExtBindings(), ext_optional.ExtOptional(),
                    kubernetes],
    )
