"""The rendered text must be exactly one ``resource.k8s.io/v1`` DeviceClass of the expected shape:
one YAML document without aliases, only the fields a class may set, its name the spec's, and
selectors whose CEL is within the API's size limits and names only what the agent publishes. Whether
the CEL compiles is Kubernetes' to judge, exactly: the operator's server-side dry run, and `gpudra
render` through gpudra-allocator (the release's own DRA CEL)."""

from __future__ import annotations

from typing import Any

import yaml

from gpudra_core import limits
from gpudra_operator.deviceclasses.celrefs import check_model_references
from gpudra_operator.deviceclasses.errors import TemplateValueError

DEVICE_CLASS_API_VERSION = "resource.k8s.io/v1"
DEVICE_CLASS_KIND = "DeviceClass"

# libyaml's parser where PyYAML has it (its wheels do): the same safe constructors, far faster than
# the pure-Python parser on the reconcile's path.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_one(text: str) -> Any:
    """The one YAML document in ``text``; aliases and any other number of documents are refused."""
    try:
        for event in yaml.parse(text, Loader=_YAML_LOADER):
            if isinstance(event, yaml.AliasEvent):
                raise TemplateValueError("rendered YAML uses an alias; write the document out in full")
        docs = [d for d in yaml.load_all(text, Loader=_YAML_LOADER) if d is not None]
    except yaml.YAMLError as error:
        raise TemplateValueError(f"rendered invalid YAML: {error}") from None
    if len(docs) != 1:
        raise TemplateValueError(f"rendered {len(docs)} YAML documents, expected exactly one DeviceClass")
    return docs[0]


_ALLOWED_TOP = {"apiVersion", "kind", "metadata", "spec"}
_ALLOWED_META = {"name", "labels", "annotations"}


def check_device_class(doc: Any, class_name: str, driver: str) -> dict[str, Any]:
    """``doc`` as the DeviceClass named ``class_name``, or :class:`TemplateValueError` saying what
    is wrong with it."""
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
