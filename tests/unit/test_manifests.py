"""Static checks of what ships: one source for the CRD, names that must agree across files, RBAC
that stays least-privilege, chart values that exist, images built the way docs/deploy.md says."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from gpuconfig_cases import BAD

from gpudra_operator.crd import openapi_schema
from gpudra_operator.render import AGENT_METRICS_PORT, AGENT_SERVICE_ACCOUNT

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "manifests" / "base"
CHART = REPO / "manifests" / "helm" / "gpudra"
Obj = dict[str, Any]
NOT_RESOURCES = {"kustomization.yaml", "kustomizeconfig.yaml"}  # kustomize's own files


def load(path: Path) -> list[Obj]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def base_objects() -> list[Obj]:
    return [o for f in sorted(BASE.glob("*.yaml")) if f.name not in NOT_RESOURCES for o in load(f)]


def find(kind: str, name: str) -> Obj:
    return next(o for o in base_objects() if o["kind"] == kind and o["metadata"]["name"] == name)


def test_the_chart_ships_the_crd_byte_for_byte() -> None:
    source = (REPO / "crds" / "gpudraconfig.yaml").read_bytes()
    assert (CHART / "files" / "gpudraconfig.yaml").read_bytes() == source, \
        "cp crds/gpudraconfig.yaml manifests/helm/gpudra/files/"


def test_the_base_takes_the_crd_from_its_one_source() -> None:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    assert "../../crds" in kustomization["resources"]
    assert yaml.safe_load((REPO / "crds" / "kustomization.yaml").read_text())["resources"] == ["gpudraconfig.yaml"]
    files = {r for r in kustomization["resources"] if not r.startswith("..")}
    assert files == {f.name for f in BASE.glob("*.yaml")} - NOT_RESOURCES  # nothing left out


def test_names_agree_across_the_base_and_the_code() -> None:
    agent_ns = openapi_schema()["properties"]["spec"]["properties"]["agent"]["properties"]["namespace"]["default"]
    agent_sa = find("ServiceAccount", AGENT_SERVICE_ACCOUNT)
    assert agent_sa["metadata"]["namespace"] == agent_ns == "gpudra-system"
    namespaces = {o["metadata"]["name"]: o["metadata"]["labels"] for o in base_objects() if o["kind"] == "Namespace"}
    assert namespaces[agent_ns]["pod-security.kubernetes.io/enforce"] == "privileged"
    deployment = find("Deployment", "gpudra-operator")
    operator_ns = deployment["metadata"]["namespace"]
    assert namespaces[operator_ns]["pod-security.kubernetes.io/enforce"] == "restricted"
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert f"--namespace={agent_ns}" in container["args"]
    assert find("Role", "gpudra-operator")["metadata"]["namespace"] == agent_ns
    policy = find("ValidatingAdmissionPolicy", "gpudra-agent-resourceslices")
    # every namespace's agent ServiceAccount (spec.agent.namespace is free-form)
    assert policy["spec"]["matchConditions"][0]["expression"] == (
        'request.userInfo.username.startsWith("system:serviceaccount:") && '
        f'request.userInfo.username.endsWith(":{AGENT_SERVICE_ACCOUNT}")')
    assert find("ValidatingAdmissionPolicyBinding", "gpudra-agent-resourceslices")["spec"] == {
        "policyName": "gpudra-agent-resourceslices", "validationActions": ["Deny"]}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert f"--metrics-port={ports['metrics']}" in container["args"]
    assert f"--liveness-port={ports['healthz']}" in container["args"]
    assert find("Service", "gpudra-operator-metrics")["spec"]["ports"][0]["targetPort"] == "metrics"
    assert AGENT_METRICS_PORT == 8082  # the PodMonitor and docs/metrics.md name it


def test_the_driver_policy_takes_the_gpudraconfigs_as_parameters() -> None:
    """The driver check's parameters are the GpuDraConfigs the CRD serves; it fails open (the node
    check, which fails closed, stays); both match ResourceSlice v1 only (the type checker skips "*")."""
    crd = yaml.safe_load((REPO / "crds" / "gpudraconfig.yaml").read_text())["spec"]
    (served,) = [v["name"] for v in crd["versions"] if v["served"]]
    node, drivers = (find("ValidatingAdmissionPolicy", name)["spec"]
                     for name in ("gpudra-agent-resourceslices", "gpudra-agent-resourceslice-drivers"))
    assert drivers["paramKind"] == {"apiVersion": f"{crd['group']}/{served}", "kind": crd["names"]["kind"]}
    assert (node["failurePolicy"], drivers["failurePolicy"]) == ("Fail", "Ignore")
    for spec in (node, drivers):
        assert spec["matchConstraints"]["matchPolicy"] == "Equivalent"
        assert [r["apiVersions"] for r in spec["matchConstraints"]["resourceRules"]] == [["v1"]]
        assert spec["matchConditions"][0] == node["matchConditions"][0]  # every namespace's agent account
    agent = next(v["expression"] for v in drivers["variables"] if v["name"] == "agent")
    assert f'":{AGENT_SERVICE_ACCOUNT}"' in agent and "params.spec.agent.namespace" in agent
    assert find("ValidatingAdmissionPolicyBinding", "gpudra-agent-resourceslice-drivers")["spec"] == {
        "policyName": "gpudra-agent-resourceslice-drivers", "validationActions": ["Deny"],
        # every GpuDraConfig; none at all must not refuse every slice write in the cluster
        "paramRef": {"selector": {}, "parameterNotFoundAction": "Allow"}}


def test_the_claim_config_policy_checks_every_gpudraconfigs_driver() -> None:
    """GpuConfig parameters of claims, templates and classes, for each GpuDraConfig's driver; fails
    open (a missing CRD must not refuse every claim); every user's writes (no matchConditions); the
    reasons the agent's decoder gives (tests/integration/test_claim_config_admission.py runs it)."""
    crd = yaml.safe_load((REPO / "crds" / "gpudraconfig.yaml").read_text())["spec"]
    (served,) = [v["name"] for v in crd["versions"] if v["served"]]
    spec = find("ValidatingAdmissionPolicy", "gpudra-claim-config")["spec"]
    assert spec["paramKind"] == {"apiVersion": f"{crd['group']}/{served}", "kind": crd["names"]["kind"]}
    assert spec["failurePolicy"] == "Ignore" and "matchConditions" not in spec
    assert spec["matchConstraints"] == {"matchPolicy": "Equivalent", "resourceRules": [
        {"apiGroups": ["resource.k8s.io"], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
         "resources": ["resourceclaims", "resourceclaimtemplates", "deviceclasses"]}]}
    assert find("ValidatingAdmissionPolicyBinding", "gpudra-claim-config")["spec"] == {
        "policyName": "gpudra-claim-config", "validationActions": ["Deny"],
        "paramRef": {"selector": {}, "parameterNotFoundAction": "Allow"}}
    text = (BASE / "claim-config-admission-policy.yaml").read_text()
    assert {case.reason for case in BAD.values() if case.reason not in text} == set()


def test_operator_pod_is_restricted_and_replicated() -> None:
    deployment = find("Deployment", "gpudra-operator")
    spec = deployment["spec"]
    # One active replica and a standby (docs/ha.md): a rollout adds the new pod before an old one goes.
    assert spec["replicas"] == 2
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    labels = spec["selector"]["matchLabels"]
    (term,) = spec["template"]["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"] == {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": labels}}
    budget = find("PodDisruptionBudget", "gpudra-operator")
    assert budget["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    assert budget["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": labels}}
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    # The Lease lives in the pod's own namespace.
    assert {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}} in container["env"]
    # ... held under the pod's name, unique on the host network too (not the node's host name).
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in container["env"]
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]  # the only writable path


def rules(kind: str, name: str) -> list[Obj]:
    return find(kind, name)["rules"]


def test_no_role_holds_dangerous_verbs_or_resources() -> None:
    for obj in base_objects():
        for rule in obj.get("rules") or []:
            where = f"{obj['kind']} {obj['metadata']['name']}: {rule}"
            assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"], where
            assert not {"escalate", "bind", "impersonate", "deletecollection"} & set(rule["verbs"]), where
            assert not {"secrets", "configmaps", "roles", "clusterroles", "rolebindings", "clusterrolebindings",
                        "serviceaccounts", "serviceaccounts/token", "pods/exec"} & set(rule["resources"]), where


def test_agent_role_is_what_the_agent_uses() -> None:
    # Narrower than upstream's plugin role: the publisher lists, watches, server-side applies
    # (patch, and create for a new slice) and deletes; it never GETs or PUTs a slice.
    assert rules("ClusterRole", "gpudra-agent") == [
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"],
         "verbs": ["list", "watch", "create", "patch", "delete"]},
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]},
        # claim device status (KEP-4817): server-side apply of the status subresource, and from 1.36
        # the per-driver check, only for a token of the claim's own node and only the shipped driver
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims/status"], "verbs": ["patch"]},
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims/driver"], "resourceNames": ["gpu.gpudra.io"],
         "verbs": ["associated-node:patch", "associated-node:update"]},
        # its own GpuDraConfig, by name and by a watch of that one (gone or being deleted at SIGTERM: an uninstall)
        {"apiGroups": ["gpudra.io"], "resources": ["gpudraconfigs"], "verbs": ["get", "list", "watch"]},
        # Events on its Node and on the pods holding a device whose health changes: create only
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]


def test_operator_cannot_write_slices_or_pods() -> None:
    granted = {(g, r): set(rule["verbs"]) for rule in rules("ClusterRole", "gpudra-operator")
               for g in rule["apiGroups"] for r in rule["resources"]}
    assert granted[("resource.k8s.io", "resourceslices")] == {"list", "watch", "delete"}
    assert granted[("", "nodes")] == {"list"}
    assert ("apps", "daemonsets") not in granted  # namespaced Role in the agent namespace only
    namespaced = {(g, r): set(rule["verbs"]) for rule in rules("Role", "gpudra-operator")
                  for g in rule["apiGroups"] for r in rule["resources"]}
    assert namespaced[("", "pods")] == {"get", "list", "watch"}
    # create its own Events; list the agents' DevicePluginConflict Node events (no update, no delete)
    assert rules("Role", "gpudra-operator-events") == [{"apiGroups": [""], "resources": ["events"], "verbs": ["create", "list"]}]


def test_the_operator_may_hold_its_lease_and_no_other() -> None:
    """Leader election: the Lease gpudra-operator in the operator's namespace, by name wherever
    RBAC can check a name (not on create), bound to the operator's account only."""
    namespace = find("Deployment", "gpudra-operator")["metadata"]["namespace"]
    role = find("Role", "gpudra-operator-leader-election")
    assert role["metadata"]["namespace"] == namespace
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["gpudra-operator"],
         "verbs": ["get", "watch", "update"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]}]
    binding = find("RoleBinding", "gpudra-operator-leader-election")
    assert binding["metadata"]["namespace"] == namespace
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpudra-operator", "namespace": namespace}]
    from gpudra_operator.leaderelection import LEASE_NAME

    assert LEASE_NAME == "gpudra-operator"


def _value_paths(values: Any, prefix: str = "") -> set[str]:
    paths = {prefix} if prefix else set()
    if isinstance(values, dict):
        for k, v in values.items():
            paths |= _value_paths(v, f"{prefix}.{k}" if prefix else k)
    return paths


def test_every_value_a_template_reads_is_declared_in_values_yaml() -> None:
    declared = _value_paths(yaml.safe_load((CHART / "values.yaml").read_text()))
    used = {m for t in (CHART / "templates").rglob("*") if t.is_file() for m in re.findall(r"\.Values\.([A-Za-z0-9_.]+)", t.read_text())}
    assert used, "no .Values references found"
    assert sorted(used - declared) == []


def test_images_are_multi_stage_pinned_and_the_operator_is_not_root() -> None:
    deployment_user = find("Deployment", "gpudra-operator")["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    for name, user in (("operator", f"{deployment_user}:{deployment_user}"), ("agent", "0:0")):
        text = (REPO / "images" / f"{name}.Dockerfile").read_text()
        assert re.search(r"^ARG PYTHON_IMAGE=python:\d+\.\d+\.\d+-slim-\w+$", text, re.M), name
        assert len(re.findall(r"^FROM ", text, re.M)) == 2, name
        assert re.findall(r"^USER (\S+)$", text, re.M) == [user], name
        assert 'ENTRYPOINT ["gpudra"]' in text


def test_the_agents_network_policy_opens_metrics_only() -> None:
    from gpudra_operator.render import AGENT_HEALTH_PORT, AGENT_METRICS_PORT, agent_labels

    policy = find("NetworkPolicy", "gpudra-agent")
    assert policy["metadata"]["namespace"] == find("ServiceAccount", "gpudra-agent")["metadata"]["namespace"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= agent_labels("default").items()  # the rendered agent pods
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": AGENT_METRICS_PORT, "protocol": "TCP"}]
    assert AGENT_HEALTH_PORT not in {p["port"] for r in policy["spec"]["ingress"] for p in r["ports"]}
