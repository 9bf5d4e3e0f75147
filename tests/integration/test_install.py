"""The shipped install on the real control plane, with the shipped permissions and nothing more.

`kubectl apply -k manifests/base` creates every object; the Pod Security labels hold (the
operator's pod is admitted as `restricted`). Then the operator and one agent run with tokens of
their own ServiceAccounts (TokenRequest, the agent's bound to its DaemonSet pod on a fake node, so
the API server puts the node's name in it), reconcile a sample to Ready and publish its devices:
the RBAC is sufficient. The ValidatingAdmissionPolicies let an agent write only its own node's
ResourceSlices of its own GpuDraConfig's driver, type-check clean and never stand in the
operator's way; each token is denied what its role lacks.
Both components serve their metrics; Argo CD's health check reads the live status as Healthy. Two
operator replicas elect one active replica through their Lease with the shipped Role."""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml
from kubernetes_asyncio.client.exceptions import ApiException

from admissionpolicy import type_check_warnings, type_checked
from argocd_health import health
from scrape import sample_value, scrape
from gpudra_core.kubeapi import Kube, Obj, connect, error_message, resource_type
from gpudra_operator.leaderelection import LEASE, LEASE_NAME
from gpudra_dev.localcluster.agents import AgentProcess, start_agent
from gpudra_dev.localcluster.controlplane import ControlPlane, free_port
from gpudra_dev.localcluster.kubelet_sim import KubeletSimulator
from gpudra_dev.localcluster.objects import (create_fake_node, create_scratch_namespace, delete_namespace,
                                                  delete_node)
from gpudra_dev.localcluster.operatorproc import start_operator
from gpudra_dev.localcluster.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "manifests" / "base"
SAMPLE = REPO / "manifests" / "samples" / "gpudraconfig.yaml"
AGENT_NS, OPERATOR_NS = "gpudra-system", "gpudra-operator"
CONFIG = resource_type("gpudra.io/v1alpha1", "GpuDraConfig")
SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
DEVICE_CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")
DAEMONSET = resource_type("apps/v1", "DaemonSet")
POD = resource_type("v1", "Pod")
NODE = resource_type("v1", "Node")
CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")
CLUSTER_ROLE_BINDING = resource_type("rbac.authorization.k8s.io/v1", "ClusterRoleBinding")
NODE_POLICY, DRIVER_POLICY = "gpudra-agent-resourceslices", "gpudra-agent-resourceslice-drivers"
CLAIM_STATUS_POLICY = "gpudra-agent-resourceclaim-status"
SECRET_PATH = "/api/v1/namespaces/default/secrets"
CLUSTER_SCOPED = {"Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding",
                  "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
OPERATOR_METRICS = ("gpudra_reconcile_total", "gpudra_reconcile_errors_total", "gpudra_reconcile_time_seconds",
                    "gpudra_agents_desired", "gpudra_agents_ready", "gpudra_resourceslices_stale_found_total",
                    "gpudra_resourceslices_stale_deleted_total", "gpudra_last_successful_reconcile_timestamp_seconds",
                    "gpudra_build_info")
AGENT_METRICS = ("gpudra_agent_node_prepare_total", "gpudra_agent_node_prepare_errors_total",
                 "gpudra_agent_node_prepare_duration_seconds", "gpudra_agent_node_unprepare_total",
                 "gpudra_agent_node_unprepare_errors_total", "gpudra_agent_node_unprepare_duration_seconds",
                 "gpudra_agent_prepared_claims", "gpudra_agent_published_devices",
                 "gpudra_agent_last_successful_publish_timestamp_seconds", "gpudra_agent_publish_errors_total")


def kustomize(cluster: ControlPlane) -> list[Obj]:
    return [d for d in yaml.safe_load_all(cluster.kubectl("kustomize", str(BASE)).stdout) if d]


def ref(obj: Obj) -> tuple[str, str, str | None]:
    return obj["kind"], obj["metadata"]["name"], obj["metadata"].get("namespace")


# --- credentials of the shipped ServiceAccounts ---------------------------------------------------
async def request_token(kube: Kube, namespace: str, service_account: str, pod: Obj | None = None) -> str:
    """A token from the TokenRequest API; bound to ``pod`` (name + uid) when given, which makes the
    API server embed the pod's node (ServiceAccountTokenPodNodeInfo)."""
    spec: Obj = {"expirationSeconds": 3600}
    if pod is not None:
        spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Pod", "name": pod["metadata"]["name"],
                                  "uid": pod["metadata"]["uid"]}
    review = await kube.request(
        "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{service_account}/token",
        body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec})
    return review["status"]["token"]


def token_kubeconfig(cluster: ControlPlane, token: str, path: Path) -> Path:
    config = {"apiVersion": "v1", "kind": "Config",
              "clusters": [{"name": "local", "cluster": {"server": cluster.server,
                                                         "certificate-authority": str(cluster.pki.ca.cert)}}],
              "users": [{"name": "sa", "user": {"token": token}}],
              "contexts": [{"name": "sa", "context": {"cluster": "local", "user": "sa"}}],
              "current-context": "sa"}
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


class TokenClient:
    """A Kube client that authenticates with one ServiceAccount token."""

    def __init__(self, kubeconfig: Path, field_manager: str) -> None:
        self.kubeconfig = kubeconfig
        self.field_manager = field_manager

    async def __aenter__(self) -> Kube:
        self.api = await connect(str(self.kubeconfig))
        return Kube(self.api, self.field_manager)

    async def __aexit__(self, *exc: object) -> None:
        await self.api.close()


async def denied(call: Any) -> ApiException:
    with pytest.raises(ApiException) as caught:
        await call
    return caught.value


def slice_for(node: str, driver: str, name: str) -> Obj:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name},
            "spec": {"driver": driver, "nodeName": node,
                     "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                     "devices": [{"name": "gpu-0"}]}}


def agent_pod(namespace: str, node: str, name: str) -> Obj:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
            "spec": {"serviceAccountName": "gpudra-agent", "nodeName": node,
                     "containers": [{"name": "agent", "image": "ghcr.io/gpudra/gpudra:0.1.0"}]}}


async def agent_elsewhere(cluster: ControlPlane, kube: Kube, namespace: str, node: str, path: Path) -> Path:
    """The kubeconfig of an agent in ``namespace`` (spec.agent.namespace is free-form): a gpudra-agent
    ServiceAccount there, given the agent's role by hand, with a token bound to its pod on ``node``.
    :func:`remove_agent_elsewhere` undoes it."""
    await kube.create({"apiVersion": "v1", "kind": "ServiceAccount",
                       "metadata": {"name": "gpudra-agent", "namespace": namespace}})
    await kube.create({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                       "metadata": {"name": f"gpudra-agent-{namespace}"},
                       "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                   "name": "gpudra-agent"},
                       "subjects": [{"kind": "ServiceAccount", "name": "gpudra-agent", "namespace": namespace}]})
    pod = await kube.create(agent_pod(namespace, node, "agent"))
    return token_kubeconfig(cluster, await request_token(kube, namespace, "gpudra-agent", pod), path)


async def remove_agent_elsewhere(kube: Kube, namespace: str) -> None:
    await kube.delete(CLUSTER_ROLE_BINDING, f"gpudra-agent-{namespace}")
    await delete_namespace(kube, namespace)


def gpudra_config(name: str, agent_namespace: str, driver: str) -> Obj:
    return {"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig", "metadata": {"name": name},
            "spec": {"driverName": driver, "agent": {"namespace": agent_namespace}}}


async def report(kube: Kube, name: str, *, conflict: bool = False) -> None:
    """The status the operator writes after a reconcile (with a Degraded condition of reason
    Conflict when an older config holds the driver or the agent namespace); no operator runs here."""
    live = await kube.get(CONFIG, name)
    assert live is not None
    conditions = [{"type": "Degraded", "status": "True", "reason": "Conflict", "message": "claimed by an older config",
                   "lastTransitionTime": "2026-01-01T00:00:00Z"}] if conflict else []
    await kube.patch(CONFIG, name, {"status": {"observedGeneration": live["metadata"]["generation"],
                                               "conditions": conditions}}, subresource="status")


ALLOWED = "allowed"


async def verdict(call: Awaitable[Any]) -> str:
    """ALLOWED, or the refusal's status and message."""
    try:
        await call
    except ApiException as error:
        return f"{error.status} {error_message(error)}"
    return ALLOWED


async def verdict_becomes(call: Callable[[], Awaitable[Any]], expected: str, what: str) -> None:
    """Wait until ``call()`` (a dry-run write) is ALLOWED or refused with ``expected`` in the message:
    the API server reads GpuDraConfigs for the policy through an informer, a moment behind writes."""
    async def probe() -> str | None:
        got = await verdict(call())
        return got if (got == expected if expected == ALLOWED else expected in got) else None

    await wait_for(probe, timeout=30, what=what)


# --- fixtures -------------------------------------------------------------------------------------
@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def installed(cluster: ControlPlane, kube: Kube) -> AsyncIterator[list[Obj]]:
    """`kubectl apply -k manifests/base`, as a user types it; everything but the CRD (shared with
    other tests) is removed afterwards."""
    objects = kustomize(cluster)
    applied = cluster.kubectl("apply", "-k", str(BASE))
    cluster.kubectl("wait", "--for=condition=Established", "crd/gpudraconfigs.gpudra.io", "--timeout=60s")
    try:
        yield objects
    finally:
        print(f"\n--- kubectl apply -k output ---\n{applied.stdout}")
        rest = [o for o in objects if o["kind"] not in ("CustomResourceDefinition", "Namespace")]
        cluster.kubectl("delete", "-f", "-", "--ignore-not-found", "--wait=false", input=yaml.safe_dump_all(rest))
        for namespace in (AGENT_NS, OPERATOR_NS):
            await delete_namespace(kube, namespace)


@pytest.fixture
def suffix() -> str:
    return secrets.token_hex(3)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gpudra-"))  # plugin sockets need a short path
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest_asyncio.fixture(loop_scope="session")
async def nodes(kube: Kube) -> AsyncIterator[list[str]]:
    created: list[str] = []
    yield created
    for name in created:
        await delete_node(kube, name)


async def fake_node(kube: Kube, nodes: list[str], prefix: str, labels: dict[str, str] | None = None) -> str:
    name = f"{prefix}-{secrets.token_hex(3)}"
    await create_fake_node(kube, name, labels)
    nodes.append(name)
    return name


# --- the install --------------------------------------------------------------------------------
async def test_apply_k_creates_everything(cluster: ControlPlane, kube: Kube, installed: list[Obj]) -> None:
    kinds = {o["kind"] for o in installed}
    assert kinds == {"Namespace", "CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                     "Role", "RoleBinding", "Deployment", "PodDisruptionBudget", "Service", "ValidatingAdmissionPolicy",
                     "ValidatingAdmissionPolicyBinding", "NetworkPolicy"}
    for obj in installed:
        kind, name, namespace = ref(obj)
        assert (kind in CLUSTER_SCOPED) == (namespace is None), f"{kind} {name}"
    got = cluster.kubectl("get", "-f", "-", "-o", "name", input=yaml.safe_dump_all(installed), check=False)
    assert got.returncode == 0, got.stderr
    assert len(got.stdout.split()) == len(installed)

    # The restricted profile admits the operator's pod (a violation would leave the ReplicaSet
    # with FailedCreate and no pod), and the namespace really enforces it.
    async def operator_pod() -> Obj | None:
        pods = [p async for p in kube.list(POD, OPERATOR_NS, label_selector="app.kubernetes.io/name=gpudra-operator")]
        return pods[0] if pods else None

    pod = await wait_for(operator_pod, timeout=60, what="the operator Deployment's pod to be admitted")
    container = pod["spec"]["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    privileged = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "psa-probe"},
                  "spec": {"containers": [{"name": "c", "image": "x", "securityContext": {"privileged": True}}],
                           "volumes": [{"name": "h", "hostPath": {"path": "/var/lib/kubelet"}}]}}
    rejected = await denied(kube.create({**privileged, "metadata": {"name": "psa-probe", "namespace": OPERATOR_NS}},
                                        dry_run=True))
    assert rejected.status == 403 and 'violates PodSecurity "restricted:latest"' in error_message(rejected)
    await kube.create({**privileged, "metadata": {"name": "psa-probe", "namespace": AGENT_NS}}, dry_run=True)

    # The live objects are what the base says: no drift for GitOps tools to fight over.
    diff = cluster.kubectl("diff", "-k", str(BASE), check=False)
    assert diff.returncode == 0, diff.stdout + diff.stderr


async def test_operator_and_agent_run_with_their_own_service_accounts(
        cluster: ControlPlane, kube: Kube, installed: list[Obj], nodes: list[str], suffix: str,
        short_dir: Path, tmp_path: Path) -> None:
    node = await fake_node(kube, nodes, "gpu", {"gpudra-install": suffix})
    operator_kubeconfig = token_kubeconfig(cluster, await request_token(kube, OPERATOR_NS, "gpudra-operator"),
                                           tmp_path / "operator.kubeconfig")
    operator_port, agent_port = free_port(), free_port()
    operator_log = tmp_path / "operator.log"
    operator = start_operator(kubeconfig=operator_kubeconfig, log_path=operator_log,
                              args=("--namespace", AGENT_NS, "--liveness-port", "0", "--metrics-port",
                                    str(operator_port), "--log-format", "json"),
                              env={"GPUDRA_DRIFT_INTERVAL": "3", "POD_NAMESPACE": OPERATOR_NS})
    simulator = asyncio.create_task(KubeletSimulator(kube).run())
    agent: AgentProcess | None = None
    config = yaml.safe_load(SAMPLE.read_text())
    name, driver = config["metadata"]["name"], config["spec"]["driverName"]
    try:
        config["spec"]["agent"]["nodeSelector"] = {"gpudra-install": suffix}  # just this test's node
        await kube.create(config)

        # The operator (its own token) renders the DaemonSet; the DaemonSet controller puts a pod
        # on the node; the agent gets a token bound to that pod, as its projected token would be.
        async def agent_pod() -> Obj | None:
            pods = [p async for p in kube.list(POD, AGENT_NS, field_selector=f"spec.nodeName={node}")]
            return pods[0] if pods else None

        pod = await wait_for(agent_pod, timeout=60, what=f"the agent pod on {node}")
        assert pod["spec"]["serviceAccountName"] == "gpudra-agent"
        agent_kubeconfig = token_kubeconfig(cluster, await request_token(kube, AGENT_NS, "gpudra-agent", pod),
                                            tmp_path / "agent.kubeconfig")
        agent = start_agent(kubeconfig=agent_kubeconfig, node_name=node, nvml="fake:l4x2", driver=driver,
                            workdir=short_dir / node, extra_args=("--metrics-port", str(agent_port)))

        async def ready_with_devices() -> Obj | None:
            assert operator.process.poll() is None, f"operator exited:\n{operator.log_tail()}"
            assert agent.process.poll() is None, f"agent exited:\n{agent.log_tail()}"
            live = await kube.get(CONFIG, name)
            if live is None:
                return None
            conditions = {c["type"]: c for c in (live.get("status") or {}).get("conditions") or []}
            ok = (conditions.get("Ready", {}).get("status") == "True" and live["status"].get("devices") == 2
                  and live["status"]["observedGeneration"] == live["metadata"]["generation"])
            return live if ok else None

        live = await wait_for(ready_with_devices, timeout=90, what=f"GpuDraConfig {name} Ready with 2 devices")
        assert live["status"]["agents"] == {"desired": 1, "ready": 1, "updated": 1, "summary": "1/1"}
        assert sorted(c["name"] for c in live["status"]["deviceClasses"]) == sorted(c["name"] for c in config["spec"]["deviceClasses"])
        assert health(live)["status"] == "Healthy"
        slices = [s async for s in kube.list(SLICE, field_selector=f"spec.driver={driver},spec.nodeName={node}")]
        assert slices and {m["manager"] for s in slices for m in s["metadata"]["managedFields"]} == {"gpudra-agent"}

        # Both components serve their metrics, with values from what just happened.
        operator_metrics = await wait_for(lambda: asyncio.to_thread(scrape, operator_port), timeout=10,
                                          what="operator /metrics")
        for metric in OPERATOR_METRICS:
            assert f"\n{metric}" in operator_metrics, metric
        assert (sample_value(operator_metrics, "gpudra_reconcile_total", 'result="success"') or 0) >= 1
        assert sample_value(operator_metrics, "gpudra_agents_ready", f'config="{name}"') == 1
        assert sample_value(operator_metrics, "gpudra_agents_desired", f'config="{name}"') == 1
        assert sample_value(operator_metrics, "gpudra_leader_election_master_status", 'name="gpudra-operator"') == 1
        agent_metrics = await asyncio.to_thread(scrape, agent_port)
        for metric in AGENT_METRICS:
            assert f"\n{metric}" in agent_metrics, metric
        assert sample_value(agent_metrics, "gpudra_agent_published_devices") == 2
        assert (sample_value(agent_metrics, "gpudra_agent_last_successful_publish_timestamp_seconds") or 0) > 0

        # Deleting the config: the operator's teardown (its token) removes classes, the DaemonSet,
        # and, once the agent is gone, the node's slices (the admission policy never blocks it).
        await kube.delete(CONFIG, name)
        assert await kube.get(CONFIG, name) is None  # no finalizer: gone at once

        async def agent_pod_going() -> bool:
            current = await kube.get(POD, pod["metadata"]["name"], AGENT_NS)
            return current is None or bool(current["metadata"].get("deletionTimestamp"))

        await wait_for(agent_pod_going, timeout=60, what="the agent pod to be deleted")
        agent.stop()  # what the kubelet does to the container of a deleted pod

        async def torn_down() -> bool:
            return (not [s async for s in kube.list(SLICE, field_selector=f"spec.driver={driver}")]
                    and all([await _absent(kube, DEVICE_CLASS, c["name"]) for c in config["spec"]["deviceClasses"]]))

        await wait_for(torn_down, timeout=60, what=f"GpuDraConfig {name}'s slices and DeviceClasses to go")

        text = operator_log.read_text()
        records = [json.loads(line) for line in text.splitlines() if line.startswith("{")]  # --log-format json
        assert any(r["message"].startswith("serving Prometheus metrics") for r in records)
        assert {"message", "timestamp", "severity"} <= records[-1].keys()
        for word in ("forbidden", "not enough permissions", "unauthorized"):
            assert word not in text.lower(), f"the operator hit {word!r} with the shipped RBAC:\n{text[-4000:]}"
    finally:
        simulator.cancel()
        if agent is not None:
            agent.stop()
        operator.stop()
        if await kube.get(CONFIG, name) is not None:
            await kube.delete(CONFIG, name)
        print(f"\n--- operator log tail ---\n{operator.log_tail()}")
        if agent is not None:
            print(f"\n--- agent log tail ---\n{agent.log_tail()}")


async def _absent(kube: Kube, rtype: Any, name: str, namespace: str | None = None) -> bool:
    return await kube.get(rtype, name, namespace) is None


# --- the admission policy and the roles' limits ---------------------------------------------------
async def test_agent_writes_only_its_own_nodes_slices_and_the_operator_any(
        cluster: ControlPlane, kube: Kube, installed: list[Obj], nodes: list[str], suffix: str,
        tmp_path: Path) -> None:
    own, other = await fake_node(kube, nodes, "own"), await fake_node(kube, nodes, "other")
    driver = f"vap-{suffix}.gpudra.io"
    pod = await kube.create(agent_pod(AGENT_NS, own, f"agent-{suffix}"))
    agent_cfg = token_kubeconfig(cluster, await request_token(kube, AGENT_NS, "gpudra-agent", pod), tmp_path / "a")
    unbound_cfg = token_kubeconfig(cluster, await request_token(kube, AGENT_NS, "gpudra-agent"), tmp_path / "u")
    operator_cfg = token_kubeconfig(cluster, await request_token(kube, OPERATOR_NS, "gpudra-operator"), tmp_path / "o")
    foreign = await kube.create(slice_for(other, driver, f"{other}-{suffix}"))
    try:
        async with TokenClient(agent_cfg, "gpudra-agent") as agent:
            message = f"gpudra-agent on node {own} may only write ResourceSlices of its own node, not of node {other}"
            await verdict_becomes(lambda: agent.create(slice_for(other, driver, f"x-{suffix}"), dry_run=True),
                                  message, "the policy in force (the API server loads it within a second)")
            # Its own node: create, update, delete are all allowed.
            mine = await agent.create(slice_for(own, driver, f"{own}-{suffix}"))
            mine = await agent.patch(SLICE, mine["metadata"]["name"], {"spec": {"pool": {"generation": 2}}})
            assert mine["spec"]["pool"]["generation"] == 2

            # Another node: denied by the policy, with its message, for every write.
            for attempt in (agent.create(slice_for(other, driver, f"x-{suffix}")),
                            agent.patch(SLICE, foreign["metadata"]["name"], {"spec": {"pool": {"generation": 5}}}),
                            agent.delete(SLICE, foreign["metadata"]["name"])):
                error = await denied(attempt)
                assert error.status == 403, error_message(error)
                assert NODE_POLICY in error_message(error) and message in error_message(error)
            # Nor may it move another node's slice onto itself, or write one without a node.
            error = await denied(agent.patch(SLICE, foreign["metadata"]["name"], {"spec": {"nodeName": own}}))
            assert error.status in (403, 422), error_message(error)
            error = await denied(agent.create({**slice_for(own, driver, f"all-{suffix}"), "spec": {
                "driver": driver, "allNodes": True, "pool": {"name": "p", "generation": 1, "resourceSliceCount": 1}}}))
            assert error.status == 403 and "not a slice without spec.nodeName" in error_message(error)

            # Beyond its role: no reads of pods or secrets, no DeviceClasses, no node writes.
            beyond: tuple[Awaitable[Any], ...] = (
                agent.list(POD, AGENT_NS).__anext__(), agent.request("GET", SECRET_PATH),
                agent.create({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                              "metadata": {"name": f"evil-{suffix}"}, "spec": {}}),
                agent.patch(NODE, own, {"metadata": {"labels": {"x": "y"}}}))
            for request in beyond:
                error = await denied(request)
                assert error.status == 403 and "system:serviceaccount:gpudra-system:gpudra-agent" in error_message(error)
            # What it does need: its Node, and any claim the kubelet asks it to prepare (a 404, not a 403).
            assert ((await agent.get(NODE, own)) or {}).get("metadata", {}).get("name") == own
            assert await agent.get(CLAIM, f"no-such-claim-{suffix}", "default") is None
            error = await denied(agent.list(CLAIM, "default").__anext__())
            assert error.status == 403
            await agent.delete(SLICE, mine["metadata"]["name"])

        # An agent ServiceAccount in another namespace (spec.agent.namespace is free-form), given the
        # agent's role by hand: the policy holds it to its own node as well.
        elsewhere = await create_scratch_namespace(kube, "agents")
        try:
            moved_cfg = await agent_elsewhere(cluster, kube, elsewhere, own, tmp_path / "m")
            async with TokenClient(moved_cfg, "gpudra-agent") as moved_agent:
                error = await denied(moved_agent.create(slice_for(other, driver, f"m-{suffix}")))
                assert error.status == 403 and NODE_POLICY in error_message(error)
        finally:
            await remove_agent_elsewhere(kube, elsewhere)

        # A token of the agent's ServiceAccount not bound to a pod carries no node: no writes at all.
        async with TokenClient(unbound_cfg, "gpudra-agent") as unbound:
            error = await denied(unbound.create(slice_for(own, driver, f"u-{suffix}")))
            assert error.status == 403 and "pod-bound ServiceAccount token" in error_message(error)

        # The operator is outside the policy: its GC deletes any node's slices; it cannot write them.
        async with TokenClient(operator_cfg, "gpudra-operator") as operator:
            error = await denied(operator.create(slice_for(own, driver, f"o-{suffix}")))
            assert error.status == 403 and "cannot create resource" in error_message(error)
            error = await denied(operator.request("GET", SECRET_PATH))
            assert error.status == 403
            assert await operator.delete(SLICE, foreign["metadata"]["name"]) is True
        assert [s async for s in kube.list(SLICE, field_selector=f"spec.driver={driver}")] == []
    finally:
        await kube.delete(POD, pod["metadata"]["name"], AGENT_NS, grace_period_seconds=0)
        async for leftover in kube.list(SLICE, field_selector=f"spec.driver={driver}"):
            await kube.delete(SLICE, leftover["metadata"]["name"])


async def test_each_agent_publishes_only_its_own_configs_driver(
        cluster: ControlPlane, kube: Kube, installed: list[Obj], nodes: list[str], suffix: str,
        tmp_path: Path) -> None:
    """Two GpuDraConfigs, each with its agents in its own namespace: each agent writes its own
    config's driver and no other (create, update, delete); the installed ServiceAccount, which no
    config names here, writes no config's driver; a config in Conflict binds no one; the operator
    is never held."""
    node = await fake_node(kube, nodes, "drv")
    ns_a, ns_b = await create_scratch_namespace(kube, "agents-a"), await create_scratch_namespace(kube, "agents-b")
    name_a, name_b, name_c = f"drv-a-{suffix}", f"drv-b-{suffix}", f"drv-c-{suffix}"
    driver_a, driver_b, driver_c = f"a-{suffix}.example.com", f"b-{suffix}.example.com", f"c-{suffix}.example.com"
    unowned = f"free-{suffix}.example.com"

    def only_its_driver(config: str, namespace: str, driver: str, written: str) -> str:
        return f"gpudra-agent of GpuDraConfig {config} (namespace {namespace}) publishes only driver {driver}, not {written}"

    def only_its_agent(config: str, namespace: str, driver: str, writer_namespace: str) -> str:
        return (f"driver {driver} of GpuDraConfig {config} is published only by its gpudra-agent in namespace "
                f"{namespace}, not by system:serviceaccount:{writer_namespace}:gpudra-agent")

    # An agent writing the other config's driver breaks both configs' rules; the API server
    # reports the first config's refusal it met, in no fixed order.
    a_writes_b = (only_its_driver(name_a, ns_a, driver_a, driver_b), only_its_agent(name_b, ns_b, driver_b, ns_a))
    b_writes_a = (only_its_driver(name_b, ns_b, driver_b, driver_a), only_its_agent(name_a, ns_a, driver_a, ns_b))
    installed_pod = await kube.create(agent_pod(AGENT_NS, node, f"agent-{suffix}"))
    try:
        a_cfg = await agent_elsewhere(cluster, kube, ns_a, node, tmp_path / "a")
        b_cfg = await agent_elsewhere(cluster, kube, ns_b, node, tmp_path / "b")
        installed_cfg = token_kubeconfig(cluster, await request_token(kube, AGENT_NS, "gpudra-agent", installed_pod),
                                         tmp_path / "i")
        operator_cfg = token_kubeconfig(cluster, await request_token(kube, OPERATOR_NS, "gpudra-operator"),
                                        tmp_path / "o")
        for name, namespace, driver in ((name_a, ns_a, driver_a), (name_b, ns_b, driver_b)):
            await kube.create(gpudra_config(name, namespace, driver))
            await report(kube, name)
        async with TokenClient(a_cfg, "gpudra-agent") as agent_a, TokenClient(b_cfg, "gpudra-agent") as agent_b, \
                TokenClient(installed_cfg, "gpudra-agent") as agent_unnamed:
            # Once the policy sees both configs: A's agent is held to A's driver, B's driver to B's agent.
            await verdict_becomes(lambda: agent_a.create(slice_for(node, unowned, f"w-{suffix}"), dry_run=True),
                                  only_its_driver(name_a, ns_a, driver_a, unowned), "A's agent held to driver A")
            await verdict_becomes(lambda: agent_unnamed.create(slice_for(node, driver_b, f"w-{suffix}"), dry_run=True),
                                  only_its_agent(name_b, ns_b, driver_b, AGENT_NS), "driver B held to B's agent")

            # Each agent: its own driver on its own node, created and updated.
            mine = await agent_a.create(slice_for(node, driver_a, f"{node}-a"))
            await agent_a.patch(SLICE, mine["metadata"]["name"], {"spec": {"pool": {"generation": 2}}})
            theirs = await agent_b.create(slice_for(node, driver_b, f"{node}-b"))
            # The API server reads the GpuDraConfigs itself: an agent reads its own (by name, and a
            # watch of that one: at SIGTERM, an uninstall?), and never writes one.
            assert (await denied(agent_a.patch(CONFIG, name_b, {"metadata": {"labels": {"x": "y"}}}))).status == 403

            # The other config's driver: creating, updating, deleting its slice are all refused.
            for attempt in (agent_a.create(slice_for(node, driver_b, f"x-{suffix}")),
                            agent_a.patch(SLICE, theirs["metadata"]["name"], {"spec": {"pool": {"generation": 5}}}),
                            agent_a.delete(SLICE, theirs["metadata"]["name"])):
                error = await denied(attempt)
                assert error.status == 403, error_message(error)
                assert DRIVER_POLICY in error_message(error), error_message(error)
                assert any(m in error_message(error) for m in a_writes_b), error_message(error)
            error = await denied(agent_b.create(slice_for(node, driver_a, f"x-{suffix}")))
            assert error.status == 403 and any(m in error_message(error) for m in b_writes_a), error_message(error)
            # Nor may it turn its own slice into the other driver's (spec.driver is immutable besides).
            error = await denied(agent_a.patch(SLICE, mine["metadata"]["name"], {"spec": {"driver": driver_b}}))
            assert error.status in (403, 422), error_message(error)

            # The installed ServiceAccount, in a namespace neither config names: no config's driver;
            # a driver no config names stays a matter of the node check.
            error = await denied(agent_unnamed.create(slice_for(node, driver_a, f"i-{suffix}")))
            assert error.status == 403, error_message(error)
            assert only_its_agent(name_a, ns_a, driver_a, AGENT_NS) in error_message(error), error_message(error)
            await agent_unnamed.create(slice_for(node, unowned, f"i-{suffix}"), dry_run=True)

            # A later config naming A's namespace would hold A's agent to its own driver, but the
            # operator reports it in Conflict (it runs nothing), and then it binds no one.
            def a_writes_a() -> Awaitable[Obj]:
                return agent_a.create(slice_for(node, driver_a, f"c-{suffix}"), dry_run=True)

            await kube.create(gpudra_config(name_c, ns_a, driver_c))
            await report(kube, name_c)
            await verdict_becomes(a_writes_a, only_its_driver(name_c, ns_a, driver_c, driver_a),
                                  "a reconciled config to bind its namespace's agent")
            await report(kube, name_c, conflict=True)
            await verdict_becomes(a_writes_a, ALLOWED, "a config in Conflict to bind no one")

        # The operator is outside the policy: its cleanup deletes any driver's slices.
        async with TokenClient(operator_cfg, "gpudra-operator") as operator:
            assert await operator.delete(SLICE, mine["metadata"]["name"]) is True
            assert await operator.delete(SLICE, theirs["metadata"]["name"]) is True
    finally:
        for name in (name_a, name_b, name_c):
            await kube.delete(CONFIG, name)
        await kube.delete(POD, installed_pod["metadata"]["name"], AGENT_NS, grace_period_seconds=0)
        for namespace in (ns_a, ns_b):
            await remove_agent_elsewhere(kube, namespace)
        for driver in (driver_a, driver_b, driver_c, unowned):
            async for leftover in kube.list(SLICE, field_selector=f"spec.driver={driver}"):
                await kube.delete(SLICE, leftover["metadata"]["name"])


async def test_the_admission_policies_type_check_clean(kube: Kube, installed: list[Obj], suffix: str) -> None:
    """kube-controller-manager type-checks each policy's CEL against ResourceSlice v1 and the
    GpuDraConfig schema (status.typeChecking): no warnings. A copy with a misspelt field gets one,
    so the checker really looks at them (it skips policies that match apiVersions "*")."""
    policies = {o["metadata"]["name"]: o for o in installed if o["kind"] == "ValidatingAdmissionPolicy"}
    # gpudra-claim-config's type check: tests/integration/test_claim_config_admission.py
    assert sorted(policies) == sorted((NODE_POLICY, DRIVER_POLICY, CLAIM_STATUS_POLICY, "gpudra-claim-config"))
    for name in (NODE_POLICY, CLAIM_STATUS_POLICY):
        status = await wait_for(lambda: type_checked(kube, name), timeout=30, what=f"{name} type-checked")
        assert not (status.get("typeChecking") or {}).get("expressionWarnings"), status
    # The driver policy as installed may have been checked before the CRD was known: check a copy.
    spec = policies[DRIVER_POLICY]["spec"]
    assert await type_check_warnings(kube, f"check-{suffix}", spec) == []
    typo = json.loads(json.dumps(spec).replace("params.spec.driverName", "params.spec.driver"))
    warnings = await type_check_warnings(kube, f"typo-{suffix}", typo)
    assert warnings and all("undefined field 'driver'" in w["warning"] for w in warnings), warnings


async def test_operator_role_is_confined_to_the_agent_namespace(
        cluster: ControlPlane, kube: Kube, installed: list[Obj], namespace: str, tmp_path: Path) -> None:
    daemonset: Obj = {"apiVersion": "apps/v1", "kind": "DaemonSet",
                 "metadata": {"name": "gpudra-agent", "namespace": namespace},
                 "spec": {"selector": {"matchLabels": {"a": "b"}}, "template": {
                     "metadata": {"labels": {"a": "b"}}, "spec": {"containers": [{"name": "c", "image": "x"}]}}}}
    operator_cfg = token_kubeconfig(cluster, await request_token(kube, OPERATOR_NS, "gpudra-operator"), tmp_path / "o")
    async with TokenClient(operator_cfg, "gpudra-operator") as operator:
        error = await denied(operator.apply(daemonset, dry_run=True))
        assert error.status == 403 and f'in the namespace "{namespace}"' in error_message(error)
        await operator.apply({**daemonset, "metadata": {**daemonset["metadata"], "namespace": AGENT_NS}}, dry_run=True)
        error = await denied(operator.request("GET", "/apis/rbac.authorization.k8s.io/v1/clusterroles"))
        assert error.status == 403


async def test_two_operator_replicas_share_the_lease_with_the_shipped_rbac(
        cluster: ControlPlane, kube: Kube, installed: list[Obj], tmp_path: Path) -> None:
    """Leader election with the operator's token: one replica takes the Lease in its namespace, the
    other watches it (by name, which resourceNames allows) and takes it over when the first stops;
    the token may touch no other Lease."""
    token = await request_token(kube, OPERATOR_NS, "gpudra-operator")
    kubeconfig = token_kubeconfig(cluster, token, tmp_path / "operator.kubeconfig")
    replicas = [start_operator(kubeconfig=kubeconfig, log_path=tmp_path / f"operator-{i}.log",
                               args=("--namespace", AGENT_NS, "--liveness-port", "0"),
                               env={"POD_NAMESPACE": OPERATOR_NS}) for i in range(2)]
    identities = {f"{socket.gethostname()}/{r.process.pid}": r for r in replicas}
    try:
        async def holder() -> str | None:
            lease = await kube.get(LEASE, LEASE_NAME, OPERATOR_NS)
            held = ((lease or {}).get("spec") or {}).get("holderIdentity")
            return held if held in identities else None

        first = identities[await wait_for(holder, timeout=30, what="a replica to hold the Lease")]
        second = next(r for r in replicas if r is not first)
        await wait_for(lambda: asyncio.to_thread(lambda: "standby: Lease" in second.log()), timeout=30,
                       what="the other replica to stand by")
        assert first.stop() == 0
        assert identities[await wait_for(holder, timeout=10, what="the standby to take the Lease")] is second
        async with TokenClient(kubeconfig, "gpudra-operator") as operator:
            other = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                     "metadata": {"name": "someone-else", "namespace": OPERATOR_NS}, "spec": {}}
            await operator.request("POST", LEASE.path(OPERATOR_NS), body=other)  # create: no name to check
            error = await denied(operator.request("PUT", LEASE.path(OPERATOR_NS, "someone-else"), body=other))
            assert error.status == 403
            error = await denied(operator.request("GET", LEASE.path("default", LEASE_NAME)))
            assert error.status == 403
    finally:
        for replica in replicas:
            replica.stop()
        for replica in replicas:
            print(f"\n--- {replica.log_path.name} tail ---\n{replica.log_tail(10)}")
    for replica in replicas:
        text = replica.log().lower()
        for word in ("forbidden", "not enough permissions", "unauthorized"):
            assert word not in text, f"{word!r} with the shipped RBAC:\n{replica.log_tail()}"
