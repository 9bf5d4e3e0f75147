"""Compile a DRA selector and evaluate it on one device, as the scheduler does
(k8s.io/dynamic-resource-allocation/cel/compile.go, 1.35: ``CompileCELExpression`` and
``CompilationResult.DeviceMatches``).

* ``device.driver``, ``device.allowMultipleAllocations``, ``device.attributes[domain][id]`` and
  ``device.capacity[domain][id]``; a name without a domain lives in the driver's.
* ``device.attributes[d]`` of a domain the device lacks is an empty map (upstream's
  ``newStringInterfaceMapWithDefault``: every lookup finds something), so
  ``device.attributes["x"].y`` is a "no such key" error, never false, while the maps' size, keys
  and ``in`` see only the device's own domains. cel-cpp's maps have no default, so the selector
  runs with each lookup on ``device.attributes``/``device.capacity`` written as an optional
  lookup that falls back to ``{}`` (:func:`_with_default_domains`). Lookups through an alias
  (``cel.bind(a, device.attributes, a["x"])``) are covered by giving the domains the selector names
  as string literals an empty map, where the selector never looks at the whole map.
* A version attribute that is not semver, or a capacity that is not a quantity, makes the device
  an error before the expression runs, as ``getAttributeValue`` does.
* An error is "does not match, with an error" (:class:`SelectorResult`), which is how the
  scheduler's allocator treats a selector that fails on a device.

Cost: the API server refuses a selector whose estimated cost exceeds ``CELSelectorExpressionMaxCost``
(1,000,000), and the scheduler stops a run that costs more (compile.go ``cel.CostLimit``). cel-cpp
counts no cost, so each compiled selector carries a bound of what the scheduler's run counts
(:func:`.cost.runtime_bound`, with the largest sizes the API allows). Within the limit, which
every everyday selector is by orders of magnitude, the run can never be stopped and the selector is
evaluated as it is. Past it, the bound is taken again with the device's own sizes; where even that
is past the limit, the result is "does not match, with an error" marked ``undetermined``: the
scheduler may or may not stop there. The estimate the API server checks is kept as ``max_cost``.
The byte limit (:func:`gpudra_driver.limits.check_cel_expression`) is checked before compiling.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any

from cel_expr_python import cel

from gpudra_driver import limits
from gpudra_operator.cel import astwalk, cost, quantitylib, semverlib, urlslib
from gpudra_operator.cel.comprehensionslib import MIXED_KEYS, spell_exists_one
from gpudra_operator.cel.environment import selector_environment
from gpudra_operator.cel.releases import OLDEST, CelRelease
from gpudra_operator.cel.listlib import SORT_BY_KEYS
from gpudra_operator.cel.sortby import SortByError, expand_sort_by
from gpudra_operator.deviceclasses.celrefs import CelSyntaxError, Token, cel_tokens, matching_bracket, token_is

_STATUS_PREFIX = re.compile(r"^[A-Z_]+: ")
_STATUS_SUFFIX = re.compile(r" \[[A-Z_]+\]$")
# cel-cpp's words for a missing key, in cel-go's (what the scheduler's events say).
_ITERATION_BUDGET = "Iteration budget exceeded"
_MISSING_KEY = re.compile(r'^Key not found in map : "(.*)"$')


class SelectorCompileError(ValueError):
    """A selector that does not compile."""

    @property
    def syntax(self) -> bool:
        """A parse error: the grammar is CEL's own, so the API server refuses it too."""
        return "Syntax error" in self.message

    def __init__(self, expression: str, message: str) -> None:
        super().__init__(message)
        self.expression = expression
        self.message = message


@dataclass(frozen=True)
class SelectorResult:
    """The answer for one device: matched, or not; ``error`` set means "not, because it failed"."""

    matched: bool
    error: str | None = None
    undetermined: bool = False  # the run may exceed the runtime cost limit: the scheduler's answer is unknown


@dataclass(frozen=True)
class DeviceInput:
    """compile.go's ``Device``: what a selector sees of one device. ``attributes`` and ``capacity``
    are the ResourceSlice's own maps (qualified name -> DeviceAttribute / DeviceCapacity)."""

    driver: str
    attributes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    capacity: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    allow_multiple_allocations: bool = False

    @cached_property
    def maps(self) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
        """``device.attributes`` and ``device.capacity`` by domain, built once per device (every
        selector sees the same); ``ValueError`` for a malformed version or quantity."""
        return _device_maps(self)


def device_input(driver: str, device: Mapping[str, Any]) -> DeviceInput:
    """The input for one entry of a ResourceSlice's ``spec.devices``."""
    return DeviceInput(driver=driver, attributes=device.get("attributes") or {},
                       capacity=device.get("capacity") or {},
                       allow_multiple_allocations=bool(device.get("allowMultipleAllocations")))


def _split(name: str, driver: str) -> tuple[str, str]:
    domain, sep, ident = name.partition("/")  # parseQualifiedName: the first "/" splits
    return (domain, ident) if sep else (driver, name)


def _attribute_value(name: str, attribute: Mapping[str, Any]) -> Any:
    """getAttributeValue: the one value of a DeviceAttribute (int, bool, string, version)."""
    for kind in ("int", "bool", "string"):
        if attribute.get(kind) is not None:
            return attribute[kind]
    if attribute.get("version") is not None:
        try:
            return semverlib.parse(attribute["version"])
        except ValueError as error:
            raise ValueError(f"attribute {name}: parse semantic version: {error}") from None
    raise ValueError(f"attribute {name}: unsupported attribute value")


def _device_maps(device: DeviceInput) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    attributes: dict[str, dict[str, Any]] = {}
    for name, attribute in device.attributes.items():
        domain, ident = _split(name, device.driver)
        attributes.setdefault(domain, {})[ident] = _attribute_value(name, attribute)
    capacity: dict[str, dict[str, Any]] = {}
    for name, entry in device.capacity.items():
        domain, ident = _split(name, device.driver)
        try:
            capacity.setdefault(domain, {})[ident] = quantitylib.parse(str(entry.get("value")))
        except ValueError as error:
            raise ValueError(f"capacity {name}: {error}") from None
    return attributes, capacity


def _message(error: object) -> str:
    text = _STATUS_SUFFIX.sub("", _STATUS_PREFIX.sub("", str(error).strip().splitlines()[0]))
    return _MISSING_KEY.sub(r"no such key: \1", text)


def _failed(message: str) -> SelectorResult:
    if message.startswith(MIXED_KEYS):
        return SelectorResult(False, message, undetermined=True)
    if message.startswith(_ITERATION_BUDGET):
        # cel-cpp's RuntimeOptions.comprehension_max_iterations (10,000; the Python binding does not
        # let it be raised): cel-go has no such limit, only the cost one.
        return SelectorResult(False, (
            "the selector loops more than 10,000 times, more than this evaluator runs (the scheduler "
            "has no such limit, only the cost limit)"), undetermined=True)
    return SelectorResult(False, message)


@dataclass(frozen=True)
class CompiledSelector:
    expression: str
    program: Any
    literals: frozenset[str]  # domains named as literals: empty maps for lookups through an alias
    checked: Any = field(repr=False, compare=False)  # the checked AST, for the per-device cost bound
    max_cost: int = 0  # the estimate the API server compares with the limit
    run_bound: int = 0  # what a run can cost on the largest device the API allows
    release: CelRelease = OLDEST  # whose CEL: the cluster's

    @property
    def within_cost_limit(self) -> bool:
        """What the API server checks: estimated within ``CELSelectorExpressionMaxCost``."""
        return self.max_cost <= cost.SELECTOR_MAX_COST

    def evaluate(self, device: DeviceInput, *, cost_limit: int | None = cost.SELECTOR_MAX_COST) -> SelectorResult:
        """The answer for one device. ``cost_limit`` is compile.go's ``Options.CostLimit``: the
        scheduler's is the default; None evaluates regardless (the libraries' own tests)."""
        try:
            shared_attributes, shared_capacity = device.maps
        except ValueError as error:
            return SelectorResult(False, str(error))
        if cost_limit is not None and self.run_bound > cost_limit:
            sizes = cost.device_sizes(device.driver, shared_attributes, shared_capacity)
            bound = cost.runtime_bound(self.checked, sizes, self.release)
            if bound > cost_limit:
                return SelectorResult(False, (
                    f"the run may exceed the CEL cost limit of {cost_limit:,} (estimated up to "
                    f"{cost.describe(bound)} on this device), where the scheduler stops it; this "
                    "evaluator cannot count the actual cost"), undetermined=True)
        attributes, capacity = dict(shared_attributes), dict(shared_capacity)
        for literal in self.literals:
            attributes.setdefault(literal, {})
            capacity.setdefault(literal, {})
        variables = {"device": {"driver": device.driver, "allowMultipleAllocations": device.allow_multiple_allocations,
                                "attributes": attributes, "capacity": capacity}}
        strict = urlslib.strict_colons.set(self.release.strict_url_colons)
        try:
            value = self.program.eval(data=variables)
        except Exception as error:  # noqa: BLE001 - cel-cpp raises RuntimeError for what it cannot run
            return _failed(_message(error))
        finally:
            urlslib.strict_colons.reset(strict)
        if value.type() == cel.Type.ERROR:
            return _failed(_message(value.value()))
        result = value.value()
        if not isinstance(result, bool):
            return SelectorResult(False, f"CEL result of type {value.type().name()} could not be converted to bool")
        return SelectorResult(result)


@lru_cache(maxsize=1024)
def compile_selector(expression: str, release: CelRelease = OLDEST) -> CompiledSelector:
    """The compiled selector, as ``release`` compiles, costs and runs it, or
    :class:`SelectorCompileError` saying why not."""
    try:
        limits.check_cel_expression("selector", expression)
    except limits.LimitError as error:
        raise SelectorCompileError(expression, str(error)) from None
    source = expression
    if "sortBy" in expression or "exists_one" in expression:
        try:
            source = " ".join(t.text for t in expand_sort_by(spell_exists_one(cel_tokens(expression))))
        except SortByError as error:
            raise SelectorCompileError(expression, f"compilation failed: {error}") from None
        except CelSyntaxError:
            pass  # cel-cpp's parser says what is wrong
    try:
        program = selector_environment(release).compile(source)
    except Exception as error:  # noqa: BLE001 - cel-cpp reports parse and check errors as RuntimeError
        detail = _STATUS_SUFFIX.sub("", "\n".join(line for line in str(error).splitlines() if line.strip()))
        raise SelectorCompileError(expression, f"compilation failed: {_STATUS_PREFIX.sub('', detail)}") from None
    result_type = program.return_type()
    if result_type != cel.Type.BOOL and result_type != cel.Type.DYN:
        raise SelectorCompileError(expression, f"must evaluate to bool or the unknown type, not {result_type.name()}")
    checked = cost.checked_expression(program.serialize())
    mismatch = _heterogeneous_literal(checked) or _incomparable_sort_keys(checked)
    if mismatch is not None:
        raise SelectorCompileError(expression, f"compilation failed: {mismatch}")
    literals: frozenset[str] = frozenset()
    try:
        tokens = cel_tokens(source)
        rewritten, whole_map = _with_default_domains(tokens)
        if not whole_map:
            literals = frozenset(t.value for t in tokens if t.kind == "string" and t.value)
        if rewritten != tokens:
            program = selector_environment(release).compile(" ".join(t.text for t in rewritten))
    except (CelSyntaxError, RuntimeError):  # the small lexer misread it: lookups of absent domains fail
        pass
    return CompiledSelector(expression, program, literals, checked, cost.estimate(checked, release=release).high,
                            cost.runtime_bound(checked, release=release), release)


def _heterogeneous_literal(checked: Any) -> str | None:
    """The Kubernetes environment's ``cel.ValidateHomogeneousAggregateLiterals`` (cel-go
    cel/validator.go; base.go from 1.29), which cel-cpp does not have: a list literal's elements,
    and a map literal's keys and values, must be of one type. An empty list or map, and
    ``optional.none()``, fit any (cel-go unifies their types first; cel-cpp leaves them ``dyn``).
    Arguments of ``format`` are exempt, as the API server has it."""
    exempt: set[int] = set()
    for node in astwalk.nodes(checked.expr):
        if node.WhichOneof("expr_kind") == "call_expr" and node.call_expr.function == "format":
            exempt.update(n.id for argument in node.call_expr.args for n in astwalk.nodes(argument))
    for node in astwalk.nodes(checked.expr):
        if node.id in exempt:
            continue
        kind = node.WhichOneof("expr_kind")
        if kind == "list_expr":
            groups = [list(node.list_expr.elements)]
        elif kind == "struct_expr" and not node.struct_expr.message_name:
            groups = [[e.map_key for e in node.struct_expr.entries], [e.value for e in node.struct_expr.entries]]
        else:
            continue
        for members in groups:
            expected: cost.CelType | None = None
            for member in members:
                if _fits_any(member):
                    continue
                found = cost.cel_type(checked.type_map[member.id]) if member.id in checked.type_map else None
                if found is None:
                    continue
                if expected is None:
                    expected = found
                elif found != expected:
                    return f"expected type '{expected}' but found '{found}'"
    return None


_COMPARABLE = frozenset({"int", "uint", "double", "bool", "duration", "timestamp", "string", "bytes", "dyn", "any"})


def _incomparable_sort_keys(checked: Any) -> str | None:
    """ext/lists.go declares ``@sortByAssociatedKeys`` for comparable key types only, so cel-go
    finds no overload for a ``sortBy`` whose key is a list, a map or a message."""
    for node in astwalk.nodes(checked.expr):
        call = node.call_expr if node.WhichOneof("expr_kind") == "call_expr" else None
        if call is None or call.function != SORT_BY_KEYS or len(call.args) != 1 or call.args[0].id not in checked.type_map:
            continue
        keys = cost.cel_type(checked.type_map[call.args[0].id])
        if keys.kind == "list" and keys.params and keys.params[0].kind not in _COMPARABLE:
            return f"found no matching overload for 'sortBy' with keys of type '{keys.params[0]}'"
    return None


def _fits_any(node: Any) -> bool:
    kind = node.WhichOneof("expr_kind")
    if kind == "list_expr":
        return not node.list_expr.elements
    if kind == "struct_expr":
        return not node.struct_expr.message_name and not node.struct_expr.entries
    return kind == "call_expr" and node.call_expr.function == "optional.none"


_DOMAIN_MAPS = ("attributes", "capacity")


def _with_default_domains(tokens: list[Token]) -> tuple[list[Token], bool]:
    """The selector with ``device.attributes[k]`` as ``device.attributes[?k].orValue({})`` (and
    ``device.attributes.k`` as ``[?"k"]``, ``has(device.attributes.k)`` as ``true``: upstream's map
    finds every key), and whether it uses a domain map whole (its size, keys, ``in``, a macro)."""
    out: list[Token] = []
    whole_map = False
    i = 0
    while i < len(tokens):
        if not (token_is(tokens, i, "ident", "device") and (i == 0 or tokens[i - 1].text != ".")
                and token_is(tokens, i + 1, "op", ".") and i + 2 < len(tokens) and tokens[i + 2].text in _DOMAIN_MAPS):
            out.append(tokens[i])
            i += 1
            continue
        head = tokens[i:i + 3]
        after = i + 3
        if token_is(tokens, after, "op", "["):
            end = matching_bracket(tokens, after)
            inner, inner_whole = _with_default_domains(tokens[after + 1:end])
            whole_map |= inner_whole
            out += [*head, Token("op", "[", None), Token("op", "?", None), *inner, Token("op", "]", None),
                    *_OR_EMPTY]
            i = end + 1
        elif token_is(tokens, after, "op", ".") and token_is(tokens, after + 1, "ident") and not token_is(tokens, after + 2, "op", "("):
            name = tokens[after + 1].text
            if len(out) >= 2 and out[-1].text == "(" and out[-2].text == "has" and token_is(tokens, after + 2, "op", ")"):
                out[-2:] = [Token("ident", "true", "true")]  # has(device.attributes.x): always found
                i = after + 3
                continue
            out += [*head, Token("op", "[", None), Token("op", "?", None), Token("string", f'"{name}"', name),
                    Token("op", "]", None), *_OR_EMPTY]
            i = after + 2
        else:
            whole_map = True
            out += head
            i = after
    return out, whole_map


_OR_EMPTY = [Token("op", ".", None), Token("ident", "orValue", "orValue"), Token("op", "(", None),
             Token("op", "{", None), Token("op", "}", None), Token("op", ")", None)]
