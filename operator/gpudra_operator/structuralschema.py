"""An object checked against a CRD's structural schema the way the API server checks it, before CEL.

:mod:`jsonschema` does the walking and the standard keywords (Draft 4, the base of OpenAPI v3.0's
schema object): type, enum, required, string/list/map bounds, pattern, numeric bounds. This module
adds what Kubernetes means on top:

* ``nullable``: ``null`` is refused unless the schema allows it, and a ``null`` is checked no further;
* ``x-kubernetes-int-or-string``: an integer or a string, whatever ``type`` says;
* unknown fields are errors (kubectl's default strict field validation) unless the schema has
  ``additionalProperties`` or ``x-kubernetes-preserve-unknown-fields``; the root's ``metadata`` is
  ObjectMeta, which the API server checks itself;
* ``x-kubernetes-list-type: map``/``set``: no two items with the same keys / the same value;
* ``x-kubernetes-validations``: of the CEL rules only ``self.matches('<re>')`` runs, the one form
  Python runs exactly; the rest are the API server's.

``format`` is not checked. Each problem is one line, ``<field path>: <reason>``, in document order,
worded as a person fixing the file needs it; a value of the wrong type gets that one line only."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from jsonschema import Draft4Validator, ValidationError
from jsonschema.validators import create

Keyword = Callable[[Any, Any, Any, Mapping[str, Any]], Iterable[ValidationError] | None]

_MATCHES_RULE = re.compile(r"self\.matches\('([^'\\]*)'\)")
_TYPE_KEYWORDS = {"type", "x-kubernetes-int-or-string", "nullable"}


def schema_errors(schema: Mapping[str, Any], value: Any) -> list[str]:
    """Problems of ``value`` against the structural ``schema``, each as ``path: reason``."""
    errors = list(_StructuralValidator(_object_meta_unchecked(schema)).iter_errors(value))
    mistyped = {tuple(e.absolute_path) for e in errors if e.validator in _TYPE_KEYWORDS}
    errors = [e for e in errors if e.validator in _TYPE_KEYWORDS or tuple(e.absolute_path) not in mistyped]
    errors.sort(key=lambda e: _position(value, e.absolute_path))
    return [f"{_field(e.absolute_path)}: {e.message}" for e in errors]


# --- Kubernetes' keywords -----------------------------------------------------------------------
def _nullable(validator: Any, nullable: Any, instance: Any, schema: Mapping[str, Any]) -> Iterator[ValidationError]:
    if instance is None and not nullable:
        yield ValidationError("must not be null")


def _int_or_string(validator: Any, on: Any, instance: Any, schema: Mapping[str, Any]) -> Iterator[ValidationError]:
    if on and (isinstance(instance, bool) or not isinstance(instance, (int, str))):
        yield ValidationError(f"must be an integer or a string, got {type(instance).__name__}")


def _type(validator: Any, types: Any, instance: Any, schema: Mapping[str, Any]) -> Iterable[ValidationError]:
    if schema.get("x-kubernetes-int-or-string"):
        return ()
    return Draft4Validator.VALIDATORS["type"](validator, types, instance, schema) or ()


def _required(validator: Any, required: Any, instance: Any, schema: Mapping[str, Any]) -> Iterator[ValidationError]:
    if isinstance(instance, dict):
        for key in required:
            if key not in instance:
                yield ValidationError("required", path=[key])


def _properties(validator: Any, properties: Any, instance: Any, schema: Mapping[str, Any]) -> Iterator[ValidationError]:
    yield from Draft4Validator.VALIDATORS["properties"](validator, properties, instance, schema) or ()
    if (isinstance(instance, dict) and not isinstance(schema.get("additionalProperties"), Mapping)
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        for key in instance:
            if key not in properties:
                yield ValidationError("unknown field", path=[key])


def _list_type(validator: Any, list_type: Any, instance: Any, schema: Mapping[str, Any]) -> Iterator[ValidationError]:
    if not isinstance(instance, list) or list_type not in ("map", "set"):
        return
    keys = schema.get("x-kubernetes-list-map-keys") or []
    seen: dict[str, int] = {}
    for index, item in enumerate(instance):
        if list_type == "map" and not (isinstance(item, dict) and all(item.get(k) is not None for k in keys)):
            continue  # no key to compare: the item's own schema reports it
        identity = item if list_type == "set" else {k: item[k] for k in keys}
        text = json.dumps(identity, default=str, sort_keys=True)
        if text in seen:
            what = "value" if list_type == "set" else ", ".join(f"{k} {_json(item[k])}" for k in keys)
            yield ValidationError(f"duplicate entry: {what} is already at [{seen[text]}]", path=[index])
        else:
            seen[text] = index


def _validations(validator: Any, rules: Any, instance: Any, schema: Mapping[str, Any]) -> Iterator[ValidationError]:
    if not isinstance(instance, str):
        return
    for rule in rules:
        match = _MATCHES_RULE.fullmatch(rule.get("rule", ""))
        if match and not re.search(match.group(1), instance):
            yield ValidationError(f"{rule.get('message') or 'must match ' + match.group(1)}, got {_json(instance)}")


# --- the standard keywords, worded for the person fixing the file ------------------------------
def _bound(word: str, unit: str) -> Callable[[Any, Any, Mapping[str, Any]], str]:
    return lambda limit, instance, _: f"{word} {limit} {unit}, got {len(instance)}"


def _compared(inclusive: str, exclusive: str, flag: str) -> Callable[[Any, Any, Mapping[str, Any]], str]:
    return lambda limit, instance, schema: (
        f"must be {exclusive if schema.get(flag) else inclusive} {limit}, got {instance}")


_WORDS: dict[str, Callable[[Any, Any, Mapping[str, Any]], str]] = {
    "type": lambda types, instance, _: f"must be {types}, got {type(instance).__name__} {_json(instance)[:60]}",
    "enum": lambda enum, instance, _: f"must be one of {', '.join(map(_json, enum))}, got {_json(instance)}",
    "pattern": lambda pattern, instance, _: f"must match {pattern}, got {_json(instance)}",
    "maxLength": _bound("at most", "characters"),
    "minLength": _bound("at least", "characters"),
    "maxItems": _bound("at most", "items"),
    "minItems": _bound("at least", "items"),
    "maxProperties": _bound("at most", "entries"),
    "minProperties": _bound("at least", "entries"),
    "minimum": _compared(">=", ">", "exclusiveMinimum"),
    "maximum": _compared("<=", "<", "exclusiveMaximum"),
    "multipleOf": lambda factor, instance, _: f"must be a multiple of {factor}, got {instance}",
}


def _kubernetes(keyword: str, check: Keyword) -> Keyword:
    """``check`` for non-null values only (``nullable`` decides about null), worded by _WORDS."""
    words = _WORDS.get(keyword)

    def run(validator: Any, value: Any, instance: Any, schema: Mapping[str, Any]) -> Iterator[ValidationError]:
        if instance is None:
            return
        for error in check(validator, value, instance, schema) or ():
            if words is not None:
                error.message = words(value, instance, schema)
            yield error

    return run


def _applicable(schema: Mapping[str, Any]) -> Iterable[tuple[str, Any]]:
    """Every keyword of ``schema``, and ``nullable`` even where it is absent (null is refused then)."""
    yield "nullable", schema.get("nullable", False)
    yield from ((k, v) for k, v in schema.items() if k != "nullable")


_StructuralValidator = create(
    meta_schema=Draft4Validator.META_SCHEMA,
    validators={
        **{k: _kubernetes(k, check) for k, check in Draft4Validator.VALIDATORS.items()},
        "type": _kubernetes("type", _type),
        "required": _kubernetes("required", _required),
        "properties": _kubernetes("properties", _properties),
        "nullable": _nullable,
        "x-kubernetes-int-or-string": _kubernetes("x-kubernetes-int-or-string", _int_or_string),
        "x-kubernetes-list-type": _kubernetes("x-kubernetes-list-type", _list_type),
        "x-kubernetes-validations": _kubernetes("x-kubernetes-validations", _validations),
    },
    type_checker=Draft4Validator.TYPE_CHECKER,
    id_of=Draft4Validator.ID_OF,
    applicable_validators=_applicable,
)


def _object_meta_unchecked(schema: Mapping[str, Any]) -> Mapping[str, Any]:
    properties = schema.get("properties") or {}
    if "metadata" not in properties:
        return schema
    metadata = {**properties["metadata"], "x-kubernetes-preserve-unknown-fields": True}
    return {**schema, "properties": {**properties, "metadata": metadata}}


# --- paths ---------------------------------------------------------------------------------------
def _position(document: Any, path: Sequence[Any]) -> tuple[int, ...]:
    """Where ``path`` is in ``document``, for sorting: each step's index in its object or list (a
    missing key sorts after the keys that are there)."""
    position: list[int] = []
    node = document
    for step in path:
        if isinstance(node, dict):
            keys = list(node)
            position.append(keys.index(step) if step in node else len(keys))
            node = node.get(step)
        elif isinstance(node, list) and isinstance(step, int):
            position.append(step)
            node = node[step] if step < len(node) else None
        else:
            position.append(0)
            node = None
    return tuple(position)


def _field(path: Iterable[Any]) -> str:
    """``spec.agent.extraEnv[0].name``; keys that are not identifiers as ``["a.b/c"]``."""
    text = ""
    for step in path:
        if isinstance(step, int):
            text += f"[{step}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", step):
            text += f".{step}" if text else step
        else:
            text += f"[{json.dumps(step)}]"
    return text or "<root>"


def _json(value: Any) -> str:
    return json.dumps(value, default=str)
