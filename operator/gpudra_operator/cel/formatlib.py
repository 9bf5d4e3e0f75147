"""The named formats, as k8s.io/apiserver/pkg/cel/library/format.go (Kubernetes 1.35, in the base
environment from 1.31) declares them: ``format.named(<name>)`` (an optional ``Format``), one
constructor ``format.<name>()`` per format, and ``<Format>.validate(<string>)``: ``optional.none()``
when the string is valid, else the optional list of upstream's error messages.

The validators are the functions upstream calls, with their messages:

* ``dns1123Label``, ``dns1123Subdomain``, ``dns1035Label`` and their ``...Prefix`` forms:
  k8s.io/apimachinery/pkg/api/validation generic.go ``NameIsDNSLabel``/``NameIsDNSSubdomain``/
  ``NameIsDNS1035Label`` over pkg/util/validation (lengths "characters"); a prefix's trailing dash
  is masked as ``maskTrailingDash`` does, the character before it included;
* ``qualifiedName`` and ``labelValue``: pkg/api/validate/content kube.go ``IsLabelKey`` and
  ``IsLabelValue`` (lengths "bytes");
* ``uri``: url.ParseRequestURI's error (:mod:`.urlslib`);
* ``uuid``, ``byte``, ``date``, ``datetime``: k8s.io/kube-openapi/pkg/validation/strfmt (the UUID
  pattern, govalidator's base64 pattern, ``time.Parse("2006-01-02")``, ``IsDateTime``).

cel-cpp's Python binding cannot return an optional from Python, so the two optional functions are
declared for the type checker only (with upstream's optional types, :func:`checker_declarations`)
and run as a map lookup: the compiled tree's ``format.named(n)`` and ``f.validate(s)`` calls are
wrapped in an optional select, ``<call>.?value``, over implementations that return ``{}`` or
``{"value": result}`` (:func:`running_form`, :func:`running_functions`). The select makes exactly
the optional upstream returns, and nothing else changes.
"""

from __future__ import annotations

import calendar
import re
from collections.abc import Callable
from typing import Any

from cel_expr_python import cel

from gpudra_operator.cel import astwalk, urlslib
from gpudra_operator.cel.gen import checked_ast_pb2 as ast
from gpudra_operator.cel.opaque import FORMAT_TYPE, FormatMessage

FORMAT = cel.Type(FORMAT_TYPE)
OPTIONAL_FUNCTIONS = frozenset({"format.named", "validate"})
_VALUE = "value"  # the running form's map key

_DNS1123_LABEL = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = _DNS1123_LABEL + "(\\." + _DNS1123_LABEL + ")*"
_DNS1035_LABEL = "[a-z]([-a-z0-9]*[a-z0-9])?"
_LABEL_KEY = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_LABEL_VALUE = "(" + _LABEL_KEY + ")?"
_DNS1123_LABEL_MESSAGE = ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
                          "and must start and end with an alphanumeric character")
_DNS1123_SUBDOMAIN_MESSAGE = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, "
                              "'-' or '.', and must start and end with an alphanumeric character")
_DNS1035_LABEL_MESSAGE = ("a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with "
                          "an alphabetic character, and end with an alphanumeric character")
_LABEL_KEY_MESSAGE = ("must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
                      "alphanumeric character")
_LABEL_VALUE_MESSAGE = ("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' "
                        "or '.', and must start and end with an alphanumeric character")
# strfmt default.go UUIDPattern; govalidator patterns.go Base64; strfmt time.go DateTimePattern.
_UUID = re.compile(r"[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}", re.IGNORECASE)
_BASE64 = re.compile(r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=|[A-Za-z0-9+/]{4})")
_DATE = re.compile(r"([0-9]{4})-([0-9]{2})-([0-9]{2})")
_TIME = re.compile(r"([0-9]{2}):([0-9]{2}):([0-9]{2})(.[0-9]+)?(z|([+-][0-9]{2}:[0-9]{2}))")


def _matches(pattern: str, value: str) -> bool:
    # Go's MatchString on "^" + pattern + "$": the whole string (Go's $ is the end of the text).
    return re.fullmatch(pattern, value) is not None


def _length(value: str) -> int:
    return len(value.encode(errors="surrogateescape"))  # Go's len: bytes (a masked prefix may split a character)


def _regex_error(message: str, pattern: str, *examples: str) -> str:
    """validation.RegexError with examples (the same words in util/validation and
    api/validate/content)."""
    shown = " or ".join(f"'{example}', " for example in examples)
    return f"{message} (e.g. {shown}regex used for validation is '{pattern}')"


def _dns1123_label(value: str) -> list[str]:
    """util/validation IsDNS1123Label."""
    errors = ["must be no more than 63 characters"] if _length(value) > 63 else []
    if not _matches(_DNS1123_LABEL, value):
        errors.append("must not contain dots" if _matches(_DNS1123_SUBDOMAIN, value) else
                      _regex_error(_DNS1123_LABEL_MESSAGE, _DNS1123_LABEL, "my-name", "123-abc"))
    return errors


def _dns1123_subdomain(value: str, unit: str = "characters") -> list[str]:
    """util/validation IsDNS1123Subdomain; content.IsDNS1123Subdomain says "bytes"."""
    errors = [f"must be no more than 253 {unit}"] if _length(value) > 253 else []
    if not _matches(_DNS1123_SUBDOMAIN, value):
        errors.append(_regex_error(_DNS1123_SUBDOMAIN_MESSAGE, _DNS1123_SUBDOMAIN, "example.com"))
    return errors


def _dns1035_label(value: str) -> list[str]:
    """util/validation IsDNS1035Label."""
    errors = ["must be no more than 63 characters"] if _length(value) > 63 else []
    if not _matches(_DNS1035_LABEL, value):
        errors.append(_regex_error(_DNS1035_LABEL_MESSAGE, _DNS1035_LABEL, "my-name", "abc-123"))
    return errors


def _prefix(validate: Callable[[str], list[str]]) -> Callable[[str], list[str]]:
    def validate_prefix(value: str) -> list[str]:
        # generic.go maskTrailingDash: name[:len(name)-2] + "a" (in bytes).
        if _length(value) > 1 and value.endswith("-"):
            value = value.encode()[:-2].decode(errors="surrogateescape") + "a"
        return validate(value)
    return validate_prefix


def _qualified_name(value: str) -> list[str]:
    """content.IsLabelKey (validation.IsQualifiedName)."""
    errors: list[str] = []
    parts = value.split("/")
    if len(parts) > 2:
        return ["a valid label key " + _regex_error(_LABEL_KEY_MESSAGE, _LABEL_KEY, "MyName", "my.name", "123-abc")
                + " with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')"]
    name = parts[-1]
    if len(parts) == 2:
        if not parts[0]:
            errors.append("prefix part must be non-empty")
        else:
            errors += ["prefix part " + message for message in _dns1123_subdomain(parts[0], "bytes")]
    if not name:
        errors.append("name part must be non-empty")
    elif _length(name) > 63:
        errors.append("name part must be no more than 63 bytes")
    if not _matches(_LABEL_KEY, name):
        errors.append("name part " + _regex_error(_LABEL_KEY_MESSAGE, _LABEL_KEY, "MyName", "my.name", "123-abc"))
    return errors


def _label_value(value: str) -> list[str]:
    """content.IsLabelValue."""
    errors = ["must be no more than 63 bytes"] if _length(value) > 63 else []
    if not _matches(_LABEL_VALUE, value):
        errors.append(_regex_error(_LABEL_VALUE_MESSAGE, _LABEL_VALUE, "MyValue", "my_value", "12345"))
    return errors


def _uri(value: str) -> list[str]:
    try:
        urlslib.parse_request_uri(value)
    except urlslib.URLError as error:
        return [str(error)]
    return []


def is_date(value: str) -> bool:
    """strfmt IsDate: time.Parse("2006-01-02"): four digits, two, two, and a day of that month."""
    match = _DATE.fullmatch(value) if value.isascii() else None
    if match is None:
        return False
    year, month, day = (int(part) for part in match.groups())
    if not 1 <= month <= 12:
        return False
    days = 29 if month == 2 and calendar.isleap(year) else (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)[month - 1]
    return 1 <= day <= days


def _go_lower(value: str) -> str:
    # strings.ToLower maps rune by rune (unicode.ToLower); Python's lower() maps U+0130 to two.
    return "".join("i" if c == "\u0130" else c.lower() for c in value)


def is_datetime(value: str) -> bool:
    """strfmt IsDateTime: a date, a "t", a time that the pattern matches in the part after the
    first "t" (later ones are ignored), hours <= 23, minutes and seconds <= 59."""
    if _length(value) < 4:
        return False
    parts = _go_lower(value).split("t")
    if len(parts) < 2 or not is_date(parts[0]):
        return False
    match = _TIME.fullmatch(parts[1])
    return match is not None and match[1] <= "23" and match[2] <= "59" and match[3] <= "59"


def _strfmt(check: Callable[[str], bool], message: str) -> Callable[[str], list[str]]:
    return lambda value: [] if check(value) else [message]


# format.go ConstantFormats: the name format.named takes, the Format's Name, the validator.
FORMATS: dict[str, tuple[str, Callable[[str], list[str]]]] = {
    "dns1123Label": ("DNS1123Label", _dns1123_label),
    "dns1123Subdomain": ("DNS1123Subdomain", _dns1123_subdomain),
    "dns1035Label": ("DNS1035Label", _dns1035_label),
    "qualifiedName": ("QualifiedName", _qualified_name),
    "dns1123LabelPrefix": ("DNS1123LabelPrefix", _prefix(_dns1123_label)),
    "dns1123SubdomainPrefix": ("DNS1123SubdomainPrefix", _prefix(_dns1123_subdomain)),
    "dns1035LabelPrefix": ("DNS1035LabelPrefix", _prefix(_dns1035_label)),
    "labelValue": ("LabelValue", _label_value),
    "uri": ("URI", _uri),
    "uuid": ("uuid", _strfmt(lambda value: _UUID.fullmatch(value) is not None, "does not match the UUID format")),
    "byte": ("byte", _strfmt(lambda value: _BASE64.fullmatch(value) is not None, "invalid base64")),
    "date": ("date", _strfmt(is_date, "invalid date")),
    "datetime": ("datetime", _strfmt(is_datetime, "invalid datetime")),
}
_BY_NAME = {name: validate for name, validate in FORMATS.values()}


def _validate(format_: Any, value: str) -> dict[str, list[str]]:
    errors = _BY_NAME[format_.name](value)
    return {_VALUE: errors} if errors else {}


def _named(name: str) -> dict[str, Any]:
    return {_VALUE: FormatMessage(name=FORMATS[name][0])} if name in FORMATS else {}


def functions() -> list[tuple[str, list[cel.Overload]]]:
    """The constructors ``format.<name>()`` (format.go ``CompileOptions``: the overload ID is the
    function's name), merged with the other libraries' by :mod:`.environment`."""
    def constructor(name: str) -> Callable[[], Any]:
        return lambda: FormatMessage(name=name)
    return [(f"format.{key}", [cel.Overload(f"format.{key}", FORMAT, [], impl=constructor(name))])
            for key, (name, _) in FORMATS.items()]


def running_functions() -> list[tuple[str, list[cel.Overload]]]:
    """``format.named`` and ``validate`` as :func:`running_form` calls them: a map to select from."""
    T = cel.Type
    return [
        ("validate", [cel.Overload("format-validate", T.Map(T.STRING, T.List(T.STRING)), [FORMAT, T.STRING],
                                   is_member=True, impl=_validate)]),
        ("format.named", [cel.Overload("format-named", T.Map(T.STRING, FORMAT), [T.STRING], impl=_named)]),
    ]


def checker_declarations() -> list[dict[str, Any]]:
    """``format.named`` and ``validate`` with upstream's optional types, for the type checker
    (cel-cpp's environment config schema)."""
    def optional(param: dict[str, Any]) -> dict[str, Any]:
        return {"type_name": "optional_type", "params": [param]}
    string = {"type_name": "string"}
    return [
        {"name": "validate", "overloads": [{
            "id": "format-validate", "target": {"type_name": FORMAT_TYPE}, "args": [string],
            "return": optional({"type_name": "list", "params": [string]})}]},
        {"name": "format.named", "overloads": [{
            "id": "format-named", "args": [string], "return": optional({"type_name": FORMAT_TYPE})}]},
    ]


def _is_optional_call(node: ast.Expr) -> bool:
    return node.WhichOneof("expr_kind") == "call_expr" and node.call_expr.function in OPTIONAL_FUNCTIONS


def running_form(checked: ast.CheckedExpr) -> ast.CheckedExpr | None:
    """The checked tree with each ``format.named``/``validate`` call ``c`` made ``c.?value``, as the
    checker writes an optional select (a ``_?._`` call, overload ``select_optional_field``), or None
    when it has none. The select keeps the call's node ID, so its type stays upstream's optional;
    the call moves to a new ID with its reference and the map type it has here."""
    if not any(_is_optional_call(node) for node in astwalk.nodes(checked.expr)):
        return None
    rewritten = ast.CheckedExpr()
    rewritten.CopyFrom(checked)
    used = [*rewritten.reference_map, *rewritten.type_map]
    for node in astwalk.nodes(rewritten.expr):
        used.append(node.id)
        if node.WhichOneof("expr_kind") == "struct_expr":
            used += [entry.id for entry in node.struct_expr.entries]
    next_id = max(used) + 1
    # Children first: a call wrapped later copies its arguments with their own wrapping done.
    for node in [node for node in astwalk.nodes(rewritten.expr) if _is_optional_call(node)]:
        call_id, key_id = next_id, next_id + 1
        next_id += 2
        call = ast.Expr()
        call.CopyFrom(node)
        call.id = call_id
        key = ast.Expr(id=key_id)
        key.const_expr.string_value = _VALUE
        rewritten.reference_map[call_id].CopyFrom(rewritten.reference_map[node.id])
        rewritten.reference_map[node.id].CopyFrom(ast.Reference(name="_?._", overload_id=["select_optional_field"]))
        result = rewritten.type_map[node.id].abstract_type.parameter_types
        if result:
            value_type = rewritten.type_map[call_id].map_type
            value_type.key_type.primitive = ast.Type.STRING
            value_type.value_type.CopyFrom(result[0])
        rewritten.type_map[key_id].primitive = ast.Type.STRING
        node.ClearField("call_expr")
        node.call_expr.function = "_?._"
        node.call_expr.args.extend([call, key])
    return rewritten
