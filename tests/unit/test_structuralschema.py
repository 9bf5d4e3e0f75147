"""The structural-schema check `gpudra render` runs: jsonschema's keywords with Kubernetes'
meaning added, one line per problem (field path and reason), in document order."""

from __future__ import annotations

from typing import Any

import pytest

from gpudra_operator.crd import openapi_schema
from gpudra_operator.structuralschema import schema_errors

OBJECT: dict[str, Any] = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 5, "pattern": "^[a-z]+$"},
        "count": {"type": "integer", "minimum": 1, "maximum": 3},
        "ratio": {"type": "number", "minimum": 0, "exclusiveMinimum": True},
        "policy": {"type": "string", "enum": ["Always", "Never"]},
        "maybe": {"type": "string", "nullable": True},
        "port": {"x-kubernetes-int-or-string": True},
        "labels": {"type": "object", "maxProperties": 2, "additionalProperties": {"type": "string"}},
        "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                 "properties": {"known": {"type": "boolean"}}},
        "args": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "string"}},
        "tags": {"type": "array", "x-kubernetes-list-type": "set", "items": {"type": "string"}},
        "env": {"type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
                "items": {"type": "object", "required": ["name"],
                          "properties": {"name": {"type": "string"}, "value": {"type": "string"}}}},
        "driver": {"type": "string", "x-kubernetes-validations": [
            {"rule": "self.matches('^[a-z.]+$')", "message": "driver must be a DNS subdomain"},
            {"rule": "self == oldSelf", "message": "immutable"}]},
        "bare": {"type": "string", "x-kubernetes-validations": [{"rule": "self.matches('^b')"}]},
        "a.b/c": {"type": "string"},
    },
}


@pytest.mark.parametrize(("value", "expected"), [
    ({"name": "ok", "count": 2, "ratio": 0.5, "policy": "Never", "maybe": None, "port": "http",
      "labels": {"a": "b"}, "free": {"known": True, "anything": {"goes": 1}}, "args": ["x"], "tags": ["a", "b"],
      "env": [{"name": "A"}, {"name": "B", "value": "1"}], "driver": "gpu.io", "bare": "bx", "a.b/c": "y"}, []),
    ({}, ["name: required"]),
    (None, ["<root>: must not be null"]),
    ([], ["<root>: must be object, got list []"]),
    ({"name": 5}, ["name: must be string, got int 5"]),
    ({"name": True, "count": True}, ["name: must be string, got bool true", "count: must be integer, got bool true"]),
    ({"name": "ok", "count": 1.0}, ["count: must be integer, got float 1.0"]),
    ({"name": None}, ["name: must not be null"]),
    ({"name": ""}, ["name: at least 1 characters, got 0", 'name: must match ^[a-z]+$, got ""']),
    ({"name": "abcdef"}, ["name: at most 5 characters, got 6"]),
    ({"name": "A"}, ['name: must match ^[a-z]+$, got "A"']),
    ({"name": "a", "count": 0}, ["count: must be >= 1, got 0"]),
    ({"name": "a", "count": 4}, ["count: must be <= 3, got 4"]),
    ({"name": "a", "ratio": 0}, ["ratio: must be > 0, got 0"]),
    ({"name": "a", "policy": "Sometimes"}, ['policy: must be one of "Always", "Never", got "Sometimes"']),
    ({"name": "a", "port": 80}, []),
    ({"name": "a", "port": 1.5}, ["port: must be an integer or a string, got float"]),
    ({"name": "a", "port": False}, ["port: must be an integer or a string, got bool"]),
    ({"name": "a", "labels": {"a": "b", "c": "d", "e": "f"}}, ["labels: at most 2 entries, got 3"]),
    ({"name": "a", "labels": {"a": 1}}, ["labels.a: must be string, got int 1"]),
    ({"name": "a", "free": {"known": "yes"}}, ['free.known: must be boolean, got str "yes"']),
    ({"name": "a", "args": []}, ["args: at least 1 items, got 0"]),
    ({"name": "a", "args": ["x", "y", "z"]}, ["args: at most 2 items, got 3"]),
    ({"name": "a", "args": ["x", 7]}, ["args[1]: must be string, got int 7"]),
    ({"name": "a", "tags": ["a", "a"]}, ["tags[1]: duplicate entry: value is already at [0]"]),
    ({"name": "a", "env": [{"name": "A"}, {"name": "A", "value": "2"}]},
     ['env[1]: duplicate entry: name "A" is already at [0]']),
    ({"name": "a", "env": [{"value": "1"}]}, ["env[0].name: required"]),
    ({"name": "a", "driver": "Not_DNS"}, ['driver: driver must be a DNS subdomain, got "Not_DNS"']),
    ({"name": "a", "bare": "x"}, ['bare: must match ^b, got "x"']),  # no message: the rule's own
    ({"name": "a", "a.b/c": 1}, ['["a.b/c"]: must be string, got int 1']),
    ({"name": "a", "nmae": "b", "x.y": 1}, ["nmae: unknown field", '["x.y"]: unknown field']),
])
def test_each_keyword_as_kubernetes_means_it(value: Any, expected: list[str]) -> None:
    assert schema_errors(OBJECT, value) == expected


def test_problems_come_in_document_order() -> None:
    value = {"policy": "Sometimes", "zz": 1, "args": [1, "x", 2], "count": 9}
    assert schema_errors(OBJECT, value) == [
        'policy: must be one of "Always", "Never", got "Sometimes"',
        "zz: unknown field",
        "args: at most 2 items, got 3",  # the list before its items
        "args[0]: must be string, got int 1",
        "args[2]: must be string, got int 2",
        "count: must be <= 3, got 9",
        "name: required",  # missing: after what is there
    ]


def test_values_yaml_reads_as_non_json_types_are_described_not_crashed_on() -> None:
    import datetime

    assert schema_errors(OBJECT, {"name": datetime.date(2026, 1, 2)}) == [
        'name: must be string, got date "2026-01-02"']


def test_the_crd_schema_leaves_the_root_metadata_to_the_api_server() -> None:
    config = {"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig",
              "metadata": {"name": "a", "labels": {"x": "y"}, "annotations": {"k": "v"}}, "spec": {}}
    assert schema_errors(openapi_schema(), config) == []
    config["spec"] = {"deviceClasses": [{"name": "a.gpudra.io", "template": "all"},
                                        {"name": "a.gpudra.io", "template": "mig"}],
                      "agent": {"extraEnv": [{"name": "NODE_NAME", "value": "x"}, {"name": "X", "valeu": "y"}]}}
    assert schema_errors(openapi_schema(), config) == [
        'spec.deviceClasses[1]: duplicate entry: name "a.gpudra.io" is already at [0]',
        "spec.agent.extraEnv[1].valeu: unknown field",
    ]  # the NODE_NAME rule is CEL only the API server runs
