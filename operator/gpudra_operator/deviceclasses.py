"""DeviceClasses from Jinja2 templates: built-in ones shipped in ``templates/*.j2`` and users' inline
ones, both rendered the same way. Pure: no API calls.

Safety, in layers:

* Templates run in Jinja2's immutable sandbox with ``StrictUndefined``: no Python internals
  (``''.__class__`` is a :class:`jinja2.exceptions.SecurityError`), no mutation of the context, no
  silently empty variables, no ``include``/``import`` (the environment has no loader), and the
  output is capped at :data:`MAX_RENDERED_CHARS`.
* Values enter CEL only through helpers that escape or validate them: :func:`cel_string` (a
  double-quoted CEL literal, printable ASCII only, so no value can close the literal or add an
  operator), :func:`quantity_literal` (a Kubernetes quantity, checked with the apimachinery
  grammar), :func:`semver_literal` (a semantic version, ``8.0`` normalised to ``8.0.0``). The CEL
  string then enters YAML through :func:`yaml_string`, a double-quoted YAML scalar, so no value can
  change the document's structure either.
* Attribute and capacity names come from the driver's device model
  (:mod:`gpudra_driver.devicemodel`): ``attr()``/``capacity()`` refuse names the agent never
  publishes, and every finished CEL expression is scanned for ``device.attributes["<driver>"].x`` /
  ``device.capacity["<driver>"]["x"]`` references, so a hand-written name in an inline template is
  checked too.
* The result must be exactly one ``resource.k8s.io/v1`` DeviceClass whose name (when set) is the
  spec's; anything else is a :class:`RenderError` that names the class.

What only the API server can check (CEL types, cost) is left to the operator's server-side dry run.
"""

from __future__ import annotations

import re
import signal
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from contextlib import contextmanager
from functools import cache, lru_cache
from importlib import resources
from types import TracebackType
from typing import Any

import jinja2
import yaml
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gpudra_driver import devicemodel, limits

MAX_RENDERED_CHARS = 64 * 1024
MAX_RENDER_SECONDS = 2.0  # CPU a template may take (a loop that prints nothing is not size-capped)
DEVICE_CLASS_API_VERSION = "resource.k8s.io/v1"
DEVICE_CLASS_KIND = "DeviceClass"
_TEMPLATE_NAME = "<template>"

# The apimachinery quantity grammar (the pattern the apiserver publishes for resource.Quantity).
QUANTITY_PATTERN = re.compile(
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
_NUMERIC_VERSION = re.compile(r"^v?[0-9]+(\.[0-9]+){0,2}$")


class RenderError(Exception):
    """One DeviceClass that could not be rendered: ``class_name`` says which, ``message`` why."""

    def __init__(self, class_name: str, message: str) -> None:
        super().__init__(f"DeviceClass {class_name!r}: {message}")
        self.class_name = class_name
        self.message = message

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, RenderError) and other.class_name == self.class_name
                and other.message == self.message)

    def __hash__(self) -> int:
        return hash((self.class_name, self.message))


class TemplateValueError(ValueError):
    """A value a template helper refused (a bad quantity, an unknown attribute, ...)."""


@dataclass(frozen=True)
class Builtin:
    """A built-in template: its parameters, and what it selects (for docs and ``--help``)."""

    name: str
    required: tuple[str, ...]
    optional: tuple[str, ...]
    description: str

    @property
    def parameters(self) -> tuple[str, ...]:
        return self.required + self.optional


BUILTINS: Mapping[str, Builtin] = {
    b.name: b
    for b in (
        Builtin("all", (), (), "every device of the driver"),
        Builtin("full-gpu", (), (), "whole GPUs (type == \"gpu\"), no MIG devices"),
        Builtin("mig", (), ("profile",), "MIG devices, optionally of one profile such as 3g.40gb"),
        Builtin("min-memory", ("memory",), (), "devices with at least `memory` (a quantity) of memory"),
        Builtin("product", ("productName",), (), "devices whose productName equals `productName`"),
        Builtin("min-compute-capability", ("version",), (),
                "devices whose CUDA compute capability is at least `version` (e.g. 8.0)"),
        Builtin("architecture", ("architecture",), (), "devices of one architecture, e.g. Hopper"),
    )
}


# -- value helpers (also the Jinja filters) ------------------------------------------------------

_CEL_SHORT_ESCAPES = {"\\": "\\\\", '"': '\\"'}


def cel_string(value: object) -> str:
    """``value`` as a double-quoted CEL string literal that decodes back to exactly ``value``.

    Backslash and double quote are escaped; everything outside printable ASCII (control
    characters, newlines, DEL, non-ASCII) becomes ``\\uXXXX``/``\\UXXXXXXXX``. The literal is
    therefore one token of printable ASCII whatever the input: a value can never end it early.
    """
    if not isinstance(value, str):
        raise TemplateValueError(f"cel_string() needs a string, got {type(value).__name__} {value!r}")
    out = ['"']
    for ch in value:
        code = ord(ch)
        if ch in _CEL_SHORT_ESCAPES:
            out.append(_CEL_SHORT_ESCAPES[ch])
        elif 0x20 <= code < 0x7F:
            out.append(ch)
        elif 0xD800 <= code <= 0xDFFF:
            raise TemplateValueError(f"cel_string(): lone surrogate U+{code:04X} is not text")
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


def yaml_string(value: object) -> str:
    """``value`` (a string) as a double-quoted YAML scalar of printable ASCII, safe on one line
    after ``key: `` whatever it contains."""
    if not isinstance(value, str):
        raise TemplateValueError(f"yaml_string needs a string, got {type(value).__name__}")
    out = ['"']
    for ch in value:
        code = ord(ch)
        if ch == "\\" or ch == '"':
            out.append("\\" + ch)
        elif 0x20 <= code < 0x7F:
            out.append(ch)
        elif 0xD800 <= code <= 0xDFFF:
            raise TemplateValueError(f"yaml_string: lone surrogate U+{code:04X} is not text")
        elif code <= 0xFF:
            out.append(f"\\x{code:02x}")
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


def is_quantity(value: str) -> bool:
    return bool(QUANTITY_PATTERN.fullmatch(value))


def quantity_literal(value: object) -> str:
    """``quantity("<value>")`` after checking ``value`` against the apimachinery grammar."""
    text = value if isinstance(value, str) else str(value) if type(value) is int else None
    if text is None or not is_quantity(text):
        raise TemplateValueError(f"{value!r} is not a Kubernetes quantity (e.g. 64Gi, 80G, 1.5Ti)")
    return f"quantity({cel_string(text)})"


def normalize_semver(value: object) -> str:
    """A semantic version from a parameter: full semver as is, ``8``/``8.0``/``v8.0`` padded to
    ``8.0.0`` (leading zeros dropped)."""
    if not isinstance(value, str):
        raise TemplateValueError(f"a version must be a string, got {type(value).__name__} {value!r}")
    text = value.strip()
    if limits.is_semver(text):
        return text
    if _NUMERIC_VERSION.fullmatch(text):
        return devicemodel.normalize_version(text.lstrip("v"))
    raise TemplateValueError(f"{value!r} is not a version (MAJOR[.MINOR[.PATCH]], e.g. 8.0)")


def semver_literal(value: object) -> str:
    """``semver("<normalised value>")``."""
    return f"semver({cel_string(normalize_semver(value))})"


def attribute_ref(name: str, driver: str) -> str:
    """CEL for one published attribute; unknown names raise :class:`TemplateValueError`."""
    if not isinstance(name, str) or devicemodel.attribute_type(name, driver) is None:
        known = ", ".join(devicemodel.attribute_names())
        raise TemplateValueError(f"attribute {name!r} is not published by the agent (known: {known})")
    domain, _, bare = name.rpartition("/")
    return f"device.attributes[{cel_string(domain or driver)}].{bare}"


def capacity_ref(name: str, driver: str) -> str:
    """CEL for one published capacity; unknown names raise :class:`TemplateValueError`."""
    if not isinstance(name, str) or not devicemodel.is_capacity(name, driver):
        known = ", ".join(devicemodel.capacity_names())
        raise TemplateValueError(f"capacity {name!r} is not published by the agent (known: {known})")
    return f"device.capacity[{cel_string(driver)}].{name.rpartition('/')[2]}"


def driver_match(driver: str) -> str:
    """``device.driver == "<driver>"``: the guard every built-in starts with, so the rest of the
    expression is never evaluated (and never errors) on another driver's devices."""
    return f"device.driver == {cel_string(driver)}"


# -- a small CEL lexer, enough to find attribute references outside string literals -------------

@dataclass(frozen=True)
class Token:
    kind: str  # "ident", "string", "number", "op"
    text: str
    value: str | None = None  # decoded value of a string literal


_CEL_SIMPLE_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t",
                       "v": "\v", "\\": "\\", "?": "?", '"': '"', "'": "'", "`": "`"}
_OPS = ("==", "!=", "<=", ">=", "&&", "||", "+", "-", "*", "/", "%", "!", "<", ">", "?", ":",
        ".", ",", "(", ")", "[", "]", "{", "}")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NUMBER = re.compile(r"0[xX][0-9a-fA-F]+[uU]?|[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)?[uU]?|\.[0-9]+([eE][+-]?[0-9]+)?")


class CelSyntaxError(ValueError):
    pass


def _decode_escapes(body: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(body):
        ch = body[i]
        if ch != "\\":
            out.append(ch)
            i += 1
            continue
        if i + 1 >= len(body):
            raise CelSyntaxError("string ends in a backslash")
        esc = body[i + 1]
        if esc in _CEL_SIMPLE_ESCAPES:
            out.append(_CEL_SIMPLE_ESCAPES[esc])
            i += 2
        elif esc in "xX" or esc in "uU":
            width = {"x": 2, "X": 2, "u": 4, "U": 8}[esc]
            digits = body[i + 2:i + 2 + width]
            if len(digits) != width or not re.fullmatch(r"[0-9a-fA-F]+", digits):
                raise CelSyntaxError(f"bad \\{esc} escape")
            out.append(chr(int(digits, 16)))
            i += 2 + width
        elif esc in "0123":
            digits = body[i + 1:i + 4]
            if not re.fullmatch(r"[0-7]{3}", digits):
                raise CelSyntaxError("bad octal escape")
            out.append(chr(int(digits, 8)))
            i += 4
        else:
            raise CelSyntaxError(f"unknown escape \\{esc}")
    return "".join(out)


def cel_tokens(expression: str) -> list[Token]:
    """Tokens of a CEL expression (comments and whitespace dropped, string literals decoded)."""
    tokens: list[Token] = []
    i, n = 0, len(expression)
    while i < n:
        ch = expression[i]
        if ch.isspace():
            i += 1
            continue
        if expression.startswith("//", i):
            end = expression.find("\n", i)
            i = n if end < 0 else end + 1
            continue
        # string literal, with optional r/b prefixes
        m = re.match(r"([rRbB]{0,2})(\"\"\"|'''|\"|')", expression[i:])
        if m and (not m.group(1) or re.fullmatch(r"[rR]?[bB]?|[bB]?[rR]?", m.group(1))):
            prefix, quote = m.group(1), m.group(2)
            raw = "r" in prefix.lower()
            j = i + len(prefix) + len(quote)
            while True:
                if j >= n:
                    raise CelSyntaxError("unterminated string literal")
                if expression.startswith(quote, j):
                    break
                if len(quote) == 1 and expression[j] in "\r\n":
                    raise CelSyntaxError("newline in a string literal")
                j += 2 if expression[j] == "\\" and not raw else 1
            body = expression[i + len(prefix) + len(quote):j]
            end = j + len(quote)
            tokens.append(Token("string", expression[i:end], body if raw else _decode_escapes(body)))
            i = end
            continue
        if ch == "`":
            end = expression.find("`", i + 1)
            if end < 0:
                raise CelSyntaxError("unterminated quoted identifier")
            tokens.append(Token("ident", expression[i:end + 1], expression[i + 1:end]))
            i = end + 1
            continue
        m = _IDENT.match(expression, i)
        if m:
            tokens.append(Token("ident", m.group(0), m.group(0)))
            i = m.end()
            continue
        m = _NUMBER.match(expression, i)
        if m:
            tokens.append(Token("number", m.group(0)))
            i = m.end()
            continue
        for op in _OPS:
            if expression.startswith(op, i):
                tokens.append(Token("op", op))
                i += len(op)
                break
        else:
            raise CelSyntaxError(f"unexpected character {ch!r} at offset {i}")
    return tokens


def _is(tokens: Sequence[Token], i: int, kind: str, text: str | None = None) -> bool:
    return i < len(tokens) and tokens[i].kind == kind and (text is None or tokens[i].text == text)


def model_references(expression: str, driver: str) -> list[tuple[str, str]]:
    """Every ``device.attributes["<driver>"].name`` / ``device.capacity["<driver>"]["name"]``
    reference in ``expression`` as ``("attributes"|"capacity", name)``; other domains are not ours
    to check. Index form, optional selection (``.?name``) and quoted identifiers count too."""
    toks = cel_tokens(expression)
    found: list[tuple[str, str]] = []
    for i in range(len(toks)):
        if not (_is(toks, i, "ident", "device") and _is(toks, i + 1, "op", ".")
                and _is(toks, i + 2, "ident") and toks[i + 2].value in ("attributes", "capacity")
                and _is(toks, i + 3, "op", "[") and _is(toks, i + 4, "string")
                and _is(toks, i + 5, "op", "]")):
            continue
        if toks[i + 4].value != driver:
            continue
        j = i + 6
        name: str | None = None
        if _is(toks, j, "op", "."):
            k = j + 2 if _is(toks, j + 1, "op", "?") else j + 1
            if _is(toks, k, "ident"):
                name = toks[k].value
        elif _is(toks, j, "op", "[") and _is(toks, j + 1, "string") and _is(toks, j + 2, "op", "]"):
            name = toks[j + 1].value
        if name is not None:
            found.append((str(toks[i + 2].value), name))
    return found


def check_model_references(expression: str, driver: str) -> None:
    """Raise :class:`TemplateValueError` when ``expression`` names an attribute or capacity of
    ``driver`` that the device model does not declare."""
    try:
        refs = model_references(expression, driver)
    except CelSyntaxError as error:
        raise TemplateValueError(f"CEL expression does not parse: {error}") from None
    for where, name in refs:
        if where == "attributes":
            spec = devicemodel.ATTRIBUTES.get(name)
            if spec is None or spec.domain is not None:
                raise TemplateValueError(
                    f"attribute {name!r} of {driver} is not published by the agent "
                    f"(known: {', '.join(n for n in devicemodel.attribute_names() if '/' not in n)})")
        elif name not in devicemodel.CAPACITIES:
            raise TemplateValueError(
                f"capacity {name!r} of {driver} is not published by the agent "
                f"(known: {', '.join(devicemodel.capacity_names())})")


# -- rendering -----------------------------------------------------------------------------------

def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        undefined=jinja2.StrictUndefined, autoescape=False, trim_blocks=True, lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters.update(cel_string=cel_string, quantity=quantity_literal, semver=semver_literal,
                       yaml_string=yaml_string)
    return env


_ENV = _environment()


@cache
def builtin_source(template: str) -> str:
    """The text of the built-in template ``template`` (``templates/<template>.j2``)."""
    if template not in BUILTINS:
        raise KeyError(template)
    return (resources.files("gpudra_operator") / "templates" / f"{template}.j2").read_text("utf-8")


@lru_cache(maxsize=256)  # inline sources come from users: bounded
def _compiled(source: str) -> jinja2.Template:
    return _ENV.from_string(source)


def template_context(name: str, driver: str, params: Mapping[str, str]) -> dict[str, Any]:
    """What every template (built-in or inline) sees."""
    return {
        "name": name,
        "driver": driver,
        "params": dict(params),
        "driver_match": driver_match(driver),
        "attr": lambda attribute: attribute_ref(attribute, driver),
        "capacity": lambda capacity: capacity_ref(capacity, driver),
        "cel_string": cel_string,
        "quantity": quantity_literal,
        "semver": semver_literal,
        "yaml_string": yaml_string,
    }


def _template_line(error: BaseException) -> int | None:
    line = getattr(error, "lineno", None)
    tb: TracebackType | None = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == _TEMPLATE_NAME:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def describe_error(error: BaseException) -> str:
    line = _template_line(error)
    at = f" (template line {line})" if line else ""
    if isinstance(error, jinja2.TemplateSyntaxError):
        return f"template syntax error{at}: {error.message}"
    if isinstance(error, jinja2.exceptions.SecurityError):
        return f"sandbox violation{at}: {error}"
    if isinstance(error, jinja2.UndefinedError):
        return f"undefined variable{at}: {error.message}"
    if isinstance(error, TemplateValueError):
        return f"invalid value{at}: {error}"
    return f"template failed{at}: {type(error).__name__}: {error}"


class _RenderTimeout(Exception):
    pass


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Interrupt the render after ``seconds`` of wall time (SIGALRM; main thread only, which is
    where the operator's event loop and the CLI run; elsewhere there is no limit)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(_signum: int, _frame: object) -> None:
        raise _RenderTimeout()

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def render_text_here(source: str, context: Mapping[str, Any]) -> str:
    """Render in this process (built-in templates; inline ones in the bounded worker, where this
    runs too: see :mod:`gpudra_operator.templateworker`)."""
    template = _compiled(source)
    size = 0
    chunks: list[str] = []
    try:
        with _time_limit(MAX_RENDER_SECONDS):
            for chunk in template.generate(context):
                size += len(chunk)
                if size > MAX_RENDERED_CHARS:
                    raise TemplateValueError(f"template output exceeds {MAX_RENDERED_CHARS} characters")
                chunks.append(chunk)
    except _RenderTimeout:
        raise TemplateValueError(f"template took longer than {MAX_RENDER_SECONDS:g} s to render") from None
    return "".join(chunks)


# libyaml's parser where PyYAML has it (its wheels do): the same safe constructors, a tenth of the
# pure-Python parser's time, which was half of what a reconcile of ten classes spent before its
# first request.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _load_one(text: str) -> Any:
    for event in yaml.parse(text, Loader=_YAML_LOADER):
        if isinstance(event, yaml.AliasEvent):
            raise TemplateValueError("rendered YAML uses an alias; write the document out in full")
    docs = [d for d in yaml.load_all(text, Loader=_YAML_LOADER) if d is not None]
    if len(docs) != 1:
        raise TemplateValueError(f"rendered {len(docs)} YAML documents, expected exactly one DeviceClass")
    return docs[0]


_ALLOWED_TOP = {"apiVersion", "kind", "metadata", "spec"}
_ALLOWED_META = {"name", "labels", "annotations"}


def _check_device_class(doc: Any, class_name: str, driver: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise TemplateValueError(f"rendered a YAML {type(doc).__name__}, expected a DeviceClass mapping")
    if doc.get("apiVersion") != DEVICE_CLASS_API_VERSION or doc.get("kind") != DEVICE_CLASS_KIND:
        raise TemplateValueError(
            f"rendered {doc.get('apiVersion')!r} {doc.get('kind')!r}, expected "
            f"{DEVICE_CLASS_API_VERSION} {DEVICE_CLASS_KIND}")
    if extra := sorted(set(doc) - _ALLOWED_TOP):
        raise TemplateValueError(f"unexpected top-level fields {extra}")
    meta = doc.get("metadata") or {}
    if not isinstance(meta, dict):
        raise TemplateValueError("metadata must be a mapping")
    if extra := sorted(set(meta) - _ALLOWED_META):
        raise TemplateValueError(f"metadata may only set name, labels and annotations, not {extra}")
    if "name" in meta and meta["name"] != class_name:
        raise TemplateValueError(f"template sets metadata.name {meta['name']!r}, the spec names it {class_name!r}")
    for key in ("labels", "annotations"):
        values = meta.get(key)
        if values is not None and not (isinstance(values, dict)
                                       and all(isinstance(v, str) for v in values.values())):
            raise TemplateValueError(f"metadata.{key} must map strings to strings")
    spec = doc.get("spec")
    if not isinstance(spec, dict):
        raise TemplateValueError("spec must be a mapping")
    selectors = spec.get("selectors")
    if not isinstance(selectors, list) or not selectors:
        raise TemplateValueError(
            "spec.selectors must list at least one CEL selector (a class without one matches every "
            "device of every driver)")
    if len(selectors) > limits.MAX_SELECTORS:
        raise TemplateValueError(f"{len(selectors)} selectors, the limit is {limits.MAX_SELECTORS}")
    for index, selector in enumerate(selectors):
        cel = selector.get("cel") if isinstance(selector, dict) else None
        expression = cel.get("expression") if isinstance(cel, dict) else None
        if not isinstance(expression, str) or set(selector) != {"cel"}:
            raise TemplateValueError(f"spec.selectors[{index}] must be {{cel: {{expression: <string>}}}}")
        try:
            limits.check_cel_expression(f"spec.selectors[{index}]", expression)
        except limits.LimitError as error:
            raise TemplateValueError(str(error)) from None
        check_model_references(expression, driver)
    return {**doc, "metadata": {**meta, "name": class_name}}


def check_parameters(template: str, params: Mapping[str, str]) -> None:
    builtin = BUILTINS[template]
    missing = [p for p in builtin.required if p not in params]
    unknown = sorted(set(params) - set(builtin.parameters))
    if missing:
        raise TemplateValueError(f"template {template} needs parameter(s) {', '.join(missing)}")
    if unknown:
        allowed = ", ".join(builtin.parameters) or "none"
        raise TemplateValueError(f"template {template} does not take parameter(s) {', '.join(unknown)} "
                                 f"(it takes: {allowed})")
    for key, value in params.items():
        if not isinstance(value, str):
            raise TemplateValueError(f"parameter {key} must be a string, got {value!r}")


def render_device_class(name: str, driver: str, *, template: str | None = None,
                        inline: str | None = None,
                        params: Mapping[str, str] | None = None) -> dict[str, Any]:
    """One DeviceClass (a dict, metadata.name forced to ``name``), or :class:`RenderError`.

    Exactly one of ``template`` (a key of :data:`BUILTINS`) or ``inline`` (Jinja2 source)."""
    params = dict(params or {})
    try:
        if (template is None) == (inline is None):
            raise TemplateValueError("exactly one of template or inline must be set")
        if not limits.is_dns_subdomain(name):
            raise TemplateValueError(f"{name!r} is not a DNS subdomain")
        if template is not None:
            if template not in BUILTINS:
                raise TemplateValueError(f"unknown template {template!r} (built-ins: {', '.join(BUILTINS)})")
            check_parameters(template, params)
            source = builtin_source(template)
        else:
            source = str(inline)
        if template is not None:
            text = render_text_here(source, template_context(name, driver, params))
        else:  # a config author's code: rendered where memory and CPU are bounded
            from gpudra_operator.templateworker import WORKER, TemplateBoundExceeded

            try:
                text = WORKER.render(name, driver, params, source)
            except TemplateBoundExceeded as error:
                raise RenderError(name, f"template exceeded its bounds: {error}") from None
            except ValueError as error:  # the template's own failure, described by the worker
                raise RenderError(name, str(error)) from None
        try:
            doc = _load_one(text)
        except yaml.YAMLError as error:
            raise TemplateValueError(f"rendered invalid YAML: {error}") from None
        return _check_device_class(doc, name, driver)
    except RenderError:
        raise
    except Exception as error:  # noqa: BLE001 - every template failure becomes one RenderError
        raise RenderError(name, describe_error(error)) from error


def render_device_classes(classes: Iterable[Any], driver: str) -> tuple[list[dict[str, Any]], list[RenderError]]:
    """Render each class (objects with ``name``, ``template``, ``inline``, ``parameters``); a bad
    class is reported and skipped, never stopping the others. Duplicate names are errors."""
    objects: list[dict[str, Any]] = []
    errors: list[RenderError] = []
    seen: set[str] = set()
    for cls in classes:
        if cls.name in seen:
            errors.append(RenderError(cls.name, "listed twice in spec.deviceClasses"))
            continue
        seen.add(cls.name)
        try:
            objects.append(render_device_class(cls.name, driver, template=cls.template,
                                               inline=cls.inline, params=cls.parameters))
        except RenderError as error:
            errors.append(error)
    return objects, errors
