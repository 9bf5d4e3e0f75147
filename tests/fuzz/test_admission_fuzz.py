"""The GpuConfig admission policy (manifests/base/claim-config-admission-policy.yaml) on the real
API server against the agent's decoder, over any parameters a tenant can write: the policy
refuses exactly what the decoder refuses, and its message names the decoder's error (field and
reason). Inputs that once made the two disagree are replayed from corpus/admission.json.

Each example is one dry-run create of a claim with the parameters as its only config of ours
(a few milliseconds: the profile's examples fit make test's minute)."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import fuzzcorpus
import pytest
import pytest_asyncio
import yaml
from gpuconfigs import configs
from hypothesis import assume, example, given
from kubernetes_asyncio.client.exceptions import ApiException

from gpuconfig_cases import policy_error
from gpudra_core import limits
from gpudra_driver.gpuconfig import GpuConfigError, decode
from gpudra_core.kubeapi import Kube, Obj, error_message, resource_type
from gpudra_dev.localcluster.objects import create_scratch_namespace, delete_namespace
from gpudra_dev.localcluster.waiting import wait_for

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
POLICY_FILE = REPO / "manifests" / "base" / "claim-config-admission-policy.yaml"
POLICY = resource_type("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy")
BINDING = resource_type("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding")
CONFIG = resource_type("gpudra.io/v1alpha1", "GpuDraConfig")
CRD = resource_type("apiextensions.k8s.io/v1", "CustomResourceDefinition")
AT = "spec.devices.config[0].opaque.parameters"
CORPUS = fuzzcorpus.load("admission")


def claim(namespace: str, driver: str, parameters: Any) -> Obj:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "fuzz", "namespace": namespace},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.gpudra.io"}}],
                                 "config": [{"opaque": {"driver": driver, "parameters": parameters}}]}}}


async def admission(kube: Kube, obj: Obj) -> str | None:
    """None when admitted, else the refusal's message."""
    try:
        await kube.create(obj, dry_run=True)
    except ApiException as error:
        return error_message(error)
    return None


async def install_crd(kube: Kube) -> None:
    """crds/gpudraconfig.yaml applied and Established (as tests/integration/conftest.py does)."""
    crd = yaml.safe_load((REPO / "crds" / "gpudraconfig.yaml").read_text())
    await kube.apply(crd)

    async def established() -> bool:
        live = await kube.get(CRD, crd["metadata"]["name"]) or {}
        return any(c.get("type") == "Established" and c.get("status") == "True"
                   for c in (live.get("status") or {}).get("conditions") or [])

    await wait_for(established, timeout=60, what="the GpuDraConfig CRD to be Established")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def enforced(kube: Kube) -> AsyncIterator[tuple[str, str]]:
    """The shipped policy and binding, and a GpuDraConfig whose driver they check: (driver, namespace)."""
    await install_crd(kube)
    namespace = await create_scratch_namespace(kube)
    policy, binding = yaml.safe_load_all(POLICY_FILE.read_text())
    await kube.apply(policy)
    await kube.apply(binding)
    name = f"fuzz-{secrets.token_hex(3)}"
    driver = f"{name}.gpudra.io"
    await kube.create({"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig", "metadata": {"name": name},
                       "spec": {"driverName": driver, "agent": {"namespace": namespace}}})
    await in_force(kube, driver, namespace)
    try:
        yield driver, namespace
    finally:
        await kube.delete(CONFIG, name)
        await kube.delete(BINDING, policy["metadata"]["name"])
        await kube.delete(POLICY, policy["metadata"]["name"])
        await delete_namespace(kube, namespace)


async def in_force(kube: Kube, driver: str, namespace: str) -> None:
    """Once the policy refuses a config of driver ``driver`` that no decoder accepts."""
    probe = claim(namespace, driver, {"kind": "Nope"})
    await wait_for(lambda: admission(kube, probe), timeout=30, what=f"the policy to check driver {driver}'s configs")


async def check(kube: Kube, driver: str, namespace: str, parameters: Any) -> None:
    try:
        decode(parameters)
        expected = None
    except GpuConfigError as error:
        expected = policy_error(AT, error.field, error.reason)
    got = await admission(kube, claim(namespace, driver, parameters))
    if expected is None:
        assert got is None, f"the decoder accepts, the policy refuses: {got}"
        return
    if got is None:
        # failurePolicy Ignore admits everything while the API server's informer of the policy's
        # params (GpuDraConfigs) restarts, e.g. after another test applied the CRD: ask again once
        # the policy is in force, so that what is judged is the policy, not that documented lapse.
        await in_force(kube, driver, namespace)
        got = await admission(kube, claim(namespace, driver, parameters))
    assert got is not None, f"the decoder refuses ({expected}), the policy admits"
    prefix = f"invalid GpuConfig for driver {driver}: "
    assert prefix in got or "invalid GpuConfig for a driver of gpudra's" in got, got  # the policy's, no other
    listed = got.partition(prefix)[2]
    if listed and " more" not in listed.rpartition("; and ")[2]:  # every error listed: the decoder's is one
        assert f"; {expected}; " in f"; {listed}; ", f"the decoder's {expected!r} is not in {got!r}"


def with_corpus(test: Any) -> Any:
    for parameters in CORPUS:
        test = example(parameters=parameters)(test)
    return test


@given(parameters=configs)
@with_corpus
async def test_the_policy_judges_as_the_decoder(kube: Kube, enforced: tuple[str, str], parameters: Any) -> None:
    assume(len(json.dumps(parameters)) <= limits.MAX_OPAQUE_PARAMETERS_LENGTH)  # else the API refuses it itself
    await check(kube, *enforced, parameters)
