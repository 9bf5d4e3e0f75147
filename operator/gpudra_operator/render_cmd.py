"""`gpudra render`: print every object the operator would create for a GpuDraConfig file, with no
cluster, so GitOps repositories can review and diff them in CI.

The file goes through what the API server would do first: the CRD's structural schema (types,
enums, patterns, bounds, unknown fields) and its ``default:`` values (:func:`gpudra_operator.crd.default_object`),
then :func:`gpudra_operator.render.render`, the same pure function the operator runs. What only a
live API server can judge is not checked here: the CRD's CEL rules (``x-kubernetes-validations``)
and the rendered DeviceClasses' CEL (the operator validates it with a server-side dry run; use
``gpudra render -f cfg.yaml | kubectl apply --dry-run=server -f -`` for that). The output has no
ownerReferences (a file has no UID); everything else is byte-for-byte what the operator applies.

Exit status: 0 with the objects on stdout; 1 with one line per problem on stderr (naming the file,
document, field or DeviceClass template) and nothing on stdout; 2 for usage errors.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from .crd import GROUP, VERSION

KIND = "GpuDraConfig"
API_VERSION = f"{GROUP}/{VERSION}"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "render", help="print the objects the operator would create for a GpuDraConfig file (no cluster)",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("-f", "--filename", required=True,
                        help="a YAML/JSON file with one or more GpuDraConfig documents ('-' reads stdin)")
    parser.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml",
                        help="yaml: a multi-document stream; json: a v1 List (default: %(default)s)")
    parser.add_argument("--agent-image", default=None,
                        help="the agent image where spec.agent.image is unset, as the installed operator "
                             "would use it (default: $GPUDRA_AGENT_IMAGE, else this release's image)")
    parser.set_defaults(run=run)


# --- the CRD's structural schema, checked the way the API server checks it -------------------
_TYPES: dict[str, tuple[type, ...]] = {"object": (dict,), "array": (list,), "string": (str,),
                                       "integer": (int,), "number": (int, float), "boolean": (bool,)}


_MATCHES_RULE = re.compile(r"self\.matches\('([^'\\]*)'\)")


def schema_errors(schema: Mapping[str, Any], value: Any, path: str = "") -> list[str]:
    """Problems of ``value`` against an OpenAPI v3 structural schema, each as ``path: message``.
    Covers what the API server enforces before CEL: type, int-or-string, nullable, enum,
    required, string/list/map bounds, pattern, numeric bounds and unknown fields (which kubectl's
    default strict field validation rejects). Of the CEL rules only ``self.matches('<re>')`` runs
    here (names and namespaces); the rest are the API server's."""
    here = path or "<root>"
    if value is None:
        return [] if schema.get("nullable") else [f"{here}: must not be null"]
    if schema.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            return [f"{here}: must be an integer or a string, got {type(value).__name__}"]
    elif "type" in schema:
        allowed = _TYPES.get(schema["type"], (object,))
        if not isinstance(value, allowed) or (schema["type"] in ("integer", "number") and isinstance(value, bool)):
            return [f"{here}: must be {schema['type']}, got {type(value).__name__} {json.dumps(value)[:60]}"]
    errors: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{here}: must be one of {', '.join(map(json.dumps, schema['enum']))}, got {json.dumps(value)}")
    if isinstance(value, str):
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{here}: at most {schema['maxLength']} characters, got {len(value)}")
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(f"{here}: at least {schema['minLength']} characters, got {len(value)}")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{here}: must match {schema['pattern']}, got {json.dumps(value)}")
        for rule in schema.get("x-kubernetes-validations") or []:  # the one CEL form Python can run exactly
            match = _MATCHES_RULE.fullmatch(rule.get("rule", ""))
            if match and not re.search(match.group(1), value):
                errors.append(f"{here}: {rule.get('message') or 'must match ' + match.group(1)}, got {json.dumps(value)}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{here}: must be >= {schema['minimum']}, got {value}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{here}: must be <= {schema['maximum']}, got {value}")
    if isinstance(value, list):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{here}: at most {schema['maxItems']} items, got {len(value)}")
        if "minItems" in schema and len(value) < schema["minItems"]:
            errors.append(f"{here}: at least {schema['minItems']} items, got {len(value)}")
        if isinstance(schema.get("items"), Mapping):
            for i, item in enumerate(value):
                errors += schema_errors(schema["items"], item, f"{path}[{i}]")
    if isinstance(value, dict):
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:
            errors.append(f"{here}: at most {schema['maxProperties']} entries, got {len(value)}")
        for key in schema.get("required") or []:
            if key not in value:
                errors.append(f"{_join(path, key)}: required")
        props: Mapping[str, Any] = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub_path = _join(path, key)
            if key in props:
                errors += schema_errors(props[key], item, sub_path)
            elif isinstance(extra, Mapping):
                errors += schema_errors(extra, item, sub_path)
            elif props and not schema.get("x-kubernetes-preserve-unknown-fields") and path != "metadata":
                errors.append(f"{sub_path}: unknown field")
    return errors


def _join(path: str, key: str) -> str:
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        return f"{path}.{key}" if path else key
    return f"{path}[{json.dumps(key)}]"


# --- rendering ------------------------------------------------------------------------------
def _class_label(spec: Mapping[str, Any], class_name: str) -> str:
    for i, entry in enumerate(spec.get("deviceClasses") or []):
        if isinstance(entry, Mapping) and entry.get("name") == class_name:
            source = f"template {entry['template']!r}" if entry.get("template") else "inline template"
            return f"spec.deviceClasses[{i}] (DeviceClass {class_name!r}, {source})"
    return f"DeviceClass {class_name!r}"


def render_documents(documents: Sequence[Any], agent_image: str | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """The objects for every GpuDraConfig in ``documents``, and every problem found (each
    prefixed with the document's position and name). Pure; ``agent_image`` None is this release's."""
    from .crd import default_object, openapi_schema
    from .render import DEFAULT_AGENT_IMAGE, render

    agent_image = agent_image or DEFAULT_AGENT_IMAGE
    from .spec import SpecError

    objects: list[dict[str, Any]] = []
    errors: list[str] = []
    for index, doc in enumerate(documents, start=1):
        if doc is None:
            continue
        where = f"document {index}"
        if not isinstance(doc, Mapping):
            errors.append(f"{where}: not an object")
            continue
        if doc.get("kind") != KIND or doc.get("apiVersion") != API_VERSION:
            errors.append(f"{where}: apiVersion/kind must be {API_VERSION} {KIND}, "
                          f"got {doc.get('apiVersion')} {doc.get('kind')}")
            continue
        name = (doc.get("metadata") or {}).get("name") if isinstance(doc.get("metadata"), Mapping) else None
        where = f"{where} (GpuDraConfig {name!r})" if name else where
        if not name:
            errors.append(f"{where}: metadata.name: required")
            continue
        problems = schema_errors(openapi_schema(), dict(doc))
        if problems:
            errors += [f"{where}: {p}" for p in problems]
            continue
        body = default_object(doc)
        body.setdefault("metadata", {}).setdefault("generation", 1)
        try:
            rendered = render(body, agent_image=agent_image)
        except SpecError as error:
            errors.append(f"{where}: {error}")
            continue
        for failure in rendered.errors:
            errors.append(f"{where}: {_class_label(body['spec'], failure.class_name)}: {failure.message}")
        objects += rendered.objects
    return objects, errors


def _load(filename: str) -> list[Any]:
    import yaml

    if filename == "-":
        text = sys.stdin.read()
    else:
        with open(filename, encoding="utf-8") as handle:
            text = handle.read()
    return list(yaml.safe_load_all(text))


def write(objects: Sequence[Mapping[str, Any]], output: str, stream: TextIO) -> None:
    if output == "json":
        json.dump({"apiVersion": "v1", "kind": "List", "items": list(objects)}, stream, indent=2)
        stream.write("\n")
        return
    import yaml

    stream.write(yaml.safe_dump_all(list(objects), sort_keys=False, default_flow_style=False,
                                    explicit_start=True, width=120))


def run(args: argparse.Namespace) -> int:
    import yaml

    try:
        documents = _load(args.filename)
    except OSError as error:
        print(f"gpudra render: {args.filename}: {error.strerror or error}", file=sys.stderr)
        return 1
    except yaml.YAMLError as error:
        print(f"gpudra render: {args.filename}: not valid YAML: {error}".replace("\n", " "), file=sys.stderr)
        return 1
    from .render import configured_agent_image

    objects, errors = render_documents(documents, args.agent_image or configured_agent_image())
    if not errors and not objects:
        errors = ["no GpuDraConfig in the file"]
    if errors:
        for problem in errors:
            print(f"gpudra render: {args.filename}: {problem}", file=sys.stderr)
        return 1
    write(objects, args.output, sys.stdout)
    return 0
