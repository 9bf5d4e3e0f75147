"""The worst-case cost of a DRA selector, in CEL's cost units, as the API server estimates it.

The API server refuses a selector whose estimated cost exceeds ``CELSelectorExpressionMaxCost``
(1,000,000; k8s.io/api/resource/v1 types.go), and the scheduler stops a run past the same limit
(k8s.io/dynamic-resource-allocation/cel/compile.go ``CompileCELExpression``). The estimate is an
upper bound of what cel-go's runtime cost tracker counts, so a selector estimated within the limit
can never hit the runtime limit: :mod:`.selector` relies on that.

This is a port of, each part citing its source:

* cel-go v0.26.0 (Kubernetes 1.35 and 1.36) ``checker/cost.go``: the coster, its size and cost
  ranges and their saturating arithmetic, paths, local variables, comprehensions, ``cel.bind``;
* cel-go ``common/cost.go``: the unit costs;
* cel-go ``ext/lists.go`` and ``ext/sets.go``: the estimators those extensions register;
* k8s.io/apiserver/pkg/cel/library/cost.go ``EstimateCallCost``: the Kubernetes libraries'
  functions, by name;
* k8s.io/dynamic-resource-allocation/cel/compile.go ``sizeEstimator``: the largest sizes of what
  ``device`` holds, and the base environment's ``PresenceTestHasCost(false)``
  (k8s.io/apiserver/pkg/cel/environment/base.go).

It walks cel-cpp's checked expression (the same tree cel-go checks: the macros expand alike). One
difference is bridged here: this evaluator declares ``device`` as a ``map(string, dyn)``, where
cel-go knows its fields' types (a map of maps, quantities, a bool). A node whose path starts at
``device`` takes the type cel-go gives it (:data:`_DEVICE`), and the overloads cel-go would not
pick for that type are dropped (:func:`_fits`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import any_pb2

from gpudra_operator.cel.gen import checked_ast_pb2 as ast
from gpudra_operator.cel.releases import OLDEST, CelRelease

# k8s.io/api/resource/v1 CELSelectorExpressionMaxCost.
SELECTOR_MAX_COST = 1_000_000

_MAX = 2**64 - 1
_TWO_TO_64 = float(2**64)
# Past this, a cost only says that some size on the way is unknown (2^64-1 scaled by a factor).
_UNBOUNDED = 10**15
# common/cost.go
_SELECT_AND_IDENT = 1
_LIST_CREATE = 10
_MAP_CREATE = 30
_STRUCT_CREATE = 40
_STRING_TRAVERSAL = 0.1
_REGEX_LENGTH = 0.25
# k8s.io/apiserver/pkg/cel/limits.go
_MAX_FORMAT_SIZE = 64
_MAX_NAME_FORMAT_REGEX_SIZE = 128
# resourceapi.ResourceSliceMaxAttributeValuesPerDevice
_MAX_ATTRIBUTE_VALUES = 48
# library/format.go: the longest regex a named format stands for (urlLength, the URI format's)
_URL_FORMAT_REGEX_SIZE = 1103
# parser.AccumulatorName and HiddenAccumulatorName.
_ACCUMULATORS = frozenset({"@result", "__result__"})


def _add(x: int, y: int) -> int:
    return _MAX if y > 0 and x > _MAX - y else x + y


def _multiply(x: int, y: int) -> int:
    return _MAX if y != 0 and x > _MAX // y else x * y


def _by_factor(x: int, factor: float) -> int:
    # cost.go multiplyByCostFactor: in float64, saturating at 2^64-1.
    value = float(x)
    if value > 0 and factor > 0 and value > _MAX / factor:
        return _MAX
    product = math.ceil(value * factor)
    return _MAX if product >= _TWO_TO_64 else int(product)


@dataclass(frozen=True)
class Range:
    """cel-go's ``SizeEstimate`` and ``CostEstimate`` (the same arithmetic): ``low``..``high``."""

    low: int
    high: int

    def add(self, other: Range) -> Range:
        return Range(_add(self.low, other.low), _add(self.high, other.high))

    def multiply(self, other: Range) -> Range:
        return Range(_multiply(self.low, other.low), _multiply(self.high, other.high))

    def by_factor(self, factor: float) -> Range:
        return Range(_by_factor(self.low, factor), _by_factor(self.high, factor))

    def union(self, other: Range) -> Range:
        return Range(min(self.low, other.low), max(self.high, other.high))


def fixed(value: int) -> Range:
    return Range(value, value)


UNKNOWN = Range(0, _MAX)
_CALL = fixed(1)


@dataclass(frozen=True)
class CelType:
    """What the estimator asks of a type: its kind (cel-go's ``types.Kind``), name and parameters."""

    kind: str
    name: str = ""
    params: tuple[CelType, ...] = ()

    def __str__(self) -> str:
        """As cel-go writes it in messages: ``int``, ``list(int)``, ``map(string, int)``."""
        base = self.name if self.name and self.kind in ("struct", "opaque", "type_param") else self.kind
        return f"{base}({', '.join(map(str, self.params))})" if self.params else base


_DYN = CelType("dyn")
_STRING = CelType("string")
_PRIMITIVES = {1: "bool", 2: "int", 3: "uint", 4: "double", 5: "string", 6: "bytes"}
_WELL_KNOWN = {1: "any", 2: "timestamp", 3: "duration"}
# The Kubernetes value types, as messages here (opaque.py) and as cel-go knows them
# (k8s.io/apiserver/pkg/cel: Quantity, Semver, URL and Format are objects; IP and CIDR opaque).
_KUBERNETES_TYPES = {"Quantity": "struct", "Semver": "struct", "URL": "struct", "Format": "struct",
                     "IP": "opaque", "CIDR": "opaque"}


def cel_type(message: ast.Type) -> CelType:
    """A checked type, as the estimator and the literal check read it."""
    kind = message.WhichOneof("type_kind")
    if kind == "primitive":
        return CelType(_PRIMITIVES.get(message.primitive, "dyn"))
    if kind == "wrapper":
        return CelType(_PRIMITIVES.get(message.wrapper, "dyn"), "wrapper")
    if kind == "well_known":
        return CelType(_WELL_KNOWN.get(message.well_known, "dyn"))
    if kind == "list_type":
        return CelType("list", "list", (cel_type(message.list_type.elem_type),))
    if kind == "map_type":
        return CelType("map", "map", (cel_type(message.map_type.key_type), cel_type(message.map_type.value_type)))
    if kind == "message_type":
        short = message.message_type.rpartition(".")[2]
        short = "Format" if short == "NamedFormat" else short  # kubernetes.NamedFormat: cel.FormatType
        return CelType(_KUBERNETES_TYPES.get(short, "struct"), short)
    if kind == "type_param":
        return CelType("type_param", message.type_param)
    if kind == "abstract_type":
        return CelType("opaque", message.abstract_type.name,
                       tuple(cel_type(p) for p in message.abstract_type.parameter_types))
    return CelType({"null": "null", "type": "type", "error": "error", "function": "function"}.get(kind or "", "dyn"))


@dataclass(frozen=True)
class _Decl:
    """A node of compile.go's declared ``device`` type: its cel-go type and ``MaxElements``."""

    type: CelType
    max_elements: int = 0
    fields: dict[str, _Decl] = field(default_factory=dict)
    key: _Decl | None = None
    elem: _Decl | None = None


def _map_decl(key: _Decl, elem: _Decl, max_elements: int) -> _Decl:
    return _Decl(CelType("map", "map", (key.type, elem.type)), max_elements, key=key, elem=elem)


# compile.go: DriverNameMaxLength 63, DeviceMaxDomainLength 63, DeviceMaxIDLength 32,
# DeviceAttributeMaxValueLength 64, ResourceSliceMaxAttributesAndCapacitiesPerDevice 32.
_ATTRIBUTE = _Decl(CelType("any"), 64)
_INDEX = _Decl(CelType("int"))
_DOMAIN = _Decl(_STRING, 63)
_ID = _Decl(_STRING, 32)
_DEVICE = _Decl(CelType("struct", "DRADevice"), 0, fields={
    "driver": _Decl(_STRING, 63),
    "allowMultipleAllocations": _Decl(CelType("bool"), 1),
    "attributes": _map_decl(_DOMAIN, _map_decl(_ID, _ATTRIBUTE, 32), 32),
    "capacity": _map_decl(_DOMAIN, _map_decl(_ID, _Decl(CelType("struct", "Quantity")), 32), 32),
})


def _declared(path: Sequence[str], *, as_checker: bool = False) -> _Decl | None:
    """The declared node a path rooted at ``device`` names, as compile.go's
    ``sizeEstimator.EstimateSize`` walks it: a name not among the fields only reaches into an
    attribute map. ``as_checker``: as cel-go's checker types it, where every map's entries,
    selected or indexed, have its value type, and a list's indices are ints."""
    if not path or path[0] != "device":
        return None
    node = _DEVICE
    for name in path[1:]:
        if as_checker and name == "@indices":
            return _INDEX
        if name in ("@items", "@values"):
            if node.elem is None:
                return None
            node = node.elem
        elif name == "@keys":
            if node.key is None:
                return None
            node = node.key
        elif name in node.fields:
            node = node.fields[name]
        elif node.elem is _ATTRIBUTE or (as_checker and node.elem is not None):
            node = node.elem  # an attribute map: every name has the same largest size
        else:
            return None
    return node


def _declared_type(path: Sequence[str]) -> CelType | None:
    """The type cel-go's checker gives a node with this path."""
    node = _declared(path, as_checker=True)
    return None if node is None else node.type


SizeEstimator = Callable[[Sequence[str]], "Range | None"]


def declared_sizes(path: Sequence[str]) -> Range | None:
    """compile.go's ``sizeEstimator``: 0 to the declared ``MaxElements`` of what the path names."""
    node = _declared(path) if path else None
    return None if node is None else Range(0, node.max_elements)


def device_sizes(driver: str, attributes: Mapping[str, Mapping[str, Any]],
                 capacity: Mapping[str, Mapping[str, Any]]) -> SizeEstimator:
    """The sizes one device actually has, where :func:`declared_sizes` has the largest allowed:
    an estimate with them bounds what a run on this device costs. ``attributes`` and
    ``capacity`` are by domain, as the selector sees them. A value's size is what cel-go's
    ``actualSize`` counts: a string's characters, 1 for what has no size."""
    def most(values: Iterable[int]) -> int:
        return max(values, default=0)

    def value_size(value: Any) -> int:
        return len(value) if isinstance(value, (str, bytes)) else 1

    actual: dict[tuple[str, ...], int] = {
        ("driver",): len(driver),
        ("allowMultipleAllocations",): 1,
        ("attributes",): len(attributes),
        ("attributes", "@keys"): most(len(d) for d in attributes),
        ("attributes", "@values"): most(len(m) for m in attributes.values()),
        ("attributes", "@values", "@keys"): most(len(k) for m in attributes.values() for k in m),
        ("attributes", "@values", "@values"): most(value_size(v) for m in attributes.values() for v in m.values()),
        ("capacity",): len(capacity),
        ("capacity", "@keys"): most(len(d) for d in capacity),
        ("capacity", "@values"): most(len(m) for m in capacity.values()),
        ("capacity", "@values", "@keys"): most(len(k) for m in capacity.values() for k in m),
    }

    def sizes(path: Sequence[str]) -> Range | None:
        declared = declared_sizes(path)
        if declared is None:
            return None
        canonical = tuple("@values" if p == "@items" else p for p in path[1:])
        if len(canonical) == 3 and canonical[:2] == ("attributes", "@values") and canonical[2] != "@keys":
            canonical = ("attributes", "@values", "@values")  # every attribute name
        if len(canonical) == 2 and canonical[0] in ("attributes", "capacity") and canonical[1] not in ("@keys", "@values"):
            canonical = (canonical[0], "@values")
        size = actual.get(canonical)
        return declared if size is None else Range(0, min(size, declared.high))
    return sizes


# The overloads a call on a node of known kind can take (the others are what cel-cpp's checker adds
# for a ``dyn`` argument and cel-go's, knowing the type, does not): overload -> (argument, kind).
# The argument -1 is the call's target.
_OVERLOAD_KINDS: dict[str, tuple[int, str]] = {
    "in_list": (1, "list"), "in_map": (1, "map"),
    "index_list": (0, "list"), "index_map": (0, "map"),
    "optional_map_index_value": (0, "opaque"), "optional_list_index_int": (0, "opaque"),
    "size_list": (0, "list"), "size_map": (0, "map"), "size_string": (0, "string"), "size_bytes": (0, "bytes"),
    "list_size": (-1, "list"), "map_size": (-1, "map"), "string_size": (-1, "string"), "bytes_size": (-1, "bytes"),
    "add_list": (0, "list"), "add_string": (0, "string"), "add_bytes": (0, "bytes"),
}


_ELEMENT_RESULTS = frozenset({"list_max", "list_min", "list_sum"})
_LIST_RESULTS = frozenset({"list_sort", "list_distinct", "list_reverse", "list_slice", "list_sortByAssociatedKeys"})
_OPEN_KINDS = frozenset({"dyn", "any", "type_param", "error"})
# The standard operators' overload names spell their operands' types: ``less_int64``,
# ``less_int64_double``, ``add_string``.
_OPERATORS = ("less_equals", "greater_equals", "less", "greater", "add", "subtract", "multiply", "divide", "modulo")
_KIND_WORDS = {"int64": "int", "uint64": "uint", "double": "double", "string": "string", "bytes": "bytes",
               "bool": "bool", "timestamp": "timestamp", "duration": "duration", "list": "list"}


def _operator_kinds(overload: str) -> tuple[str, str] | None:
    for operator in _OPERATORS:
        if overload.startswith(operator + "_"):
            words = overload[len(operator) + 1:].split("_")
            kinds = [_KIND_WORDS.get(w) for w in words]
            if None in kinds or not 1 <= len(kinds) <= 2:
                return None
            return (kinds[0], kinds[-1])  # type: ignore[return-value]
    return None


class _Path:
    """A path as cost.go holds it: a Go slice of names, grown by ``append``. Appending to a slice
    with room left writes into the array every other slice appended to the same one shares, so a
    path can read differently later than it was built: ``m.all(k, v, ...)`` pushes the key
    variable's path ``m + "@keys"``, then the value's ``m + "@values"``, and where ``m``'s slice
    has room the key's path reads ``m + "@values"`` from then on. cel-go's sizes come from what a
    path reads (:meth:`seen`); the types this module bridges (cel-go's checker knows them) from
    what it was built as (``built``)."""

    __slots__ = ("_array", "built")

    def __init__(self, built: tuple[str, ...] = (), array: list[str] | None = None) -> None:
        self.built = built
        self._array = array if array is not None else list(built)

    def appended(self, name: str) -> _Path:
        length = len(self.built)
        if length < len(self._array):
            self._array[length] = name
            return _Path((*self.built, name), self._array)
        # Go's growslice doubles the capacity of a small slice (and of 16-byte strings the
        # allocator's size classes keep the power of two): a path built one name at a time from a
        # one-name literal has room exactly when its length is not a power of two.
        grown = [*self._array[:length], name, *[""] * (max(2 * length, 1) - length - 1)]
        return _Path((*self.built, name), grown)

    def seen(self) -> list[str]:
        return self._array[:len(self.built)]


_NO_PATH = _Path()


@dataclass
class _Local:
    path: _Path
    size: Range | None
    entry: _Entry | None = None


@dataclass(frozen=True)
class _Entry:
    """cost.go ``entrySizeEstimate``: a container's kind and its keys' and values' sizes."""

    container: str
    key: Range
    value: Range

    def union(self, other: _Entry | None) -> _Entry | None:
        if other is None:
            return None
        return _Entry(self.container, self.key.union(other.key), self.value.union(other.value))


@dataclass
class Node:
    """cost.go ``AstNode``: an expression with its path, type and computed size."""

    expr: Any
    path: _Path | None
    type: CelType
    computed: Range | None


class _Coster:
    """cost.go ``coster``."""

    def __init__(self, checked: ast.CheckedExpr, sizes: SizeEstimator, runtime: bool, release: CelRelease) -> None:
        self.checked = checked
        self.release = release
        self.estimate_size = sizes
        self.runtime = runtime
        self.paths: dict[int, _Path] = {}
        self.locals: defaultdict[str, list[_Local]] = defaultdict(list)
        self.sizes: dict[int, Range] = {}
        self.entries: dict[int, _Entry] = {}

    # -- types, paths and sizes --------------------------------------------------------------

    def type_of(self, e: Any) -> CelType:
        declared = _declared_type(self.path_of(e).built)
        if declared is not None:
            return declared
        message = self.checked.type_map.get(e.id)
        found = _DYN if message is None else cel_type(message)
        vague = found.kind == "dyn" or (found.kind == "list" and found.params == (_DYN,))
        if not vague:
            return found
        kind = e.WhichOneof("expr_kind")
        if kind == "call_expr" and e.call_expr.HasField("target"):
            return self.generic_result(e) or found
        if kind == "call_expr" and e.call_expr.function == "_[_]" and len(e.call_expr.args) == 2:
            container = self.type_of(e.call_expr.args[0])  # an element of a list a refinement typed
            if container.kind in ("list", "map") and container.params and container.params[-1].kind != "dyn":
                return container.params[-1]
        if kind == "comprehension_expr":
            if _is_bind(e):  # cel.bind's value is its result's
                result = self.type_of(e.comprehension_expr.result)
                return result if result != found else found
            return self.mapped_list(e) or found
        return found

    def mapped_list(self, e: Any) -> CelType | None:
        """The type of ``map``'s result, ``list(type of the mapped expression)``, where the mapped
        expression's type is one only a refinement here knows."""
        comp = e.comprehension_expr
        step = comp.loop_step
        if comp.accu_init.WhichOneof("expr_kind") != "list_expr" or comp.accu_init.list_expr.elements:
            return None
        if step.WhichOneof("expr_kind") != "call_expr" or step.call_expr.function != "_+_":
            return None
        added = step.call_expr.args[1] if len(step.call_expr.args) == 2 else None
        if added is None or added.WhichOneof("expr_kind") != "list_expr" or len(added.list_expr.elements) != 1:
            return None
        self.push_iter_single(comp.iter_var, comp.iter_range)
        try:
            element = self.type_of(added.list_expr.elements[0])
        finally:
            self.pop(comp.iter_var)
        return CelType("list", "list", (element,)) if element.kind != "dyn" else None

    def generic_result(self, e: Any) -> CelType | None:
        """cel-go's type for a list function's result where cel-cpp, declaring it without type
        parameters, has ``dyn``: the list's element (max, min, sum) or the list itself."""
        reference = self.checked.reference_map.get(e.id)
        overloads = set(reference.overload_id) if reference is not None else set()
        target = self.type_of(e.call_expr.target)
        if target.kind != "list" or not target.params or target.params[0].kind == "dyn":
            return None
        if overloads & _ELEMENT_RESULTS:
            return target.params[0]
        if overloads & _LIST_RESULTS:
            return target
        return None

    def read(self, path: _Path) -> list[str]:
        """What the estimate reads of a path (cel-go's, sibling appends and all); a bound of the
        run, which reads no paths, takes what it names."""
        return list(path.built) if self.runtime else path.seen()

    def path_of(self, e: Any) -> _Path:
        """cost.go ``getPath``."""
        if e.WhichOneof("expr_kind") == "ident_expr":
            local = self.peek(e.ident_expr.name)
            if local is not None:
                return local.path
        return self.paths.get(e.id, _NO_PATH)

    def peek(self, name: str) -> _Local | None:
        stack = self.locals.get(name)
        return stack[-1] if stack else None

    def node(self, e: Any) -> Node:
        path: _Path | None = self.path_of(e)
        if path is not None and path.built and path.built[0] in _ACCUMULATORS:
            path = None
        return Node(e, path, self.type_of(e), self.size_of(e))

    def size_of(self, e: Any) -> Range | None:
        """cost.go ``computeSize``."""
        if e.id in self.sizes:
            return self.sizes[e.id]
        literal = _literal_size(e)
        if literal is not None:
            return literal
        estimate = self.estimate_size(self.read(self.path_of(e)))
        if estimate is not None:
            self.sizes[e.id] = estimate
            return estimate
        if _is_scalar(self.type_of(e)):
            return fixed(1)
        if e.WhichOneof("expr_kind") == "ident_expr":
            local = self.peek(e.ident_expr.name)
            if local is not None and local.size is not None:
                return local.size
        return None

    def node_size(self, node: Node) -> Range:
        """ext/sets.go ``estimateSize`` and library/cost.go ``sizeEstimate``: computed, estimated,
        or unknown."""
        if node.computed is not None:
            return node.computed
        estimated = self.estimate_size(self.read(node.path)) if node.path is not None and node.path.built else None
        return UNKNOWN if estimated is None else estimated

    def size_or_unknown(self, target: Any) -> Range:
        if isinstance(target, Node):
            return target.computed if target.computed is not None else UNKNOWN
        size = self.size_of(target)
        return UNKNOWN if size is None else size

    def entry_of(self, e: Any) -> _Entry | None:
        if e.id in self.entries:
            return self.entries[e.id]
        if e.WhichOneof("expr_kind") == "ident_expr":
            local = self.peek(e.ident_expr.name)
            if local is not None:
                return local.entry
        return None

    def set_size(self, e: Any, size: Range | None) -> None:
        if size is not None:
            self.sizes[e.id] = size

    def set_entry(self, e: Any, entry: _Entry | None) -> None:
        if entry is not None:
            self.entries[e.id] = entry

    def copy_sizes(self, destination: Any, source: Any) -> None:
        self.set_size(destination, self.size_of(source))
        self.set_entry(destination, self.entry_of(source))

    def push(self, name: str, e: Any, path: _Path, size: Range | None, entry: _Entry | None = None) -> None:
        self.locals[name].append(_Local(path, size, entry))

    def pop(self, name: str) -> None:
        self.locals[name].pop()

    def _container(self, range_expr: Any) -> tuple[_Entry | None, str]:
        entry = self.entry_of(range_expr)
        kind = entry.container if entry is not None else self.type_of(range_expr).kind
        return entry, kind

    def push_iter_single(self, name: str, range_expr: Any) -> None:
        entry, kind = self._container(range_expr)
        size, sub = (entry.key if entry else None), "@keys"
        if kind == "list":
            size, sub = (entry.value if entry else None), "@items"
        self.push(name, range_expr, self.path_of(range_expr).appended(sub), size)

    def push_iter_key(self, name: str, range_expr: Any) -> None:
        entry, kind = self._container(range_expr)
        sub = "@indices" if kind == "list" else "@keys"
        self.push(name, range_expr, self.path_of(range_expr).appended(sub), entry.key if entry else None)

    def push_iter_value(self, name: str, range_expr: Any) -> None:
        entry, kind = self._container(range_expr)
        sub = "@items" if kind == "list" else "@values"
        self.push(name, range_expr, self.path_of(range_expr).appended(sub), entry.value if entry else None)

    # -- costs --------------------------------------------------------------------------------

    def cost(self, e: Any) -> Range:
        kind = e.WhichOneof("expr_kind")
        if kind == "const_expr":
            return fixed(0)
        if kind == "ident_expr":
            local = self.peek(e.ident_expr.name)
            self.paths[e.id] = local.path if local is not None else _Path((e.ident_expr.name,))
            return fixed(_SELECT_AND_IDENT)
        if kind == "select_expr":
            return self.cost_select(e)
        if kind == "call_expr":
            return self.cost_call(e)
        if kind == "list_expr":
            return self.cost_list(e)
        if kind == "struct_expr":
            return self.cost_struct(e)
        if kind == "comprehension_expr":
            return self.cost_bind(e) if _is_bind(e) else self.cost_comprehension(e)
        return fixed(0)

    def cost_select(self, e: Any) -> Range:
        select = e.select_expr
        if select.test_only:
            # The base environment's PresenceTestHasCost(false): has() costs its operand only.
            return self.cost(select.operand)
        total = self.cost(select.operand)
        # At run time every qualifier costs 1 (interpreter/runtimecost.go), whatever the operand's
        # declared type; the estimate charges selects on maps and structs only.
        if self.runtime or self.type_of(select.operand).kind in ("map", "struct", "type_param"):
            total = total.add(fixed(_SELECT_AND_IDENT))
        self.paths[e.id] = self.path_of(select.operand).appended(select.field)
        return total

    def cost_call(self, e: Any) -> Range:
        call = e.call_expr
        if call.function == "dyn" and len(call.args) == 1:
            argument_cost = self.cost(call.args[0])
            self.copy_sizes(e, call.args[0])
            return _CALL.add(argument_cost)
        argument_costs: list[Range] = []
        arguments: list[Node] = []
        for argument in call.args:  # in cel-go's order: a later argument's path may write over this one's
            argument_costs.append(self.cost(argument))
            arguments.append(self.node(argument))
        reference = self.checked.reference_map.get(e.id)
        overloads = list(reference.overload_id) if reference is not None else []
        if not overloads:
            return fixed(0)
        total = fixed(0)
        target: Node | None = None
        if call.HasField("target"):
            total = total.add(self.cost(call.target))
            target = self.node(call.target)
        overloads = self.fitting(overloads, target, arguments)
        function_cost = Range(_MAX, 0)
        result_size: Range | None = None
        for overload in overloads:
            estimate, size = self.function_cost(e, call.function, overload, target, arguments, argument_costs)
            function_cost = function_cost.union(estimate)
            if size is not None:
                result_size = size if result_size is None else result_size.union(size)
            if overload in ("index_list", "index_map") and call.args:
                entry = self.entry_of(call.args[0])
                result_size = entry.value if entry is not None else None
                sub = "@items" if overload == "index_list" else "@values"
                self.paths[e.id] = self.path_of(call.args[0]).appended(sub)
            if result_size is None:
                result_size = self.size_of(e)
        self.set_size(e, result_size)
        return total.add(function_cost)

    def fitting(self, overloads: list[str], target: Node | None, arguments: list[Node]) -> list[str]:
        """The overloads cel-go would pick, for an argument whose type only cel-go knows."""
        def fits(overload: str) -> bool:
            kinds = _operator_kinds(overload)
            if kinds is not None and len(arguments) == 2:
                return all(node.type.kind in _OPEN_KINDS or node.type.kind == kind
                           for node, kind in zip(arguments, kinds))
            position, kind = _OVERLOAD_KINDS.get(overload, (None, ""))
            if position is None:
                return True
            node = target if position == -1 else (arguments[position] if position < len(arguments) else None)
            if node is None or _declared_type(node.path.built if node.path is not None else ()) is None:
                return True
            return node.type.kind == kind
        kept = [o for o in overloads if fits(o)]
        return kept or overloads

    def cost_list(self, e: Any) -> Range:
        elements = e.list_expr.elements
        total = fixed(0)
        item = Range(0 if not elements else _MAX, 0)
        for element in elements:
            total = total.add(self.cost(element))
            item = item.union(self.size_or_unknown(element))
        self.set_entry(e, _Entry("list", fixed(1), item))
        return total.add(fixed(_LIST_CREATE))

    def cost_struct(self, e: Any) -> Range:
        create = e.struct_expr
        total = fixed(0)
        if create.message_name:
            for entry in create.entries:
                total = total.add(self.cost(entry.value))
            return total.add(fixed(_STRUCT_CREATE))
        empty = not create.entries
        key = Range(0 if empty else _MAX, 0)
        value = Range(0 if empty else _MAX, 0)
        for entry in create.entries:
            total = total.add(self.cost(entry.map_key)).add(self.cost(entry.value))
            key = key.union(self.size_or_unknown(entry.map_key))
            value = value.union(self.size_or_unknown(entry.value))
        self.set_entry(e, _Entry("map", key, value))
        return total.add(fixed(_MAP_CREATE))

    def cost_comprehension(self, e: Any) -> Range:
        comp = e.comprehension_expr
        total = self.cost(comp.iter_range).add(self.cost(comp.accu_init))
        self.push(comp.accu_var, comp.accu_init, self.path_of(comp.accu_init), self.size_of(comp.accu_init),
                  self.entry_of(comp.accu_init))
        if comp.iter_var2:
            self.push_iter_key(comp.iter_var, comp.iter_range)
            self.push_iter_value(comp.iter_var2, comp.iter_range)
        else:
            self.push_iter_single(comp.iter_var, comp.iter_range)
        loop = self.cost(comp.loop_condition)
        step = self.cost(comp.loop_step)
        self.pop(comp.iter_var)
        if comp.iter_var2:
            self.pop(comp.iter_var2)
        total = total.add(self.cost(comp.result))
        self.pop(comp.accu_var)
        count = self.size_or_unknown(comp.iter_range)
        total = total.add(count.multiply(step.add(loop)))
        init_kind = comp.accu_init.WhichOneof("expr_kind")
        if init_kind == "const_expr":
            self.set_size(e, self.size_of(comp.accu_init))
        elif init_kind == "list_expr" or (init_kind == "struct_expr" and not comp.accu_init.struct_expr.message_name):
            self.set_size(e, count)
            self.set_entry(e, self.entry_of(comp.loop_step))
        return total

    def cost_bind(self, e: Any) -> Range:
        comp = e.comprehension_expr
        total = self.cost(comp.iter_range).add(self.cost(comp.accu_init))
        self.push(comp.accu_var, comp.accu_init, self.path_of(comp.accu_init), self.size_of(comp.accu_init),
                  self.entry_of(comp.accu_init))
        total = total.add(self.cost(comp.result))
        self.pop(comp.accu_var)
        self.copy_sizes(e, comp.result)
        return total

    def function_cost(self, e: Any, function: str, overload: str, target: Node | None,
                      arguments: list[Node], argument_costs: list[Range]) -> tuple[Range, Range | None]:
        """cost.go ``functionCost``: the extensions' estimators, then the Kubernetes library's,
        then cel-go's own cases; a call costs 1 otherwise. The arguments' costs are added."""
        arguments_cost = fixed(0)
        for argument_cost in argument_costs:
            arguments_cost = arguments_cost.add(argument_cost)
        for estimate in (_extension_estimate, _kubernetes_estimate):
            found = estimate(self, function, overload, target, arguments)
            if found is not None:
                return found[0].add(arguments_cost), found[1]
        builtin = self.builtin_estimate(e, overload, target, arguments, argument_costs)
        if builtin is not None:
            call_cost, result_size, plus_arguments = builtin
            return (call_cost.add(arguments_cost) if plus_arguments else call_cost), result_size
        return _CALL.add(arguments_cost), None

    def builtin_estimate(self, e: Any, overload: str, target: Node | None, arguments: list[Node],
                         argument_costs: list[Range]) -> tuple[Range, Range | None, bool] | None:
        """cost.go ``functionCost``'s switch: (cost, result size, whether the arguments' costs
        are still to be added)."""
        size = self.size_or_unknown
        if overload == "string_format" and target is not None:
            return size(target).by_factor(_STRING_TRAVERSAL), None, True
        if overload == "string_to_bytes" and len(arguments) == 1:
            s = size(arguments[0])
            return s.by_factor(_STRING_TRAVERSAL), Range(s.low, _multiply(s.high, 4)), True
        if overload == "bytes_to_string" and len(arguments) == 1:
            s = size(arguments[0])
            return s.by_factor(_STRING_TRAVERSAL), Range(s.low // 4, s.high), True
        if overload == "strings_quote" and len(arguments) == 1:
            s = size(arguments[0])
            return s.by_factor(_STRING_TRAVERSAL), Range(_add(s.low, 2), _add(_multiply(s.high, 2), 2)), True
        if overload in ("starts_with_string", "ends_with_string") and len(arguments) == 1:
            # The estimate traverses the prefix; the run (runtimecost.go costCall) its receiver,
            # until cel-go 0.29 (Kubernetes 1.37), where the run does as the estimate.
            by_receiver = self.runtime and target is not None and not self.release.charges_prefix_at_run
            traversed = target if by_receiver else arguments[0]
            return size(traversed).by_factor(_STRING_TRAVERSAL), None, True
        if overload == "in_list" and len(arguments) == 2:
            return size(arguments[1]).by_factor(1), None, True
        if overload == "matches_string" and target is not None and len(arguments) == 1:
            text = size(target).add(fixed(1)).by_factor(_STRING_TRAVERSAL)
            return text.multiply(size(arguments[0]).by_factor(_REGEX_LENGTH)), None, True
        if overload == "matches" and len(arguments) == 2 and self.release.costs_function_matches:
            text = size(arguments[0]).add(fixed(1)).by_factor(_STRING_TRAVERSAL)
            return text.multiply(size(arguments[1]).by_factor(_REGEX_LENGTH)), None, True
        if overload == "contains_string" and target is not None and len(arguments) == 1:
            text = size(target).by_factor(_STRING_TRAVERSAL)
            return text.multiply(size(arguments[0]).by_factor(_STRING_TRAVERSAL)), None, True
        if overload in ("logical_or", "logical_and"):
            first, second = argument_costs[0], argument_costs[1]
            return Range(first.low, first.add(second).high), None, False
        if overload == "conditional":
            result = size(arguments[1]).union(size(arguments[2]))
            if_true, if_false = self.entry_of(arguments[1].expr), self.entry_of(arguments[2].expr)
            self.set_entry(e, if_true.union(if_false) if if_true is not None else None)
            cost = argument_costs[0].add(argument_costs[1].union(argument_costs[2]))
            return cost, result, False
        if overload in ("add_string", "add_bytes", "add_list") and len(arguments) == 2:
            total = size(arguments[0]).add(size(arguments[1]))
            left, right = self.entry_of(arguments[0].expr), self.entry_of(arguments[1].expr)
            joined = left.union(right) if left is not None else None
            if joined is not None:
                self.set_entry(e, joined)
            if overload == "add_list":
                return _CALL, total, True
            return total.by_factor(_STRING_TRAVERSAL), total, True
        if overload in _SIZED_COMPARISONS:
            low = 0
            smallest = min(size(arguments[0]).high, size(arguments[1]).high)
            if smallest > 0:
                low = 1
            return Range(low, smallest).by_factor(_STRING_TRAVERSAL), None, True
        return None


_SIZED_COMPARISONS = frozenset({
    "less_string", "greater_string", "less_equals_string", "greater_equals_string",
    "less_bytes", "greater_bytes", "less_equals_bytes", "greater_equals_bytes", "equals", "not_equals"})


def _literal_size(e: Any) -> Range | None:
    """cost.go ``computeExprSize``."""
    kind = e.WhichOneof("expr_kind")
    if kind == "const_expr":
        constant = e.const_expr.WhichOneof("constant_kind")
        if constant == "string_value":
            return fixed(len(e.const_expr.string_value))
        if constant == "bytes_value":
            return fixed(len(e.const_expr.bytes_value))
        return fixed(1) if constant is not None else None
    if kind == "list_expr":
        return fixed(len(e.list_expr.elements))
    if kind == "struct_expr" and not e.struct_expr.message_name:
        return fixed(len(e.struct_expr.entries))
    return None


def _is_scalar(t: CelType) -> bool:
    if t.kind in ("bool", "double", "duration", "int", "timestamp", "uint"):
        return True
    return t.kind == "opaque" and t.name == "optional_type" and bool(t.params) and _is_scalar(t.params[0])


def _is_bind(e: Any) -> bool:
    """cost.go ``isBind``: ``cel.bind`` is a comprehension over an empty list that never loops."""
    comp = e.comprehension_expr
    return (comp.iter_range.WhichOneof("expr_kind") == "list_expr" and not comp.iter_range.list_expr.elements
            and comp.loop_condition.WhichOneof("expr_kind") == "const_expr"
            and comp.loop_condition.const_expr.WhichOneof("constant_kind") == "bool_value"
            and not comp.loop_condition.const_expr.bool_value and comp.accu_var not in _ACCUMULATORS)




def _int_literal(node: Node, default: int) -> int:
    """ext/lists.go ``nodeAsIntValue``."""
    e = node.expr
    if e is None or e.WhichOneof("expr_kind") != "const_expr" or e.const_expr.WhichOneof("constant_kind") != "int64_value":
        return default
    return max(0, e.const_expr.int64_value)


def _list_call(factor: float, size: Range, allocates: bool = True) -> tuple[Range, Range | None]:
    """ext/lists.go ``estimateListCall``."""
    cost = size.by_factor(factor).add(_CALL)
    if allocates:
        cost = cost.add(fixed(_LIST_CREATE))
    return cost, size


def _extension_estimate(coster: _Coster, function: str, overload: str, target: Node | None,
                        arguments: list[Node]) -> tuple[Range, Range | None] | None:
    """The estimators cel-go's extensions register by overload (``checker.OverloadCostEstimate``):
    ext/sets.go and ext/lists.go (version 3, as the base environment has it from 1.34)."""
    if overload in ("list_sets_contains_list", "list_sets_intersects_list", "list_sets_equivalent_list"):
        if len(arguments) != 2:
            return None
        factor = 2.0 if overload == "list_sets_equivalent_list" else 1.0
        return coster.node_size(arguments[0]).multiply(coster.node_size(arguments[1])).by_factor(factor).add(_CALL), None
    if target is None:
        if overload == "lists_range" and len(arguments) == 1:
            return _list_call(1, fixed(_int_literal(arguments[0], _MAX)))
        return None
    if overload == "list_slice" and len(arguments) == 2:
        size = coster.node_size(target)
        start, end = _int_literal(arguments[0], 0), _int_literal(arguments[1], size.high)
        return _list_call(1, fixed((end - start) % 2**64))  # uint64 arithmetic, as upstream
    if overload in ("list_flatten", "list_flatten_int") and len(arguments) <= 1:
        depth = _int_literal(arguments[0], _MAX) if arguments else 1
        return _list_call(float(depth), coster.node_size(target))
    if overload == "list_reverse" and not arguments:
        return _list_call(1, coster.node_size(target))
    if overload == "list_distinct" and not arguments:
        size = coster.node_size(target)
        return _list_call(2.0, size.multiply(size))
    if (overload == "list_sort" and not arguments) or (overload == "list_sortByAssociatedKeys" and len(arguments) == 1):
        # estimateListSortCost: the list sorted (sort) or the keys (sortBy); a key of unknown type
        # may be a string, so cel-go's union over the comparable types costs it as one.
        keys = target if overload == "list_sort" else arguments[0]
        size = coster.node_size(keys)
        element = keys.type.params[0].kind if keys.type.params else "dyn"
        factor = 2.0 + (_STRING_TRAVERSAL if element in ("string", "bytes", "dyn", "any") else 0)
        return _list_call(factor, size.multiply(size))
    return None


_UNIT_FUNCTIONS = frozenset({
    "serviceAccount", "path", "group", "resource", "subresource", "namespace", "name", "allowed", "reason",
    "error", "errored", "masked", "prefixLength", "family", "isUnspecified", "isLoopback",
    "isLinkLocalMulticast", "isLinkLocalUnicast", "isGlobalUnicast", "format.named", "sign", "asInteger",
    "isInteger", "asApproximateFloat", "isGreaterThan", "isLessThan", "compareTo", "add", "sub", "major",
    "minor", "patch", "getScheme", "getHostname", "getHost", "getPort", "getEscapedPath", "getQuery"})
_IP_SIZE = Range(4, 16)


def _kubernetes_estimate(coster: _Coster, function: str, overload: str, target: Node | None,
                         arguments: list[Node]) -> tuple[Range, Range | None] | None:
    """k8s.io/apiserver/pkg/cel/library/cost.go ``EstimateCallCost``, by function name, behind
    1.36's DRA estimator (dynamic-resource-allocation/cel ``draCostEstimator``)."""
    size = coster.node_size
    if overload == "dra_includes_dyn_dyn" and target is not None:  # as "<arg> in <target>", 48 values at most
        return Range(0, _MAX_ATTRIBUTE_VALUES), None
    if function == "check":
        return fixed(350_000), None
    if function in _UNIT_FUNCTIONS:
        return fixed(1), None
    if function in ("fieldSelector", "labelSelector") and len(arguments) == 1:
        length = size(arguments[0])
        parse = length.by_factor(_STRING_TRAVERSAL)
        requirements = length.by_factor(0.5).by_factor(float(_LIST_CREATE + _STRUCT_CREATE))
        return fixed(_LIST_CREATE).add(parse).add(requirements), None
    traversals = ("isSorted", "sum", "max", "min", "indexOf", "lastIndexOf",
                  *(("includes",) if coster.release.costs_includes else ()))
    if function in traversals and target is not None:
        if target.type.params:  # listElementNode: the first type parameter, a map's key type too
            element_type = target.type.params[0]
            element_cost = fixed(1)
            if element_type.kind in ("string", "bytes"):
                items = Node(None, _Path((*coster.read(target.path), "@items")) if target.path is not None else None, element_type, None)
                element_cost = element_cost.add(size(items).by_factor(_STRING_TRAVERSAL))
            return size(target).multiply(element_cost), None
        if function == "includes":  # any target (dyn): at worst a list compared element by element
            return size(target), None
        return size(target).by_factor(_STRING_TRAVERSAL), None
    if function in ("url", "jsonpatch.escapeKey") and len(arguments) == 1:
        length = size(arguments[0])
        return length.by_factor(_STRING_TRAVERSAL), length
    if function in ("lowerAscii", "upperAscii", "substring", "trim") and target is not None:
        length = size(target)
        return length.by_factor(_STRING_TRAVERSAL), length
    if function == "replace" and target is not None and len(arguments) >= 2:
        return _replace_estimate(size(target), size(arguments[0]), size(arguments[1]))
    if function == "split" and target is not None:
        length = size(target)
        most = length.high
        if len(arguments) > 1:
            e = arguments[1].expr
            if e.WhichOneof("expr_kind") == "const_expr" and e.const_expr.WhichOneof("constant_kind") == "int64_value":
                most = e.const_expr.int64_value % 2**64
        return length.by_factor(2 * _STRING_TRAVERSAL), Range(0, most)
    if function == "join" and target is not None:
        joined = fixed(0)
        count = size(target)
        if target.type.params:
            items = Node(None, _Path((*coster.read(target.path), "@items")) if target.path is not None else None, target.type.params[0], None)
            joined = count.multiply(size(items))
        if arguments:
            separators = Range(max(count.low - 1, 0), max(count.high - 1, 0))
            joined = joined.add(size(arguments[0]).multiply(separators))
        # The run (library/cost.go CallCost) charges twice the joined string's length.
        return joined.by_factor((2 if coster.runtime else 1) * _STRING_TRAVERSAL), joined
    if function in ("find", "findAll") and target is not None and arguments:
        length = size(target)
        text = length.add(fixed(1)).by_factor(_STRING_TRAVERSAL)
        return text.multiply(size(arguments[0]).by_factor(_REGEX_LENGTH)), Range(0, length.high)
    if function in ("cidr", "isIP", "isCIDR", "quantity", "isQuantity", "semver", "isSemver") and arguments:
        return size(arguments[0]).by_factor(_STRING_TRAVERSAL), None
    if function == "ip":
        if overload == "cidr_ip":
            return fixed(1), None
        if arguments:
            return size(arguments[0]).by_factor(_STRING_TRAVERSAL), None
    if function == "ip.isCanonical" and arguments:
        return size(arguments[0]).by_factor(2 * _STRING_TRAVERSAL), None
    if function in ("containsIP", "containsCIDR") and arguments:
        cost = _IP_SIZE.add(_IP_SIZE).by_factor(_STRING_TRAVERSAL)
        if function == "containsCIDR":
            cost = cost.add(_IP_SIZE.by_factor(_STRING_TRAVERSAL)).add(fixed(1))
        if overload in ("cidr_contains_ip_string", "cidr_contains_cidr_string"):
            cost = cost.add(size(arguments[0]).by_factor(_STRING_TRAVERSAL))
        return cost, None
    if function == "validate" and arguments:
        if coster.runtime:  # the run (CallCost) charges the format's own regex size, up to the URL's
            text = size(arguments[0]).add(fixed(1)).by_factor(_STRING_TRAVERSAL)
            return text.multiply(fixed(math.ceil(_URL_FORMAT_REGEX_SIZE * _REGEX_LENGTH))), None
        return size(arguments[0]).by_factor(_STRING_TRAVERSAL).by_factor(
            _MAX_NAME_FORMAT_REGEX_SIZE * _REGEX_LENGTH), None
    if function == "_==_" and len(arguments) == 2:
        left, right = arguments
        if left.type == right.type:
            if left.type.kind == "opaque" and left.type.name in ("IP", "CIDR"):
                return fixed(1), None
            if left.type.kind == "struct":
                if left.type.name in ("Quantity", "Semver"):
                    return fixed(1), None
                if left.type.name == "Format":
                    return Range(1, _MAX_FORMAT_SIZE).by_factor(_STRING_TRAVERSAL), None
                if left.type.name == "URL":
                    # Upstream reads the right-hand side's size twice; kept as it is.
                    most = right.computed.high if right.computed is not None else 1
                    return Range(1, most).by_factor(_STRING_TRAVERSAL), None
    return None


def _replace_estimate(text: Range, old: Range, new: Range) -> tuple[Range, Range | None]:
    """library/cost.go's ``replace`` case: the most and the fewest replacements, and what is kept."""
    count_high, kept_high = _replace_side(text.high, old.low, keeps_length=new.high <= old.low)
    count_low, kept_low = _replace_side(text.low, old.high, keeps_length=old.high <= new.low)
    result = Range(count_low, count_high).multiply(new).add(Range(kept_low, kept_high))
    return text.by_factor(2 * _STRING_TRAVERSAL), result


def _replace_side(length: int, replaced: int, *, keeps_length: bool) -> tuple[int, int]:
    """(replacements, characters kept) at one end of the range: an empty string to replace
    matches between every character; a replacement that cannot move this end replaces none."""
    if replaced == 0:
        return (length + 1 if length < _MAX else length), length
    if keeps_length:
        return 0, length
    return min(math.ceil(float(length) / float(replaced)), _MAX), 0


def checked_expression(serialized: bytes) -> ast.CheckedExpr:
    """cel-cpp's ``Expression.serialize()`` (an ``Any`` holding a ``cel.expr.CheckedExpr``)."""
    wrapper = any_pb2.Any()
    wrapper.ParseFromString(serialized)
    checked = ast.CheckedExpr()
    checked.ParseFromString(wrapper.value)
    return checked


def estimate(checked: ast.CheckedExpr, sizes: SizeEstimator = declared_sizes, *, release: CelRelease = OLDEST) -> Range:
    """cel-go's ``checker.Cost`` of a checked selector in the DRA environment: what the API server
    compares with the limit."""
    return _Coster(checked, sizes, False, release).cost(checked.expr)


def runtime_bound(checked: ast.CheckedExpr, sizes: SizeEstimator = declared_sizes, release: CelRelease = OLDEST) -> int:
    """An upper bound of what the scheduler's run counts (cel-go's runtime cost tracker with the
    Kubernetes library's ``CallCost``): the estimate, where the run charges more than the estimate
    does (a select on a value of unknown type, ``startsWith``/``endsWith`` on their receiver,
    ``join``) charged as the run does. With :func:`device_sizes`, the bound for one device.

    The estimate alone is not a bound: ``s.startsWith("NVIDIA")`` is estimated at the prefix's
    length and run at ``s``'s, so a selector the API server admits near the limit can be stopped at
    run time."""
    return _Coster(checked, sizes, True, release).cost(checked.expr).high


def describe(value: int) -> str:
    """A cost for people: saturated means unbounded (a size nothing limits)."""
    return "unbounded" if value >= _UNBOUNDED else f"{value:,}"
