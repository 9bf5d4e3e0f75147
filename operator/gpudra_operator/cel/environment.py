"""The CEL environment of a DRA selector: the base set of k8s.io/apiserver/pkg/cel/environment/
base.go (Kubernetes 1.35) as far as DRA selectors can use it, plus what the DRA compiler adds
(k8s.io/dynamic-resource-allocation/cel/compile.go ``newCompiler``): the ``device`` variable and
``cel.bind`` (ext.Bindings).

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

Not here (a selector using one gets :class:`~gpudra_operator.cel.selector.SelectorCompileError`
with ``unsupported=True``, never a wrong answer): the two-variable comprehensions and ``transformList``/``transformMap``/``transformMapEntry``
(ext.TwoVarComprehensions; macros cel-cpp's Python binding does not offer), and the compile-time
cross-type numeric comparison of literals (``1 < 1.5``; at run time, on the ``dyn`` attribute
values a selector compares, cel-cpp compares across types as cel-go does). ``first``/``last`` on
lists are the optional library's (cel-go's ``cel.OptionalTypes``), which cel-cpp's has too.
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

# Functions of the Kubernetes environment this evaluator does not provide (see the module doc).
UNSUPPORTED_FUNCTIONS = frozenset({"transformList", "transformMap", "transformMapEntry"})

# cel-go's string() overloads (common/stdlib standard.go), which cel-cpp has too, and the two that
# ip.go and cidr.go add.
_STRING_OVERLOADS = (
    ("string_to_string", "string"), ("bool_to_string", "bool"), ("bytes_to_string", "bytes"),
    ("double_to_string", "double"), ("duration_to_string", "google.protobuf.Duration"),
    ("int64_to_string", "int"), ("timestamp_to_string", "google.protobuf.Timestamp"),
    ("uint64_to_string", "uint"), ("ip_to_string", IP_TYPE), ("cidr_to_string", CIDR_TYPE),
)
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


def _config(checker_only: list[dict[str, Any]]) -> cel.EnvConfig:
    """The environment config: the standard ``string`` declared again with the IP and CIDR
    overloads, and ``checker_only``'s functions, which have no Python function of their own."""
    string = {"name": "string", "overloads": [
        {"id": overload, "args": [{"type_name": argument}], "return": {"type_name": "string"}}
        for overload, argument in _STRING_OVERLOADS]}
    return cel.NewEnvConfigFromYaml(yaml.safe_dump({
        "stdlib": {"exclude_functions": [{"name": "string"}]}, "functions": [string, *checker_only]}))


@cache
def _environment(running_form: bool) -> cel.Env:
    """The environment; ``running_form``: the one :func:`.formatlib.running_form` trees run in."""
    libraries = [*quantitylib.functions(), *semverlib.functions(), *listlib.functions(), *_orderings(),
                 *urlslib.functions(), *iplib.functions(), *cidrlib.functions(), *regexlib.functions(),
                 *formatlib.functions(), *(formatlib.running_functions() if running_form else [])]
    overloads: defaultdict[str, list[cel.Overload]] = defaultdict(list)
    for name, declared in libraries:
        overloads[name].extend(declared)
    kubernetes = cel.CelExtension(
        "kubernetes", [cel.FunctionDecl(name, declared) for name, declared in overloads.items()])
    return cel.NewEnv(
        POOL,
        config=_config([] if running_form else formatlib.checker_declarations()),
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


class SelectorEnvironment:
    """Compiles selectors as cel-go's ``env.Compile`` and ``env.Program`` do, to cel-cpp programs."""

    def compile(self, expression: str) -> Any:
        """The program (``eval``, ``return_type``, ``serialize``, as cel-cpp's); an exception for a
        selector that does not compile or whose program cannot be created."""
        program = _environment(False).compile(expression)
        checked = cost.checked_expression(program.serialize())
        error = regexlib.literal_error(checked)
        if error is not None:
            raise ValueError(error)
        running = formatlib.running_form(checked)
        if running is None:
            return program
        serialized = any_pb2.Any(type_url=_CHECKED_EXPR_URL, value=running.SerializeToString())
        return _RunningForm(program, _environment(True).deserialize(serialized.SerializeToString()))


@cache
def selector_environment() -> SelectorEnvironment:
    """One environment for every selector: ``device`` is a map (its fields are checked at run
    time; the API server has type-checked every stored selector already)."""
    return SelectorEnvironment()

