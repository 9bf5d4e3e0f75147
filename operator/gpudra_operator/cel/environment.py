"""The CEL environment of a DRA selector: the base set of k8s.io/apiserver/pkg/cel/environment/
base.go (Kubernetes 1.35; what later releases add, per :mod:`.releases`) as far as DRA selectors
can use it, plus what the DRA compiler adds (k8s.io/dynamic-resource-allocation/cel/compile.go
``newCompiler``): the ``device`` variable and ``cel.bind`` (ext.Bindings).

From the base set: optional types; cel-go's strings extension at version 2 (``charAt``,
``indexOf``, ``lastIndexOf``, ``lowerAscii``, ``upperAscii``, ``replace``, ``split``, ``substring``,
``trim``, ``format``, ``quote``, ``join``), from cel-cpp; from this package, the Kubernetes
quantity, semver, list, URL, IP, CIDR, regex (``find``, ``findAll``) and named-format libraries and
cel-go's sets and lists extensions.

:meth:`SelectorEnvironment.compile` also does what cel-go does when it creates the program: a
``find``/``findAll`` pattern that is a literal must compile (:func:`.regexlib.literal_error`). And
it bridges what cel-cpp's Python binding cannot declare directly:

* ``string(ip)`` and ``string(cidr)``: the binding picks a Python function by runtime kind, and both
  are messages, so the standard ``string`` is declared again from the environment config (cel-go's
  overload IDs, these two added) and one function serves both at run time (``function_impls``);
* ``format.named`` and ``validate`` return optionals, which a Python function cannot: they are
  checked with their optional types and run in their :func:`.formatlib.running_form`.

Two things cel-go's checker accepts in the Kubernetes environment and cel-cpp's does not by default
are bridged too:

* the two-variable comprehensions (``ext.TwoVarComprehensions``): cel-cpp's extension of that name
  is enabled in the config, and :mod:`.comprehensionslib` supplies the run-time ``cel.@mapInsert``;
* ordering across numeric types (``cel.CrossTypeNumericComparisons``: ``1 < 1.5``, ``2u > 1``):
  ``<``, ``<=``, ``>``, ``>=`` are declared again with cel-go's cross-type overloads
  (common/stdlib standard.go); cel-cpp's runtime compares across numeric types already.

``first``/``last`` on lists are the optional library's (cel-go's ``cel.OptionalTypes``), which
cel-cpp's has too.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import yaml
from cel_expr_python import cel
from cel_expr_python.ext import ext_bindings, ext_optional, ext_strings
from google.protobuf import any_pb2

from gpudra_operator.cel import (
    cidrlib,
    comprehensionslib,
    cost,
    formatlib,
    iplib,
    listlib,
    quantitylib,
    regexlib,
    semverlib,
    urlslib,
)
from gpudra_operator.cel.opaque import CIDR_TYPE, IP_TYPE, POOL, QuantityMessage, SemverMessage
from gpudra_operator.cel.releases import OLDEST, CelRelease

# cel-go's string() overloads (common/stdlib standard.go), which cel-cpp has too, and the two that
# ip.go and cidr.go add.
_STRING_OVERLOADS = (
    ("string_to_string", "string"), ("bool_to_string", "bool"), ("bytes_to_string", "bytes"),
    ("double_to_string", "double"), ("duration_to_string", "google.protobuf.Duration"),
    ("int64_to_string", "int"), ("timestamp_to_string", "google.protobuf.Timestamp"),
    ("uint64_to_string", "uint"), ("ip_to_string", IP_TYPE), ("cidr_to_string", CIDR_TYPE),
)
# cel-go's ordering overloads (common/stdlib standard.go, with cel.CrossTypeNumericComparisons):
# operator -> its overload-ID prefix; the numeric types (ID spelling, CEL type) order across types.
_ORDERING_OPERATORS = {"_<_": "less", "_<=_": "less_equals", "_>_": "greater", "_>=_": "greater_equals"}
_NUMERIC = (("int64", "int"), ("uint64", "uint"), ("double", "double"))
_ORDERED = (("bool", "bool"), ("string", "string"), ("bytes", "bytes"),
            ("timestamp", "google.protobuf.Timestamp"), ("duration", "google.protobuf.Duration"))
_CHECKED_EXPR_URL = "type.googleapis.com/cel.expr.CheckedExpr"


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


def _overload(overload: str, arguments: tuple[str, ...], result: str) -> dict[str, Any]:
    return {"id": overload, "args": [{"type_name": a} for a in arguments], "return": {"type_name": result}}


def _orderings_across_types() -> list[dict[str, Any]]:
    """``<``, ``<=``, ``>``, ``>=``, each with cel-go's overloads: every pair of numeric types, and
    the other ordered types with themselves."""
    declared = []
    for operator, prefix in _ORDERING_OPERATORS.items():
        numeric = [_overload(prefix + "_" + left if left == right else f"{prefix}_{left}_{right}",
                             (left_type, right_type), "bool")
                   for left, left_type in _NUMERIC for right, right_type in _NUMERIC]
        others = [_overload(f"{prefix}_{name}", (type_name, type_name), "bool") for name, type_name in _ORDERED]
        declared.append({"name": operator, "overloads": numeric + others})
    return declared


def _config(checker_only: list[dict[str, Any]], *, macros: bool) -> cel.EnvConfig:
    """The environment config: the standard ``string`` declared again with the IP and CIDR
    overloads, the orderings with their cross-type ones, and ``checker_only``'s functions, which
    have no Python function of their own. ``macros``: the two-variable comprehensions (which
    declare ``cel.@mapInsert`` without a runtime function: the environment that runs selectors
    declares its own instead)."""
    string = {"name": "string", "overloads": [
        _overload(overload, (argument,), "string") for overload, argument in _STRING_OVERLOADS]}
    replaced = ["string", *_ORDERING_OPERATORS]
    return cel.NewEnvConfigFromYaml(yaml.safe_dump({
        "extensions": [{"name": "two-var-comprehensions"}] if macros else [],
        "stdlib": {"exclude_functions": [{"name": name} for name in replaced]},
        "functions": [string, *_orderings_across_types(), *checker_only]}))


@cache
def _environment(running_form: bool, release: CelRelease) -> cel.Env:
    """The environment ``release``'s selectors compile in; ``running_form``: the one that runs what
    the first cannot (:func:`.formatlib.running_form`'s trees, ``cel.@mapInsert``)."""
    libraries = [*quantitylib.functions(), *semverlib.functions(), *listlib.functions(), *_orderings(),
                 *(listlib.includes_functions(release.limits_includes) if release.has_includes else []),
                 *urlslib.functions(), *iplib.functions(), *cidrlib.functions(), *regexlib.functions(),
                 *formatlib.functions(),
                 *(formatlib.running_functions() + comprehensionslib.functions() if running_form else [])]
    overloads: defaultdict[str, list[cel.Overload]] = defaultdict(list)
    for name, declared in libraries:
        overloads[name].extend(declared)
    kubernetes = cel.CelExtension(
        "kubernetes", [cel.FunctionDecl(name, declared) for name, declared in overloads.items()])
    return cel.NewEnv(
        POOL,
        config=_config([] if running_form else formatlib.checker_declarations(), macros=not running_form),
        variables={"device": cel.Type.Map(cel.Type.STRING, cel.Type.DYN)},
        extensions=[ext_strings.ExtStrings(2), ext_bindings.ExtBindings(), ext_optional.ExtOptional(),
                    kubernetes],
        function_impls={"ip_to_string": iplib.to_string},
    )


@dataclass(frozen=True)
class _RunningForm:
    """A compiled selector that uses ``format.named``/``validate``: what was checked (its type and
    tree, which the cost estimate reads) and what runs."""

    checked: Any
    running: Any

    def eval(self, *args: Any, **kwargs: Any) -> Any:
        return self.running.eval(*args, **kwargs)

    def return_type(self) -> cel.Type:
        return self.checked.return_type()

    def serialize(self) -> bytes:
        return bytes(self.checked.serialize())


@dataclass(frozen=True)
class SelectorEnvironment:
    """Compiles selectors as cel-go's ``env.Compile`` and ``env.Program`` do, to cel-cpp programs,
    in the environment of one Kubernetes release."""

    release: CelRelease = OLDEST

    def compile(self, expression: str) -> Any:
        """The program (``eval``, ``return_type``, ``serialize``, as cel-cpp's); an exception for a
        selector that does not compile or whose program cannot be created."""
        program = _environment(False, self.release).compile(expression)
        checked = cost.checked_expression(program.serialize())
        error = regexlib.literal_error(checked)
        if error is not None:
            raise ValueError(error)
        running = formatlib.running_form(checked)
        if running is None and comprehensionslib.inserts_into_maps(checked):
            running = checked
        if running is None:
            return program
        serialized = any_pb2.Any(type_url=_CHECKED_EXPR_URL, value=running.SerializeToString())
        running_environment = _environment(True, self.release)
        return _RunningForm(program, running_environment.deserialize(serialized.SerializeToString()))


@cache
def selector_environment(release: CelRelease = OLDEST) -> SelectorEnvironment:
    """One environment for every selector of a release: ``device`` is a map (its fields are
    checked at run time; the API server has type-checked every stored selector already)."""
    return SelectorEnvironment(release)

