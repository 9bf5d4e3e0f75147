"""The Helm chart renders the kustomize base's objects, and its values do what values.yaml says.

Needs the helm binary (hack/helm-bin.sh, which `make test` runs, or $GPUDRA_HELM) and kubectl for
`kubectl kustomize`; no cluster."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from chartregistry import helm_binary

from gpudra_dev.localcluster.controlplane import ControlPlane, find_binaries
from gpudra_operator.render_cmd import render_documents

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "manifests" / "helm" / "gpudra"
BASE = REPO / "manifests" / "base"
MONITORING = REPO / "manifests" / "monitoring"
KUBE_VERSION = "v1.35.4"  # helm's default capabilities depend on how it was built: be explicit
Obj = dict[str, Any]


@pytest.fixture(scope="module")
def helm() -> str:
    return helm_binary()  # $GPUDRA_HELM, else hack/helm-bin.sh's pinned version; fails naming make helm-bin


def template(helm: str, *args: str) -> list[Obj]:
    out = subprocess.run([helm, "template", "gpudra", str(CHART), "--kube-version", KUBE_VERSION, *args],
                         check=True, capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def kustomize() -> list[Obj]:
    out = subprocess.run([str(find_binaries() / "kubectl"), "kustomize", str(BASE)],
                         check=True, capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def key(obj: Obj) -> tuple[str, str, str | None]:
    return obj["kind"], obj["metadata"]["name"], obj["metadata"].get("namespace")


def without_metadata_decoration(obj: Obj) -> Obj:
    """The object minus labels and annotations (Helm adds its own labels; the chart's CRD carries
    the keep annotation), everything else as rendered."""
    out = copy.deepcopy(obj)
    out["metadata"].pop("labels", None)
    out["metadata"].pop("annotations", None)
    return out


def by_key(objects: list[Obj]) -> dict[tuple[str, str, str | None], Obj]:
    return {key(o): o for o in objects}


def test_lint_strict(helm: str) -> None:
    result = subprocess.run([helm, "lint", str(CHART), "--strict", "--kube-version", KUBE_VERSION],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def release_objects(objects: list[Obj]) -> list[Obj]:
    """The objects a release holds: hooks (the uninstall hook, `helm test`) are Helm's alone."""
    return [o for o in objects if "helm.sh/hook" not in (o["metadata"].get("annotations") or {})]


def test_defaults_render_the_same_objects_as_the_kustomize_base(helm: str) -> None:
    chart, base = by_key(release_objects(template(helm))), by_key(kustomize())
    assert sorted({k[0] for k in chart}) == sorted({k[0] for k in base})
    assert sorted(chart, key=str) == sorted(base, key=str)
    for k, obj in base.items():
        assert without_metadata_decoration(chart[k]) == without_metadata_decoration(obj), k
        # Helm adds its labels; it never drops or changes one of the base's.
        assert chart[k]["metadata"].get("labels", {}).items() >= obj["metadata"].get("labels", {}).items(), k
    for obj in chart.values():
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"


def test_crd_survives_upgrades_and_uninstall(helm: str) -> None:
    crd = next(o for o in template(helm) if o["kind"] == "CustomResourceDefinition")
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert crd == {**crd, "spec": yaml.safe_load((REPO / "crds" / "gpudraconfig.yaml").read_text())["spec"]}
    unkept = next(o for o in template(helm, "--set", "crds.keep=false") if o["kind"] == "CustomResourceDefinition")
    assert "annotations" not in unkept["metadata"]
    assert [o for o in template(helm, "--set", "crds.enabled=false") if o["kind"] == "CustomResourceDefinition"] == []


def test_namespaces_follow_the_values_everywhere(helm: str) -> None:
    objects = template(helm, "--set", "namespaces.operator=ops", "--set", "namespaces.agent=gpus")
    namespaced = {key(o) for o in objects if o["metadata"].get("namespace")}
    assert {k[2] for k in namespaced} == {"ops", "gpus", "default"}
    assert ("Role", "gpudra-operator-events", "default") in namespaced  # Events of cluster-scoped objects
    assert ("Role", "gpudra-operator", "gpus") in namespaced
    names = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Namespace"}
    assert names["gpus"]["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    assert names["ops"]["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    policies = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ValidatingAdmissionPolicy"}
    for name in ("gpudra-agent-resourceslices", "gpudra-agent-resourceslice-drivers"):
        assert policies[name]["spec"]["matchConditions"][0]["expression"] == (  # any namespace's agent account
            'request.userInfo.username.startsWith("system:serviceaccount:") && '
            'request.userInfo.username.endsWith(":gpudra-agent")')
    # The driver check takes each agent's namespace from the GpuDraConfigs, none from the values;
    # the claim-config check takes their driver names.
    defaults = {o["metadata"]["name"]: o for o in template(helm) if o["kind"] == "ValidatingAdmissionPolicy"}
    for name in ("gpudra-agent-resourceslice-drivers", "gpudra-claim-config"):
        assert policies[name] == defaults[name]
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    assert "--namespace=gpus" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    for binding in (o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        (subject,) = binding["subjects"]
        assert subject["namespace"] == ("gpus" if subject["name"] == "gpudra-agent" else "ops")
    external = template(helm, "--set", "namespaces.create=false")
    assert [o for o in external if o["kind"] == "Namespace"] == []


def test_operator_values(helm: str) -> None:
    objects = template(helm, "--set", "operator.image.tag=1.2.3", "--set", "operator.metricsPort=9999",
                       "--set", "operator.nodeSelector.pool=system", "--set", "operator.logFormat=plain",
                       "--set-json", 'operator.tolerations=[{"key":"k","operator":"Exists"}]',
                       "--set", "operator.resources.limits.memory=1Gi")
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "ghcr.io/gpudra/gpudra-operator:1.2.3"
    assert "--metrics-port=9999" in container["args"] and "--log-format=plain" in container["args"]
    assert {"name": "metrics", "containerPort": 9999, "protocol": "TCP"} in container["ports"]
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux", "pool": "system"}
    assert pod["tolerations"] == [{"key": "k", "operator": "Exists"}]
    assert container["resources"]["limits"]["memory"] == "1Gi"
    service = next(o for o in objects if o["kind"] == "Service")
    assert service["spec"]["ports"][0]["port"] == 9999
    digest = "sha256:" + "a" * 64
    pinned = next(o for o in template(helm, "--set", f"operator.image.digest={digest}",
                                      "--set", f"agent.image.digest={digest}") if o["kind"] == "Deployment")
    (operator,) = pinned["spec"]["template"]["spec"]["containers"]
    assert operator["image"] == f"ghcr.io/gpudra/gpudra-operator@{digest}"
    assert {"name": "GPUDRA_AGENT_IMAGE", "value": f"ghcr.io/gpudra/gpudra@{digest}"} in operator["env"]


def test_a_kustomize_overlays_images_move_the_operator_and_the_agents(tmp_path: Path) -> None:
    """An overlay's `images:` retargets both images (the README's registry step): the operator's
    container and the agent image it renders (its GPUDRA_AGENT_IMAGE, via kustomizeconfig.yaml)."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(BASE, overlay)],
        "images": [{"name": "ghcr.io/gpudra/gpudra-operator", "newName": "registry.example.com/gpudra/gpudra-operator",
                    "newTag": "1.2"},
                   {"name": "ghcr.io/gpudra/gpudra", "newName": "registry.example.com/gpudra/gpudra", "newTag": "1.2"}]}))
    out = subprocess.run([str(find_binaries() / "kubectl"), "kustomize", str(overlay)],
                         capture_output=True, text=True, check=True).stdout
    deployment = next(o for o in yaml.safe_load_all(out) if o and o["kind"] == "Deployment")
    (operator,) = deployment["spec"]["template"]["spec"]["containers"]
    assert operator["image"] == "registry.example.com/gpudra/gpudra-operator:1.2"
    env = {e["name"]: e.get("value") for e in operator["env"]}
    assert env["GPUDRA_AGENT_IMAGE"] == "registry.example.com/gpudra/gpudra:1.2"
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"  # other values untouched


def test_config_create_renders_a_valid_gpudraconfig_for_the_agent_values(helm: str) -> None:
    objects = template(helm, "--set", "config.create=true", "--set", "agent.image.tag=9.9.9",
                       "--set", "agent.nodeSelector.nvidia\\.com/gpu\\.present=true",
                       "--set", "namespaces.agent=gpus")
    (config,) = [o for o in objects if o["kind"] == "GpuDraConfig"]
    agent = config["spec"]["agent"]
    assert "image" not in agent  # the operator's GPUDRA_AGENT_IMAGE: a `helm upgrade` moves the agents
    operator = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    agent_image = next(e["value"] for e in operator["env"] if e["name"] == "GPUDRA_AGENT_IMAGE")
    assert agent_image == "ghcr.io/gpudra/gpudra:9.9.9"
    assert agent["namespace"] == "gpus"
    assert agent["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    # What the operator would make of it, through the same schema check and render as `gpudra render`.
    children, errors = render_documents([config], agent_image)
    assert errors == []
    daemonset = next(o for o in children if o["kind"] == "DaemonSet")
    assert daemonset["spec"]["template"]["spec"]["containers"][0]["image"] == "ghcr.io/gpudra/gpudra:9.9.9"
    assert daemonset["metadata"]["namespace"] == "gpus"
    assert daemonset["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert "app.kubernetes.io/instance" not in repr(children)  # Helm's tracking label stays on the CR


def test_monitoring_objects(helm: str) -> None:
    assert not [o for o in template(helm) if o["apiVersion"].startswith("monitoring.coreos.com")]
    objects = template(helm, "--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.podMonitor.enabled=true",
                       "--set", "metrics.serviceMonitor.labels.release=prom")
    monitors = {o["kind"]: o for o in objects if o["apiVersion"] == "monitoring.coreos.com/v1"}
    assert monitors["ServiceMonitor"]["spec"]["endpoints"][0]["port"] == "metrics"
    assert monitors["ServiceMonitor"]["metadata"]["labels"]["release"] == "prom"
    assert monitors["ServiceMonitor"]["spec"]["selector"]["matchLabels"] == \
        next(o for o in objects if o["kind"] == "Service")["spec"]["selector"]
    assert monitors["PodMonitor"]["metadata"]["namespace"] == "gpudra-system"
    assert monitors["PodMonitor"]["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert monitors["PodMonitor"]["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "gpudra-agent"}
    assert monitors["PodMonitor"]["spec"]["podMetricsEndpoints"][0]["honorLabels"] is True  # the claim series' pod
    assert "PrometheusRule" not in monitors
    assert not [o for o in objects if o["kind"] == "ConfigMap"]
    objects = template(helm, "--set", "metrics.prometheusRule.enabled=true", "--set", "metrics.prometheusRule.labels.release=prom",
                       "--set", "metrics.grafanaDashboard.enabled=true", "--set", "metrics.grafanaDashboard.namespace=grafana",
                       "--set", "namespaces.operator=ops")
    (rule,) = [o for o in objects if o["kind"] == "PrometheusRule"]
    assert rule["metadata"]["namespace"] == "ops" and rule["metadata"]["labels"]["release"] == "prom"
    (dashboard,) = [o for o in objects if o["kind"] == "ConfigMap"]
    assert dashboard["metadata"]["namespace"] == "grafana"
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_the_monitoring_objects_render_as_the_kustomize_folder_has_them(helm: str) -> None:
    """With everything on, the chart renders manifests/monitoring/'s objects (kubectl kustomize):
    the monitors, the PrometheusRule (from the chart's copy of the file) and the dashboard's
    ConfigMap, equal but for Helm's labels; the alerts' Prometheus templates pass through as text."""
    out = subprocess.run([str(find_binaries() / "kubectl"), "kustomize", str(MONITORING)],
                         check=True, capture_output=True, text=True).stdout
    base = by_key([d for d in yaml.safe_load_all(out) if d])
    assert sorted(k[0] for k in base) == ["ConfigMap", "PodMonitor", "PrometheusRule", "ServiceMonitor"]
    chart = by_key(template(helm, *(arg for name in ("serviceMonitor", "podMonitor", "prometheusRule", "grafanaDashboard")
                                    for arg in ("--set", f"metrics.{name}.enabled=true"))))
    assert {k for k, o in chart.items() if o["apiVersion"].startswith("monitoring.coreos.com")} == \
        {k for k, o in base.items() if o["apiVersion"].startswith("monitoring.coreos.com")}
    for k, obj in base.items():
        assert without_metadata_decoration(chart[k]) == without_metadata_decoration(obj), k
        assert chart[k]["metadata"].get("labels", {}).items() >= obj["metadata"].get("labels", {}).items(), k
    rule = chart[("PrometheusRule", "gpudra", "gpudra-operator")]
    assert "{{ $labels.node }}" in rule["spec"]["groups"][0]["rules"][0]["annotations"]["summary"]
    dashboard = chart[("ConfigMap", "gpudra-grafana-dashboard", "gpudra-operator")]
    assert dashboard["data"]["gpudra.json"] == (MONITORING / "grafana-dashboard.json").read_text()


def test_admission_policies_can_be_disabled(helm: str) -> None:
    def policies(*args: str) -> set[tuple[str, str]]:
        return {(o["kind"], o["metadata"]["name"]) for o in template(helm, *args)
                if o["kind"].startswith("ValidatingAdmissionPolicy")}

    agent = {(kind, name) for kind in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
             for name in ("gpudra-agent-resourceslices", "gpudra-agent-resourceslice-drivers",
                          "gpudra-agent-resourceclaim-status")}
    claims = {("ValidatingAdmissionPolicy", "gpudra-claim-config"),
              ("ValidatingAdmissionPolicyBinding", "gpudra-claim-config")}
    assert policies() == agent | claims
    assert policies("--set", "agent.admissionPolicy.enabled=false") == claims
    assert policies("--set", "claimConfigPolicy.enabled=false") == agent


def test_the_crd_defaults_the_agent_namespace_to_the_releases(helm: str) -> None:
    """A GpuDraConfig written by hand that leaves spec.agent.namespace out lands where this
    release's RBAC, admission policy and operator --namespace point (not the base's gpudra-system)."""
    def agent_namespace_default(*args: str) -> str:
        (crd,) = [o for o in template(helm, *args) if o["kind"] == "CustomResourceDefinition"]
        (version,) = crd["spec"]["versions"]
        return version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["agent"]["properties"][
            "namespace"]["default"]

    assert agent_namespace_default() == "gpudra-system"
    assert agent_namespace_default("--set", "namespaces.agent=gpus") == "gpus"
    deployment = next(o for o in template(helm, "--set", "namespaces.agent=gpus") if o["kind"] == "Deployment")
    assert "--namespace=gpus" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_agents_network_policy_follows_its_values(helm: str) -> None:
    peers = '[{"namespaceSelector":{"matchLabels":{"kubernetes.io/metadata.name":"monitoring"}}}]'
    objects = template(helm, "--set", "namespaces.agent=gpus", "--set-json", f"agent.networkPolicy.metricsFrom={peers}")
    (policy,) = [o for o in objects if o["kind"] == "NetworkPolicy"]
    assert policy["metadata"]["namespace"] == "gpus"
    assert policy["spec"]["ingress"][0]["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    assert not [o for o in template(helm, "--set", "agent.networkPolicy.enabled=false") if o["kind"] == "NetworkPolicy"]


# -- values.schema.json ------------------------------------------------------------------------------

SCHEMA_PATH = CHART / "values.schema.json"
VALUES_PATH = CHART / "values.yaml"


def values_schema() -> Obj:
    return dict(json.loads(SCHEMA_PATH.read_text()))


def resolve(schema: Obj, node: Obj) -> tuple[Obj, str | None]:
    """The node behind a local $ref (followed to the end), and the last reference followed."""
    ref = None
    while "$ref" in node:
        ref = node["$ref"]
        assert ref.startswith("#/"), f"{ref}: only references inside values.schema.json (Helm resolves others on disk)"
        node = schema
        for part in ref[2:].split("/"):
            node = node[part]
    return node, ref


def declared_values(schema: Obj, node: Obj, values: Any, path: str) -> Iterator[tuple[str, Obj, Any]]:
    """(path, schema node, value) for every value of values.yaml the chart's own part of the schema
    declares one by one (not the free-form maps, nor what the CRD's schema describes)."""
    node, ref = resolve(schema, node)
    yield path, node, values
    if ref and ref.startswith("#/definitions/gpuDraConfigSpec"):
        return  # the CRD's schema, copied whole (test_the_schema_holds_the_crds_spec_schema)
    if "properties" in node:
        assert isinstance(values, dict), f"{path}: the schema declares properties, values.yaml has {values!r}"
        assert node.get("additionalProperties") is False, f"{path}: a misspelled key would pass (additionalProperties)"
        assert sorted(values) == sorted(node["properties"]), \
            f"{path}: values.yaml's keys {sorted(values)} differ from the schema's {sorted(node['properties'])}"
        for key, value in values.items():
            yield from declared_values(schema, node["properties"][key], value, f"{path}.{key}".lstrip("."))


def test_every_value_in_values_yaml_is_in_the_schema_and_no_other() -> None:
    """values.yaml and values.schema.json cannot drift: each section's keys are the schema's
    (which refuses any other), and each value has a type (or an enum, or a reference) there."""
    schema = values_schema()
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema)
    declared = list(declared_values(schema, schema, yaml.safe_load(VALUES_PATH.read_text()), ""))
    for path, node, _ in declared:
        assert {"type", "enum", "const", "anyOf"} & node.keys(), f"{path}: no type in the schema"
    assert {"operator.replicas", "operator.logFormat", "operator.image.digest", "agent.drivers", "config.spec",
            "metrics.podMonitor.interval", "namespaces.agent"} <= {path for path, _, _ in declared}
    # The defaults pass the schema as Helm reads it (draft-07), not just through Helm.
    assert list(jsonschema.Draft7Validator(schema).iter_errors(yaml.safe_load(VALUES_PATH.read_text()))) == []


def test_the_schema_holds_the_crds_spec_schema() -> None:
    """config.spec (and the agent's and operator's tolerations and resources) are checked against the
    GpuDraConfig CRD's own spec schema, copied in by make chart-schema and kept equal here."""
    crd = yaml.safe_load((REPO / "crds" / "gpudraconfig.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    assert values_schema()["definitions"]["gpuDraConfigSpec"] == version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    check = subprocess.run([sys.executable, str(REPO / "hack" / "chart-schema.py"), "--check"],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr  # and in its canonical form, so make chart-schema changes nothing else


# (what is set, the value the error must name). Helm's schema errors read "- at '/operator/replicas': ...".
BAD_VALUES = [
    (["--set", "operator.replicas=0"], "'/operator/replicas'"),
    (["--set", "operator.replicas=two"], "'/operator/replicas'"),
    (["--set", "operator.logFormat=xml"], "'/operator/logFormat'"),
    (["--set", "operater.replicas=2"], "'operater'"),
    (["--set", "operator.image.tagg=1.2.3"], "'tagg'"),
    (["--set", "operator.image.pullPolicy=Sometimes"], "'/operator/image/pullPolicy'"),
    (["--set", "agent.image.digest=sha256:abc"], "'/agent/image/digest'"),
    (["--set", "operator.metricsPort=70000"], "'/operator/metricsPort'"),
    (["--set", "operator.livenessPort=0"], "'/operator/livenessPort'"),
    (["--set-json", "agent.drivers=[]"], "'/agent/drivers'"),
    (["--set", "namespaces.agent=GPU_System"], "'/namespaces/agent'"),
    (["--set", "metrics.podMonitor.interval=soon"], "'/metrics/podMonitor/interval'"),
    (["--set", "metrics.serviceMonitor.enabled=yes"], "'/metrics/serviceMonitor/enabled'"),
    (["--set", "operator.resources.limits.memory=lots"], "'/operator/resources/limits/memory'"),
    (["--set-json", 'operator.tolerations=[{"operator":"Sometimes"}]'], "'/operator/tolerations/0/operator'"),
    (["--set", "config.spec.deviceClasses[0].template=everything"], "'/config/spec/deviceClasses/0/template'"),
    (["--set", "uninstall.timeoutSeconds=0"], "'/uninstall/timeoutSeconds'"),
]


def refusal(command: list[str], args: list[str], named: str) -> str | None:
    """Why the command's answer to a bad value falls short (None: refused, naming the value)."""
    result = subprocess.run([*command, *args], capture_output=True, text=True, timeout=60)
    output = result.stdout + result.stderr
    if result.returncode == 0:
        return f"{' '.join(command[1:3])} {' '.join(args)} passed:\n{output}"
    if "values don't meet the specifications of the schema" not in output or named not in output:
        return f"{' '.join(command[1:3])} {' '.join(args)}: {named} not named as a schema error in:\n{output}"
    return None


@pytest.mark.parametrize(("args", "named"), BAD_VALUES, ids=[" ".join(a) for a, _ in BAD_VALUES])
def test_a_bad_value_is_refused_naming_it(helm: str, args: list[str], named: str) -> None:
    """By helm template and helm lint alike."""
    for command in ([helm, "template", "gpudra", str(CHART), "--kube-version", KUBE_VERSION],
                    [helm, "lint", str(CHART), "--strict", "--kube-version", KUBE_VERSION]):
        assert (problem := refusal(command, args, named)) is None, problem


@pytest.mark.cluster
def test_helm_install_refuses_each_bad_value_before_creating_anything(helm: str, cluster: ControlPlane) -> None:
    """helm install checks the values after reaching the API server (so: a real one) and before
    it creates a thing; --dry-run=client besides, so that a schema letting one through creates nothing."""
    install = [helm, "install", "gpudra-schema-check", str(CHART), "--dry-run=client",
               "--kubeconfig", str(cluster.kubeconfig), "--namespace", "default"]
    problems = [problem for args, named in BAD_VALUES if (problem := refusal(install, args, named))]
    assert problems == []
    # Without the CRD: the session's other tests share one that no release owns, which helm would
    # refuse to adopt after the values passed.
    good = subprocess.run([*install, "--set", "crds.enabled=false"], capture_output=True, text=True, timeout=60)
    assert good.returncode == 0 and "STATUS: pending-install" in good.stdout, good.stdout + good.stderr


def test_good_values_that_look_unusual_pass(helm: str) -> None:
    """The schema refuses no value the chart handles: a digest, a boolean node label for the agents
    (written as a string), a numeric quantity, a second driver, a dashboard namespace."""
    objects = template(helm, "--set", "operator.image.digest=sha256:" + "0" * 64, "--set", "config.create=true",
                       "--set", "agent.nodeSelector.nvidia\\.com/gpu\\.present=true", "--set", "operator.resources.requests.cpu=1",
                       "--set-json", 'agent.drivers=["gpu.gpudra.io","mig.gpudra.io"]', "--set", "operator.replicas=1",
                       "--set", "metrics.grafanaDashboard.namespace=grafana", "--set", "metrics.podMonitor.interval=1m30s")
    assert next(o for o in objects if o["kind"] == "Deployment")["spec"]["replicas"] == 1


def test_the_uninstall_hook_runs_gpudra_uninstall_before_anything_is_deleted(helm: str) -> None:
    """A pre-delete Job in the operator image with its own least-privilege ServiceAccount, restricted
    like the operator, deleted once it succeeded and kept when it failed (for its log);
    uninstall.force and timeoutSeconds reach its arguments; uninstall.enabled=false renders none.
    What it does: tests/integration/test_uninstall.py."""
    hook = [o for o in template(helm, "--set", "namespaces.operator=ops", "--set", "namespaces.agent=gpus")
            if o["metadata"]["name"] == "gpudra-uninstall"]
    assert sorted(o["kind"] for o in hook) == ["ClusterRole", "ClusterRoleBinding", "Job", "ServiceAccount"]
    for obj in hook:
        annotations = obj["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == "pre-delete"
        assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
        assert int(annotations["helm.sh/hook-weight"]) == (0 if obj["kind"] == "Job" else -10)  # RBAC first
    kinds = {o["kind"]: o for o in hook}
    assert kinds["ClusterRole"]["rules"] == [
        {"apiGroups": ["gpudra.io"], "resources": ["gpudraconfigs"], "verbs": ["list", "delete"]},
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["list"]},
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"], "verbs": ["list"]}]
    assert kinds["ClusterRoleBinding"]["subjects"] == [{"kind": "ServiceAccount", "name": "gpudra-uninstall",
                                                        "namespace": "ops"}]
    job = kinds["Job"]
    assert job["metadata"]["namespace"] == "ops" and job["spec"]["backoffLimit"] == 0
    pod = job["spec"]["template"]["spec"]
    operator = next(o for o in template(helm) if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == operator["containers"][0]["image"]  # the image whose entrypoint is gpudra
    assert container["args"] == ["uninstall", "--agent-namespace=gpus", "--timeout=240"]
    assert pod["serviceAccountName"] == "gpudra-uninstall" and pod["restartPolicy"] == "Never"
    assert pod["securityContext"] == operator["securityContext"]  # Pod Security restricted, as the operator
    assert container["securityContext"] == operator["containers"][0]["securityContext"]
    assert job["spec"]["activeDeadlineSeconds"] == 270  # past the command's own wait, which then reports
    forced = next(o for o in template(helm, "--set", "uninstall.force=true", "--set", "uninstall.timeoutSeconds=60")
                  if o["kind"] == "Job" and o["metadata"]["name"] == "gpudra-uninstall")
    assert forced["spec"]["template"]["spec"]["containers"][0]["args"][-2:] == ["--timeout=60", "--force"]
    assert not [o for o in template(helm, "--set", "uninstall.enabled=false") if o["metadata"]["name"] == "gpudra-uninstall"]
