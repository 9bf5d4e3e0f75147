"""The typed view of a GpuDraConfig: its defaults are the CRD's (so they cannot drift), every
spec field the CRD declares is read, durations become seconds, and wrong shapes name the field."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from gpudra_operator import crd
from gpudra_operator.spec import (AgentSpec, ConsumableCapacitySpec, DeviceClassSpec, EnvVar, GcSpec,
                                  GpuDraConfig, GpuDraConfigSpec, SharingSpec, SpecError, UpdateStrategy,
                                  parse_duration)


def body(spec: Any = None, **meta: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig",
                           "metadata": {"name": "default", **meta}}
    if spec is not None:
        obj["spec"] = spec
    return obj


# One entry in each list, so item-level defaults (extraEnv[].value) are exercised too.
LISTS = {"agent": {"extraEnv": [{"name": "X"}]},
         "deviceClasses": [{"name": "a.gpudra.io", "template": "all"}]}
# An empty consumableCapacity: present turns it on, with the defaults of its fields.
SHARING = {"sharing": {"consumableCapacity": {}}}


@pytest.mark.parametrize("spec", [None, {}, LISTS, SHARING], ids=["no-spec", "empty", "with-lists", "sharing"])
def test_dataclass_defaults_equal_the_crd_defaults(spec: Any) -> None:
    undefaulted = GpuDraConfigSpec.from_body(body(spec))
    by_apiserver = GpuDraConfigSpec.from_body(crd.default_object(body(spec)))
    assert undefaulted == by_apiserver


def test_crd_defaults_are_the_documented_ones() -> None:
    spec = GpuDraConfigSpec.from_body(crd.default_object(body()))
    assert spec.driver_name == "gpu.gpudra.io"
    # no image default is frozen into the CRD: the API server would persist it, and an overlay's
    # `images:` or an operator upgrade would never reach the agents (the operator fills it in)
    assert spec.agent == AgentSpec(image="", image_pull_policy="IfNotPresent",
                                   namespace="gpudra-system", priority_class_name="system-node-critical",
                                   update_strategy=UpdateStrategy(max_unavailable=0, max_surge=1),
                                   kubelet_dir="/var/lib/kubelet", cdi_dir="/var/run/cdi", driver_root="/")
    assert spec.resource_slice_gc == GcSpec(enabled=True, interval=60.0, grace_period=300.0, dry_run=False)
    assert spec.sharing == SharingSpec(consumable_capacity=None)  # off unless asked for
    assert spec == GpuDraConfigSpec()
    shared = GpuDraConfigSpec.from_body(crd.default_object(body(SHARING)))
    assert shared.sharing.consumable_capacity == ConsumableCapacitySpec(memory_step="1Gi", shares=0)
    assert shared.sharing.consumable_capacity.memory_step_bytes == 2**30


@pytest.mark.parametrize("value, message", [
    ({"memoryStep": "0"}, "spec.sharing.consumableCapacity.memoryStep: '0' is not a positive whole number"),
    ({"memoryStep": "0.5"}, "is not a positive whole number of bytes"),
    ({"memoryStep": "lots"}, "is not a Kubernetes quantity"),
    ({"memoryStep": 1024}, "spec.sharing.consumableCapacity.memoryStep: must be a string"),
    ({"shares": 1001}, "spec.sharing.consumableCapacity.shares: must be 0..1000"),
    ({"shares": "4"}, "spec.sharing.consumableCapacity.shares: must be an integer"),
])
def test_consumable_capacity_values_the_agent_would_refuse_name_the_field(value: Any, message: str) -> None:
    with pytest.raises(SpecError, match=re.escape(message)):
        GpuDraConfigSpec.from_body(body({"sharing": {"consumableCapacity": value}}))


def _camel_to_snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower().replace("resource_slice_g_c", "resource_slice_gc")


@pytest.mark.parametrize("schema_path, cls", [
    (("spec",), GpuDraConfigSpec),
    (("spec", "agent"), AgentSpec),
    (("spec", "agent", "updateStrategy"), UpdateStrategy),
    (("spec", "deviceClasses", "items"), DeviceClassSpec),
    (("spec", "resourceSliceGC"), GcSpec),
    (("spec", "agent", "extraEnv", "items"), EnvVar),
    (("spec", "sharing"), SharingSpec),
    (("spec", "sharing", "consumableCapacity"), ConsumableCapacitySpec),
])
def test_every_crd_field_has_a_dataclass_field(schema_path: tuple[str, ...], cls: type) -> None:
    node = crd.openapi_schema()
    for key in schema_path:
        node = node["items"] if key == "items" else node["properties"][key]
    schema_fields = {_camel_to_snake(k) for k in node["properties"]}
    class_fields = {f.name for f in dataclasses.fields(cls)}
    assert schema_fields == class_fields


def test_full_spec_is_read() -> None:
    spec = GpuDraConfigSpec.from_body(body({
        "driverName": "gpu.example.com",
        "agent": {
            "image": "img:1", "imagePullPolicy": "Always", "namespace": "gpus",
            "nodeSelector": {"gpu": "true"}, "affinity": {"nodeAffinity": {"x": 1}},
            "tolerations": [{"key": "k", "operator": "Exists"}],
            "resources": {"requests": {"cpu": "50m"}, "limits": {"memory": "1Gi"}},
            "priorityClassName": "", "updateStrategy": {"maxUnavailable": "10%", "maxSurge": 0},
            "kubeletDir": "/k", "cdiDir": "/c", "driverRoot": "/run/nvidia/driver",
            "extraArgs": ["-v", "4"], "extraEnv": [{"name": "A", "value": "1"}, {"name": "B"}],
        },
        "deviceClasses": [{"name": "a", "template": "mig", "parameters": {"profile": "1g.10gb"}},
                          {"name": "b", "inline": "x"}],
        "resourceSliceGC": {"enabled": False, "interval": "1m30s", "gracePeriod": "1h", "dryRun": True},
    }))
    assert spec.driver_name == "gpu.example.com"
    a = spec.agent
    assert (a.image, a.image_pull_policy, a.namespace) == ("img:1", "Always", "gpus")
    assert a.node_selector == {"gpu": "true"} and a.affinity == {"nodeAffinity": {"x": 1}}
    assert a.tolerations == ({"key": "k", "operator": "Exists"},)
    assert a.resources == {"requests": {"cpu": "50m"}, "limits": {"memory": "1Gi"}}
    assert a.priority_class_name == ""
    assert a.update_strategy == UpdateStrategy(max_unavailable="10%", max_surge=0)
    assert (a.kubelet_dir, a.cdi_dir, a.driver_root) == ("/k", "/c", "/run/nvidia/driver")
    assert a.extra_args == ("-v", "4")
    assert a.extra_env == (EnvVar("A", "1"), EnvVar("B", ""))
    assert spec.device_classes == (DeviceClassSpec("a", "mig", {"profile": "1g.10gb"}),
                                   DeviceClassSpec("b", inline="x"))
    assert spec.resource_slice_gc == GcSpec(enabled=False, interval=90.0, grace_period=3600.0, dry_run=True)


def test_the_view_is_immutable() -> None:
    source = {"agent": {"nodeSelector": {"a": "b"}, "tolerations": [{"key": "k"}]},
              "deviceClasses": [{"name": "a", "template": "all", "parameters": {}}]}
    spec = GpuDraConfigSpec.from_body(body(source))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.driver_name = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.agent.node_selector["a"] = "c"  # type: ignore[index]
    with pytest.raises(TypeError):
        spec.agent.tolerations[0]["key"] = "other"  # type: ignore[index]
    source["agent"]["nodeSelector"]["a"] = "changed"
    assert spec.agent.node_selector == {"a": "b"}


def test_identity_from_metadata() -> None:
    config = GpuDraConfig.from_body(body({}, uid="u-1", generation=3, labels={"x": "y"}))
    assert (config.name, config.uid, config.generation) == ("default", "u-1", 3)
    assert config.spec == GpuDraConfigSpec()
    assert GpuDraConfig.from_body(body({})).uid is None
    with pytest.raises(SpecError, match="metadata.name"):
        GpuDraConfig.from_body({"spec": {}})


@pytest.mark.parametrize("text, seconds", [("60s", 60), ("5m", 300), ("1h30m", 5400), ("1.5h", 5400),
                                           ("500ms", 0.5), ("0", 0), ("2h0m0s", 7200), ("10us", 1e-5)])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "60", "s", "1d", "5 m", "m5", "1h-5m", "."])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


@pytest.mark.parametrize("spec, path", [
    ({"driverName": 5}, "spec.driverName"),
    ({"agent": []}, "spec.agent"),
    ({"agent": {"nodeSelector": {"a": 1}}}, "spec.agent.nodeSelector.a"),
    ({"agent": {"updateStrategy": {"maxSurge": True}}}, "spec.agent.updateStrategy.maxSurge"),
    ({"agent": {"extraEnv": [{"name": "A", "value": 1}]}}, "spec.agent.extraEnv[0].value"),
    ({"deviceClasses": {"name": "a"}}, "spec.deviceClasses"),
    ({"deviceClasses": [{"name": "a", "parameters": {"memory": 64}}]}, "spec.deviceClasses[0].parameters.memory"),
    ({"resourceSliceGC": {"interval": "soon"}}, "spec.resourceSliceGC.interval"),
    ({"resourceSliceGC": {"enabled": "yes"}}, "spec.resourceSliceGC.enabled"),
])
def test_wrong_shapes_name_the_field(spec: dict[str, Any], path: str) -> None:
    with pytest.raises(SpecError) as info:
        GpuDraConfigSpec.from_body(body(spec))
    assert info.value.path == path
