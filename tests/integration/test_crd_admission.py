"""GpuDraConfig admission through the real apiserver: the CRD's schema and CEL rules reject
malformed specs with a message that says what to fix, accept the samples, and default exactly as
gpudra_operator.crd.apply_defaults (and so gpudra_operator.spec) assume.

Every create is a server-side dry run: admission runs in full, nothing is stored."""

from __future__ import annotations

import copy
import secrets
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_asyncio.client.exceptions import ApiException

from gpudra_core.kubeapi import Kube, Obj, error_message, resource_type
from gpudra_operator import crd

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
SAMPLES = sorted((REPO / "manifests" / "samples").glob("gpudraconfig*.yaml"))


def config(spec: dict[str, Any], name: str | None = None) -> Obj:
    return {"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig",
            "metadata": {"name": name or f"bad-{secrets.token_hex(4)}"}, "spec": spec}


def with_class(**fields: Any) -> dict[str, Any]:
    return {"deviceClasses": [{"name": "c.gpudra.io", **fields}]}


def agent(**fields: Any) -> dict[str, Any]:
    return {"agent": fields}


def gc(**fields: Any) -> dict[str, Any]:
    return {"resourceSliceGC": fields}


def sharing(**fields: Any) -> dict[str, Any]:
    return {"sharing": {"consumableCapacity": fields}}


CONFIG = resource_type("gpudra.io/v1alpha1", "GpuDraConfig")

BAD: list[tuple[str, dict[str, Any], str]] = [
    ("driver-not-dns", {"driverName": "GPU_Driver"}, "driverName must be a DNS subdomain"),
    ("driver-empty-label", {"driverName": "gpu..gpudra.io"}, "driverName must be a DNS subdomain"),
    ("driver-too-long", {"driverName": "g" * 61 + ".io"}, "Too long"),
    ("class-name-not-dns", with_class(name="Bad_Name", template="all"),
     "deviceClasses[].name must be a DNS subdomain"),
    ("class-names-duplicate", {"deviceClasses": [{"name": "a.gpudra.io", "template": "all"},
                                                 {"name": "a.gpudra.io", "template": "mig"}]},
     "Duplicate value"),
    ("template-and-inline", with_class(template="all", inline="x"), "exactly one of template"),
    ("neither-template-nor-inline", with_class(), "exactly one of template"),
    ("unknown-template", with_class(template="bogus"), 'Unsupported value: "bogus"'),
    ("min-memory-without-memory", with_class(template="min-memory"), "template min-memory needs parameter memory"),
    ("min-memory-empty-parameters", with_class(template="min-memory", parameters={}),
     "template min-memory needs parameter memory"),
    ("product-without-name", with_class(template="product"), "template product needs parameter productName"),
    ("compute-capability-without-version", with_class(template="min-compute-capability"),
     "needs parameter version"),
    ("architecture-without-architecture", with_class(template="architecture", parameters={"arch": "x"}),
     "template architecture needs parameter architecture"),
    ("parameter-not-a-string", with_class(template="min-memory", parameters={"memory": 64}),
     "must be of type string"),
    ("extended-resource-not-a-name", with_class(template="all", extendedResourceName="nvidia.com/gpu/x"),
     "extendedResourceName must be an extended resource name such as nvidia.com/gpu"),
    ("extended-resource-kubernetes-io", with_class(template="all", extendedResourceName="kubernetes.io/gpu"),
     "not in kubernetes.io/"),
    ("extended-resource-twice", {"deviceClasses": [
        {"name": "a.gpudra.io", "template": "all", "extendedResourceName": "nvidia.com/gpu"},
        {"name": "b.gpudra.io", "template": "full-gpu", "extendedResourceName": "nvidia.com/gpu"}]},
     "two deviceClasses name the same extendedResourceName"),
    ("gc-interval-too-short", gc(interval="5s"), "interval must be a duration between 10s and 24h"),
    ("gc-interval-not-a-duration", gc(interval="soon"), "should match"),
    ("gc-grace-too-short", gc(gracePeriod="10s"), "gracePeriod must be a duration between 30s and 168h"),
    ("agent-namespace-not-dns-label", agent(namespace="gpu.system"), "agent.namespace must be a DNS label"),
    ("kubelet-dir-relative", agent(kubeletDir="var/lib/kubelet"), "kubeletDir must be an absolute path"),
    ("cdi-dir-dotdot", agent(cdiDir="/var/run/../cdi"), "cdiDir must be an absolute path without '..'"),
    ("driver-root-dotdot", agent(driverRoot="/run/nvidia/.."), "driverRoot must be an absolute path"),
    ("update-both-zero", agent(updateStrategy={"maxUnavailable": 0, "maxSurge": 0}),
     "exactly one of updateStrategy.maxUnavailable and updateStrategy.maxSurge must be non-zero"),
    ("update-both-nonzero", agent(updateStrategy={"maxUnavailable": 1}),
     "exactly one of updateStrategy.maxUnavailable and updateStrategy.maxSurge must be non-zero"),
    ("update-percent-over-100", agent(updateStrategy={"maxUnavailable": "150%", "maxSurge": 0}), "should match"),
    ("pull-policy", agent(imagePullPolicy="Sometimes"), 'Unsupported value: "Sometimes"'),
    ("toleration-exists-with-value", agent(tolerations=[{"key": "k", "operator": "Exists", "value": "v"}]),
     "a toleration with operator Exists must not have a value"),
    ("extra-env-reserved", agent(extraEnv=[{"name": "NODE_NAME", "value": "x"}]), "must not set NODE_NAME"),
    ("extra-env-duplicate", agent(extraEnv=[{"name": "A"}, {"name": "A"}]), "Duplicate value"),
    ("sharing-step-zero", sharing(memoryStep="0"),
     "sharing.consumableCapacity.memoryStep must be a positive whole number of bytes, such as 1Gi or 512Mi"),
    ("sharing-step-fraction", sharing(memoryStep="0.5"), "memoryStep must be a positive whole number of bytes"),
    ("sharing-step-millis", sharing(memoryStep="1500m"), "memoryStep must be a positive whole number of bytes"),
    ("sharing-step-not-a-quantity", sharing(memoryStep="1 Gi"), "should match"),
    ("sharing-step-negative", sharing(memoryStep="-1Gi"), "should match"),
    ("sharing-shares-too-many", sharing(shares=1001), "should be less than or equal to 1000"),
    ("sharing-shares-negative", sharing(shares=-1), "should be greater than or equal to 0"),
    ("mps-shm-below-1mi", {"sharing": {"mps": {"shmSize": "512Ki"}}},
     "sharing.mps.shmSize must be a whole number of bytes of at least 1Mi, such as 64Mi or 1Gi"),
    ("mps-shm-fraction", {"sharing": {"mps": {"shmSize": "1500001m"}}}, "sharing.mps.shmSize must be a whole number"),
    ("mps-shm-not-a-quantity", {"sharing": {"mps": {"shmSize": "64 Mi"}}}, "should match"),
    ("mps-shm-above-its-bound", {"sharing": {"mps": {"shmSize": "2Gi"}}},  # maxShmSize: 1Gi by default
     "sharing.mps.shmSize must be at most sharing.mps.maxShmSize"),
    ("mps-max-shm-below-1mi", {"sharing": {"mps": {"shmSize": "1Mi", "maxShmSize": "1Ki"}}},
     "sharing.mps.maxShmSize must be a whole number of bytes of at least 1Mi"),
    ("mig-mode-unknown", {"mig": {"mode": "auto"}}, 'Unsupported value: "auto"'),
    ("mig-group-duplicate", {"mig": {"nodeGroups": [
        {"name": "a", "mode": "dynamic", "nodeSelector": {"k": "v"}},
        {"name": "a", "mode": "whole", "nodeSelector": {"k": "w"}}]}}, "Duplicate value"),
    ("mig-group-no-selector", {"mig": {"nodeGroups": [{"name": "a", "mode": "dynamic", "nodeSelector": {}}]}},
     "should have at least 1 properties"),
    ("mig-group-bad-key", {"mig": {"nodeGroups": [{"name": "a", "mode": "dynamic", "nodeSelector": {"a b": "v"}}]}},
     "nodeSelector keys must be label keys"),
    ("mig-group-bad-value", {"mig": {"nodeGroups": [{"name": "a", "mode": "dynamic", "nodeSelector": {"k": "v w"}}]}},
     "should match"),
    ("mig-group-bad-name", {"mig": {"nodeGroups": [{"name": "A", "mode": "dynamic", "nodeSelector": {"k": "v"}}]}},
     "should match"),
]


@pytest.mark.parametrize("spec, needle", [(s, n) for _, s, n in BAD], ids=[i for i, _, _ in BAD])
async def test_bad_spec_is_rejected_with_a_useful_message(crd_installed: Obj, kube: Kube,
                                                          spec: dict[str, Any], needle: str) -> None:
    with pytest.raises(ApiException) as info:
        await kube.create(config(spec), dry_run=True)
    assert info.value.status == 422, error_message(info.value)
    assert needle in error_message(info.value)


async def test_long_config_name_is_rejected(crd_installed: Obj, kube: Kube) -> None:
    with pytest.raises(ApiException) as info:
        await kube.create(config({}, name="x" * 64), dry_run=True)
    assert "metadata.name must be at most 63 characters" in error_message(info.value)


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
async def test_samples_are_admitted(crd_installed: Obj, kube: Kube, sample: Path) -> None:
    obj = yaml.safe_load(sample.read_text())
    created = await kube.create(obj, dry_run=True)
    assert created["spec"] == crd.default_object(obj)["spec"]


async def test_server_defaults_equal_the_python_defaulter(crd_installed: Obj, kube: Kube) -> None:
    obj = config({"agent": {"extraEnv": [{"name": "X"}]},
                  "deviceClasses": [{"name": "a.gpudra.io", "template": "all"}]}, name="defaults")
    created = await kube.create(copy.deepcopy(obj), dry_run=True)
    assert created["spec"] == crd.default_object(obj)["spec"]
    empty = await kube.create({**config({}, name="empty")}, dry_run=True)
    assert empty["spec"] == crd.default_object(config({}))["spec"]
    shared = await kube.create(config({"sharing": {"consumableCapacity": {}}}, name="shared"), dry_run=True)
    assert shared["spec"]["sharing"] == {"consumableCapacity": {"memoryStep": "1Gi", "shares": 0}}
    assert shared["spec"] == crd.default_object(config({"sharing": {"consumableCapacity": {}}}))["spec"]
    mps = await kube.create(config({"sharing": {"mps": {}}}, name="mps"), dry_run=True)
    assert mps["spec"]["sharing"] == {"mps": {"shmSize": "64Mi", "maxShmSize": "1Gi"}}  # each MPS claim's /dev/shm


async def test_printer_columns_are_served(crd_installed: Obj) -> None:
    (version,) = crd_installed["spec"]["versions"]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Driver", "Ready", "Agents", "Classes", "Devices", "Unhealthy", "Unmonitored", "Shareable", "Reason", "Age"]


@pytest.mark.parametrize("patch, needle", [
    ({"spec": {"driverName": "other.gpudra.io"}}, "driverName is immutable"),
    ({"spec": {"agent": {"namespace": "elsewhere"}}}, "agent.namespace is immutable"),
])
async def test_driver_name_and_agent_namespace_are_immutable(crd_installed: Obj, kube: Kube,
                                                             patch: dict[str, Any], needle: str) -> None:
    name = f"immutable-{secrets.token_hex(3)}"
    await kube.create({"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig", "metadata": {"name": name},
                       "spec": {"driverName": f"{name}.gpudra.io"}})
    try:
        with pytest.raises(ApiException) as raised:
            await kube.patch(CONFIG, name, patch)
        assert raised.value.status == 422 and needle in error_message(raised.value)
        # Everything else still changes freely.
        await kube.patch(CONFIG, name, {"spec": {"agent": {"image": "example.com/gpudra:2"}}})
    finally:
        await kube.delete(CONFIG, name)
