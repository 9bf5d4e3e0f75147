"""`gpudra render`: print every object the operator would create for a GpuDraConfig file, with no
cluster, so GitOps repositories can review and diff them in CI.

The file goes through what the API server would do first: the CRD's structural schema (types,
enums, patterns, bounds, unknown fields: :mod:`gpudra_operator.structuralschema`) and its
``default:`` values (:func:`gpudra_operator.crd.default_object`), then
:func:`gpudra_operator.render.render`, the same pure function the operator runs. What only a
live API server can judge is not checked here: the CRD's CEL rules (``x-kubernetes-validations``;
use ``gpudra render -f cfg.yaml | kubectl apply --dry-run=server -f -`` for those). The rendered
DeviceClasses' selectors are compiled by Kubernetes' own DRA CEL of each supported release (or of
``--kubernetes-version``), through gpudra-allocator, as the API server compiles them when it stores
a DeviceClass: syntax, types, the fields the release knows, the cost limit. The output has no
ownerReferences (a file has no UID); everything else is byte-for-byte what the operator applies.

Exit status: 0 with the objects on stdout; 1 with one line per problem on stderr (naming the file,
document, field or DeviceClass template) and nothing on stdout; 2 for usage errors.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from gpudra_operator.crd import GROUP, VERSION

KIND = "GpuDraConfig"
API_VERSION = f"{GROUP}/{VERSION}"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "render", help="print the objects the operator would create for a GpuDraConfig file (no cluster)",
        description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("-f", "--filename", required=True,
                        help="a YAML/JSON file with one or more GpuDraConfig documents ('-' reads stdin)")
    parser.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml",
                        help="yaml: a multi-document stream; json: a v1 List (default: %(default)s)")
    parser.add_argument("--agent-image", default=None,
                        help="the agent image where spec.agent.image is unset, as the installed operator "
                             "would use it (default: $GPUDRA_AGENT_IMAGE, else this release's image)")
    parser.add_argument("--kubernetes-version", default=None, metavar="1.MINOR",
                        help="compile the selectors as this Kubernetes release does (default: every release "
                             "gpudra supports, so a class works on any of them)")
    parser.set_defaults(run=run)


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
    from gpudra_operator.crd import default_object, openapi_schema
    from gpudra_operator.render import DEFAULT_AGENT_IMAGE, render
    from gpudra_operator.structuralschema import schema_errors

    agent_image = agent_image or DEFAULT_AGENT_IMAGE
    from gpudra_operator.spec import SpecError

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


def selector_errors(objects: Sequence[Mapping[str, Any]], minors: Sequence[int]) -> list[str]:
    """What the API server of each release in ``minors`` would say of the rendered DeviceClasses'
    selectors (compile errors, cost past the limit), one line each."""
    import asyncio

    from gpudra_operator.allocatorhelper import AllocatorHelper

    selectors = [(obj["metadata"]["name"], index, str(((entry or {}).get("cel") or {}).get("expression", "")))
                 for obj in objects if obj.get("kind") == "DeviceClass"
                 for index, entry in enumerate((obj.get("spec") or {}).get("selectors") or [])]

    async def compile_all() -> list[str]:
        problems: list[str] = []
        for minor in minors:
            async with AllocatorHelper(minor) as helper:
                results, limit = await helper.compile([e for _, _, e in selectors])
            for (name, index, _), result in zip(selectors, results):
                where = f"DeviceClass {name!r}: spec.selectors[{index}].cel.expression (Kubernetes 1.{minor})"
                if result.error:
                    problems.append(f"{where}: {' '.join(result.error.split())}")
                elif result.max_cost > limit:
                    problems.append(f"{where}: too complex, its estimated cost {result.max_cost} exceeds the limit {limit}")
        return problems

    return asyncio.run(compile_all()) if selectors else []


def _minors(version: str | None) -> list[int]:
    from gpudra_operator.allocatorhelper import available_minors

    if version is None:
        return available_minors()
    major, _, minor = version.removeprefix("v").partition(".")
    if major != "1" or not minor.split(".")[0].isdigit():
        raise ValueError(f"--kubernetes-version {version!r}: expected 1.MINOR")
    return [int(minor.split(".")[0])]


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
    from gpudra_operator.allocatorhelper import AllocatorError, AllocatorUnavailable
    from gpudra_operator.render import configured_agent_image

    objects, errors = render_documents(documents, args.agent_image or configured_agent_image())
    if not errors and not objects:
        errors = ["no GpuDraConfig in the file"]
    if not errors:
        try:
            errors = selector_errors(objects, _minors(args.kubernetes_version))
        except AllocatorUnavailable as error:
            # A platform without the helper still renders; the operator's dry run judges the CEL.
            print(f"gpudra render: warning: the selectors' CEL is not checked: {error}", file=sys.stderr)
        except (ValueError, AllocatorError) as error:
            errors = [f"checking the selectors' CEL: {error}"]
    if errors:
        for problem in errors:
            print(f"gpudra render: {args.filename}: {problem}", file=sys.stderr)
        return 1
    write(objects, args.output, sys.stdout)
    return 0
