"""render(config): the agent DaemonSet a DRA kubelet plugin needs, one DeviceClass per spec entry,
owner references and labels on every child, and nothing of the CR's own metadata leaking."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpudra_operator.render import (AGENT_NAME, DRIVER_ROOT_MOUNT, child_labels, child_selector,
                                    render)

UID = "0b5b0f5e-1111-2222-3333-444455556666"
OWNER = {"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig", "name": "default", "uid": UID,
         "controller": True, "blockOwnerDeletion": True}
CHILD_LABELS = {"app.kubernetes.io/managed-by": "gpudra-operator", "gpudra.io/config": "default"}


def config(spec: dict[str, Any] | None = None, **meta: Any) -> dict[str, Any]:
    return {"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig",
            "metadata": {"name": "default", "uid": UID, "generation": 2, **meta},
            "spec": spec if spec is not None else {
                "deviceClasses": [{"name": "gpu.gpudra.io", "template": "all"},
                                  {"name": "mig.gpudra.io", "template": "mig"}]}}


def container(ds: dict[str, Any]) -> dict[str, Any]:
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    return c


def test_objects_are_the_daemonset_then_the_classes_in_spec_order() -> None:
    rendered = render(config())
    assert rendered.errors == []
    assert [(o["kind"], o["metadata"]["name"]) for o in rendered.objects] == [
        ("DaemonSet", "gpudra-agent"), ("DeviceClass", "gpu.gpudra.io"), ("DeviceClass", "mig.gpudra.io")]
    assert rendered.daemonset is rendered.objects[0]
    assert [o["metadata"]["name"] for o in rendered.device_classes] == ["gpu.gpudra.io", "mig.gpudra.io"]


def test_every_child_is_owned_and_labelled() -> None:
    for obj in render(config()).objects:
        assert obj["metadata"]["ownerReferences"] == [OWNER]
        assert obj["metadata"]["labels"].items() >= CHILD_LABELS.items()
    assert child_labels("default") == CHILD_LABELS
    assert child_selector("default") == "app.kubernetes.io/managed-by=gpudra-operator,gpudra.io/config=default"


def test_cr_labels_and_annotations_never_reach_children() -> None:
    body = config(labels={"app.kubernetes.io/instance": "argocd-app", "team": "ml"},
                  annotations={"argocd.argoproj.io/tracking-id": "x", "kubectl.kubernetes.io/last-applied-configuration": "{}"})
    for obj in render(body).objects:
        text = repr(obj)
        for leaked in ("argocd", "team", "last-applied", "app.kubernetes.io/instance"):
            assert leaked not in text, f"{obj['kind']} carries {leaked}"


def test_without_uid_no_owner_reference() -> None:
    body = config()
    del body["metadata"]["uid"]
    for obj in render(body).objects:
        assert "ownerReferences" not in obj["metadata"]
        assert obj["metadata"]["labels"].items() >= CHILD_LABELS.items()


def test_daemonset_defaults() -> None:
    ds = render(config()).daemonset
    assert ds is not None
    assert (ds["apiVersion"], ds["kind"]) == ("apps/v1", "DaemonSet")
    assert ds["metadata"]["name"] == AGENT_NAME and ds["metadata"]["namespace"] == "gpudra-system"
    labels = {"app.kubernetes.io/name": "gpudra-agent", **CHILD_LABELS}
    assert ds["metadata"]["labels"] == labels
    assert ds["spec"]["selector"] == {"matchLabels": {"app.kubernetes.io/name": "gpudra-agent",
                                                      "gpudra.io/config": "default"}}
    template = ds["spec"]["template"]
    assert template["metadata"]["labels"] == labels
    assert ds["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    assert ds["spec"]["updateStrategy"] == {"type": "RollingUpdate",
                                            "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    pod = template["spec"]
    assert pod["serviceAccountName"] == "gpudra-agent"
    assert pod["priorityClassName"] == "system-node-critical"
    for absent in ("nodeSelector", "tolerations"):
        assert absent not in pod
    # GPU nodes by any of NFD's PCI label, GFD's label, or gpudra's hand label (terms are ORed)
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": key, "operator": "In", "values": ["true"]}]} for key in (
        "feature.node.kubernetes.io/pci-10de.present", "nvidia.com/gpu.present", "gpudra.io/gpu-node")]
    c = container(ds)
    assert c["name"] == "agent" and c["image"] == "ghcr.io/gpudra/gpudra:0.1.0"  # the operator's default
    assert c["imagePullPolicy"] == "IfNotPresent"
    assert c["command"] == ["gpudra"]
    assert c["args"] == ["agent", "--driver", "gpu.gpudra.io", "--kubelet-dir", "/var/lib/kubelet",
                         "--cdi-dir", "/var/run/cdi", "--driver-root", "/",
                         "--container-driver-root", "/driver-root", "--host-dev", "/host-dev", "--metrics-port", "8082",
                         "--health-port", "8083"]
    assert c["ports"] == [{"name": "metrics", "containerPort": 8082, "protocol": "TCP"},
                          {"name": "health", "containerPort": 8083, "protocol": "TCP"}]
    assert c["securityContext"] == {"privileged": True}
    assert "resources" not in c


def test_downward_api_env() -> None:
    env = {e["name"]: e for e in container(render(config()).daemonset)["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # an NVIDIA runtime in legacy mode must not hand the agent every GPU and the driver's libraries
    assert env["NVIDIA_VISIBLE_DEVICES"] == {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}


def test_host_paths_a_kubelet_plugin_needs() -> None:
    ds = render(config({"driverName": "gpu.example.com",
                        "agent": {"kubeletDir": "/data/kubelet", "cdiDir": "/etc/cdi",
                                  "driverRoot": "/run/nvidia/driver"}})).daemonset
    volumes = {v["name"]: v["hostPath"] for v in ds["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["name"]: m for m in container(ds)["volumeMounts"]}
    assert set(volumes) == set(mounts)
    assert volumes["plugins-registry"] == {"path": "/data/kubelet/plugins_registry", "type": "DirectoryOrCreate"}
    assert volumes["plugin"] == {"path": "/data/kubelet/plugins/gpu.example.com", "type": "DirectoryOrCreate"}
    assert volumes["cdi"] == {"path": "/etc/cdi", "type": "DirectoryOrCreate"}
    assert volumes["driver-root"] == {"path": "/run/nvidia/driver", "type": "Directory"}
    # the host's live /dev, where device nodes are checked when the driver root has none
    assert volumes["host-dev"] == {"path": "/dev", "type": "Directory"}
    assert mounts["host-dev"] == {"name": "host-dev", "mountPath": "/host-dev", "readOnly": True,
                                  "mountPropagation": "HostToContainer"}
    # Sockets live at the same path inside and outside: the kubelet dials host paths.
    assert mounts["plugins-registry"]["mountPath"] == "/data/kubelet/plugins_registry"
    assert mounts["plugin"]["mountPath"] == "/data/kubelet/plugins/gpu.example.com"
    assert mounts["cdi"]["mountPath"] == "/etc/cdi"
    assert mounts["driver-root"] == {"name": "driver-root", "mountPath": DRIVER_ROOT_MOUNT, "readOnly": True,
                                     "mountPropagation": "HostToContainer"}
    for name in ("plugins-registry", "cdi"):  # writable, private
        assert "readOnly" not in mounts[name] and "mountPropagation" not in mounts[name]
    # writable; the MPS supervisor's tmpfs under mps/ are unmounted on the host: no private copy keeps one
    assert "readOnly" not in mounts["plugin"] and mounts["plugin"]["mountPropagation"] == "HostToContainer"
    args = container(ds)["args"]
    assert args[args.index("--driver") + 1] == "gpu.example.com"
    assert args[args.index("--kubelet-dir") + 1] == "/data/kubelet"
    assert args[args.index("--cdi-dir") + 1] == "/etc/cdi"
    assert args[args.index("--driver-root") + 1] == "/run/nvidia/driver"  # CDI host paths start there
    assert args[args.index("--container-driver-root") + 1] == DRIVER_ROOT_MOUNT  # the agent reads it there


def test_agent_settings_flow_into_the_pod() -> None:
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]}}}
    ds = render(config({"agent": {
        "image": "registry.local/gpudra:dev", "imagePullPolicy": "Always", "namespace": "gpus",
        "nodeSelector": {"nvidia.com/gpu.present": "true"}, "affinity": affinity,
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": 268435456}},
        "priorityClassName": "gpu-critical", "updateStrategy": {"maxUnavailable": "10%", "maxSurge": 0},
        "extraArgs": ["--v=4"], "extraEnv": [{"name": "GPUDRA_DEBUG", "value": "1"}],
    }})).daemonset
    pod = ds["spec"]["template"]["spec"]
    assert ds["metadata"]["namespace"] == "gpus"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["affinity"] == affinity
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["priorityClassName"] == "gpu-critical"
    assert ds["spec"]["updateStrategy"]["rollingUpdate"] == {"maxUnavailable": "10%", "maxSurge": 0}
    c = container(ds)
    assert c["image"] == "registry.local/gpudra:dev" and c["imagePullPolicy"] == "Always"
    assert c["resources"] == {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": 268435456}}
    assert c["args"][:2] == ["agent", "--driver"]
    assert c["args"].index("--v=4") > c["args"].index("--metrics-port")  # extraArgs can move the metrics port
    assert c["env"][-1] == {"name": "GPUDRA_DEBUG", "value": "1"}
    assert [e["name"] for e in c["env"]][:3] == ["NODE_NAME", "POD_UID", "POD_NAMESPACE"]
    # Plain, mutable JSON data (no mappingproxy/tuple from the frozen spec view).
    assert type(pod["affinity"]) is dict and type(pod["tolerations"]) is list
    pod["tolerations"].append({})  # must not raise


def test_the_agent_process_env_is_set_and_extra_env_overrides_it_without_duplicates() -> None:
    env = container(render(config({})).daemonset)["env"]
    assert {"name": "SSL_CERT_FILE", "value": "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"} in env
    assert {"name": "PYTHONOPTIMIZE", "value": "2"} in env  # no docstrings in memory (docs/agent.md, "Footprint")
    assert "MALLOC_ARENA_MAX" not in [e["name"] for e in env]  # glibc's default (docs/agent.md, "Footprint")
    override = {"agent": {"extraEnv": [{"name": "SSL_CERT_FILE", "value": "/etc/ssl/certs/ca-certificates.crt"},
                                       {"name": "PYTHONOPTIMIZE", "value": "0"},
                                       {"name": "MALLOC_ARENA_MAX", "value": "4"}]}}
    env = container(render(config(override)).daemonset)["env"]
    names = [e["name"] for e in env]
    assert len(names) == len(set(names))  # env is a list keyed by name: a duplicate fails the apply
    assert {"name": "SSL_CERT_FILE", "value": "/etc/ssl/certs/ca-certificates.crt"} in env
    assert {"name": "PYTHONOPTIMIZE", "value": "0"} in env
    assert {"name": "MALLOC_ARENA_MAX", "value": "4"} in env and "NVIDIA_VISIBLE_DEVICES" in names


def test_empty_priority_class_is_omitted() -> None:
    pod = render(config({"agent": {"priorityClassName": ""}})).daemonset["spec"]["template"]["spec"]
    assert "priorityClassName" not in pod


def test_device_class_content() -> None:
    (cls,) = render(config({"deviceClasses": [
        {"name": "gpu-64gi.gpudra.io", "template": "min-memory", "parameters": {"memory": "64Gi"}}]})).device_classes
    assert cls == {
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
        "metadata": {"name": "gpu-64gi.gpudra.io", "labels": CHILD_LABELS, "ownerReferences": [OWNER]},
        "spec": {"selectors": [{"cel": {"expression":
            'device.driver == "gpu.gpudra.io" && '
            'device.capacity["gpu.gpudra.io"].memory.compareTo(quantity("64Gi")) >= 0'}}]},
    }


def test_template_labels_are_kept_but_ours_win() -> None:
    inline = ("apiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata:\n"
              "  labels: {team: ml, gpudra.io/config: hijack}\n  annotations: {note: hi}\n"
              "spec:\n  selectors:\n  - cel:\n      expression: {{ driver_match | yaml_string }}\n")
    (cls,) = render(config({"deviceClasses": [{"name": "x.gpudra.io", "inline": inline}]})).device_classes
    assert cls["metadata"]["labels"] == {"team": "ml", **CHILD_LABELS}
    assert cls["metadata"]["annotations"] == {"note": "hi"}


def test_a_bad_class_is_an_error_and_the_rest_still_render() -> None:
    rendered = render(config({"deviceClasses": [
        {"name": "a.gpudra.io", "template": "all"},
        {"name": "b.gpudra.io", "inline": "{{ ''.__class__.__mro__ }}"},
        {"name": "c.gpudra.io", "template": "full-gpu"}]}))
    assert [o["metadata"]["name"] for o in rendered.device_classes] == ["a.gpudra.io", "c.gpudra.io"]
    assert rendered.failed_classes == ["b.gpudra.io"]
    assert rendered.daemonset is not None


def test_render_is_pure_and_deterministic() -> None:
    body = config()
    snapshot = repr(body)
    assert render(body).objects == render(body).objects
    assert repr(body) == snapshot


def test_paths_are_joined_without_doubled_slashes() -> None:
    ds = render(config({"agent": {"kubeletDir": "/var/lib/kubelet/"}})).daemonset
    paths = [v["hostPath"]["path"] for v in ds["spec"]["template"]["spec"]["volumes"]]
    assert all("//" not in p for p in paths), paths


def test_agent_is_ready_only_once_registered_and_published() -> None:
    container = render(config()).daemonset["spec"]["template"]["spec"]["containers"][0]
    ready_file = next(e["value"] for e in container["env"] if e["name"] == "GPUDRA_READY_FILE")
    assert container["readinessProbe"]["exec"]["command"] == ["test", "-f", ready_file]


def test_agent_liveness_asks_the_port_and_service_the_agent_serves() -> None:
    """The probes dial what `gpudra agent --health-port` serves (service 'liveness', see
    gpudra_driver.plugin.liveness); start-up has its own, longer budget."""
    from gpudra_driver.plugin.liveness import CHECK_TIMEOUT, SERVICES

    c = container(render(config()).daemonset)
    port = int(c["args"][c["args"].index("--health-port") + 1])
    assert {"name": "health", "containerPort": port, "protocol": "TCP"} in c["ports"]
    for probe in ("startupProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == port and c[probe]["grpc"]["service"] in SERVICES
    startup, liveness = c["startupProbe"], c["livenessProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    for probe in (startup, liveness):  # a check dials up to two sockets, each within CHECK_TIMEOUT
        assert probe["timeoutSeconds"] > 2 * CHECK_TIMEOUT
    assert liveness["failureThreshold"] >= 3


def test_extra_args_cannot_move_the_port_the_probes_dial() -> None:
    c = container(render(config({"agent": {"extraArgs": ["--health-port=9999", "--log-format=json"]}})).daemonset)
    assert c["args"][-2:] == ["--health-port", str(c["livenessProbe"]["grpc"]["port"])]  # argparse: last wins
    assert "--log-format=json" in c["args"]



def test_the_agent_image_is_the_operators_unless_the_spec_pins_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpudra_operator.render import DEFAULT_AGENT_IMAGE, configured_agent_image

    assert container(render(config()).daemonset)["image"] == DEFAULT_AGENT_IMAGE
    assert container(render(config(), agent_image="registry.example.com/gpudra:1.2").daemonset)["image"] == \
        "registry.example.com/gpudra:1.2"
    pinned = config({"agent": {"image": "registry.local/gpudra:dev"}})
    assert container(render(pinned, agent_image="registry.example.com/gpudra:1.2").daemonset)["image"] == \
        "registry.local/gpudra:dev"
    monkeypatch.setenv("GPUDRA_AGENT_IMAGE", "mirror.local/gpudra/gpudra:1.2")
    assert configured_agent_image() == "mirror.local/gpudra/gpudra:1.2"
    monkeypatch.delenv("GPUDRA_AGENT_IMAGE")
    assert configured_agent_image() == DEFAULT_AGENT_IMAGE == "ghcr.io/gpudra/gpudra:0.1.0"


def test_a_node_selector_or_an_affinity_replaces_the_gpu_node_default_and_empty_affinity_opts_out() -> None:
    def pod(agent: dict[str, Any]) -> dict[str, Any]:
        return render(config({"agent": agent})).daemonset["spec"]["template"]["spec"]  # type: ignore[index]

    assert "affinity" not in pod({"nodeSelector": {"pool": "gpu"}})
    assert pod({"nodeSelector": {"pool": "gpu"}})["nodeSelector"] == {"pool": "gpu"}
    own = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}
    assert pod({"affinity": own})["affinity"] == own
    assert "affinity" not in pod({"affinity": {}}) and "nodeSelector" not in pod({"affinity": {}})



def test_an_extended_resource_name_goes_into_its_device_class() -> None:
    rendered = render(config({"deviceClasses": [
        {"name": "gpu.gpudra.io", "template": "all", "extendedResourceName": "nvidia.com/gpu"},
        {"name": "mig.gpudra.io", "template": "mig"}]}))
    classes = {c["metadata"]["name"]: c["spec"] for c in rendered.device_classes}
    assert classes["gpu.gpudra.io"]["extendedResourceName"] == "nvidia.com/gpu"
    assert "extendedResourceName" not in classes["mig.gpudra.io"]


def test_consumable_capacity_reaches_the_agents_as_flags_unless_the_api_server_drops_it() -> None:
    from gpudra_core import consumable
    from gpudra_driver import agent_cmd
    import argparse

    plain = container(render(config()).daemonset)["args"]
    assert not any(a.startswith("--consumable") for a in plain)
    shared = config({"sharing": {"consumableCapacity": {"memoryStep": "512Mi", "shares": 4}}})
    args = container(render(shared).daemonset)["args"]
    assert args[args.index("--consumable-memory-step"):][:4] == [
        "--consumable-memory-step", "512Mi", "--consumable-shares", "4"]
    assert container(render(shared, consumable_capacity=False).daemonset)["args"] == plain
    no_shares = container(render(config({"sharing": {"consumableCapacity": {"memoryStep": "1Gi"}}})).daemonset)["args"]
    assert "--consumable-memory-step" in no_shares and "--consumable-shares" not in no_shares
    # what the agent makes of them
    parser = argparse.ArgumentParser(prog="gpudra")
    agent_cmd.add_parser(parser.add_subparsers())
    parsed = parser.parse_args(args)
    assert consumable.from_args(parsed) == consumable.ConsumableCapacity(512 * 2**20, 4)


def test_spec_mig_mode_reaches_the_agents_as_a_flag() -> None:
    from gpudra_driver import agent_cmd
    from gpudra_operator.spec import SpecError
    import argparse

    plain = container(render(config()).daemonset)["args"]
    assert "--mig" not in plain  # static: the agent's default
    assert container(render(config({"mig": {"mode": "static"}})).daemonset)["args"] == plain
    args = container(render(config({"mig": {"mode": "dynamic"}})).daemonset)["args"]
    assert args[args.index("--mig"):][:2] == ["--mig", "dynamic"]
    parser = argparse.ArgumentParser(prog="gpudra")
    agent_cmd.add_parser(parser.add_subparsers())
    assert parser.parse_args(args).mig == "dynamic"
    with pytest.raises(SpecError, match=r"spec.mig.mode.*must be one of whole, static, dynamic, not 'auto'"):
        render(config({"mig": {"mode": "auto"}}))


def test_mig_node_groups_reach_the_agents_and_each_node_resolves_its_own_mode() -> None:
    from gpudra_core.migpolicy import MigPolicy
    from gpudra_driver import agent_cmd
    import argparse

    groups = [{"name": "training", "mode": "dynamic", "nodeSelector": {"gpudra.io/mig": "dynamic"}},
              {"name": "inference", "mode": "whole", "nodeSelector": {"pool": "inference", "zone": "a"}}]
    args = container(render(config({"mig": {"mode": "static", "nodeGroups": groups}})).daemonset)["args"]
    assert "--mig" not in args  # static stays the agent's default
    assert [args[i + 1] for i, a in enumerate(args) if a == "--mig-node-group"] == [
        "training:dynamic:gpudra.io/mig=dynamic", "inference:whole:pool=inference,zone=a"]
    parser = argparse.ArgumentParser(prog="gpudra")
    agent_cmd.add_parser(parser.add_subparsers())
    parsed = parser.parse_args(args)
    policy = MigPolicy(parsed.mig, tuple(parsed.mig_node_group))
    assert str(policy.for_labels({"gpudra.io/mig": "dynamic", "pool": "inference", "zone": "a"})) == \
        "dynamic (node group training)"  # the first match wins
    assert str(policy.for_labels({"pool": "inference", "zone": "a"})) == "whole (node group inference)"
    assert str(policy.for_labels({"pool": "inference", "zone": "b"})) == "static (the default)"


@pytest.mark.parametrize(("groups", "error"), [
    ([{"name": "a", "mode": "dynamic", "nodeSelector": {}}], r"nodeGroups\[0\]: .*needs 1 to 8 labels"),
    ([{"name": "A_b", "mode": "dynamic", "nodeSelector": {"k": "v"}}], r"nodeGroups\[0\]: .*must be a DNS label"),
    ([{"name": "a", "mode": "auto", "nodeSelector": {"k": "v"}}], r"nodeGroups\[0\]: .*not 'auto'"),
    ([{"name": "a", "mode": "whole", "nodeSelector": {"k:x": "v"}}], r"nodeGroups\[0\]: .*not a valid label"),
    ([{"name": "a", "mode": "whole", "nodeSelector": {"k": "v"}}] * 2, r"spec.mig.nodeGroups: .*must be unique"),
])
def test_bad_mig_node_groups_are_refused_with_the_field(groups: list[Any], error: str) -> None:
    from gpudra_operator.spec import SpecError

    with pytest.raises(SpecError, match=error):
        render(config({"mig": {"nodeGroups": groups}}))


def test_a_class_may_select_shared_gpus_with_cel() -> None:
    inline = ('apiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata:\n  name: {{ name }}\nspec:\n'
              '  selectors:\n  - cel:\n      expression: {{ (driver_match ~ " && device.allowMultipleAllocations")'
              ' | yaml_string }}\n')
    rendered = render(config({"deviceClasses": [{"name": "shared.gpudra.io", "inline": inline}]}))
    assert rendered.errors == []
    (cls,) = rendered.device_classes
    assert cls["spec"]["selectors"][0]["cel"]["expression"] == \
        'device.driver == "gpu.gpudra.io" && device.allowMultipleAllocations'


def test_spec_sharing_mps_adds_the_mps_supervisor_placed_like_the_agents() -> None:
    from gpudra_driver.plugin.sharing.mps import supervisor as mpssupervisor
    assert render(config()).mps_daemonset is None
    placement = {"nodeSelector": {"pool": "gpu"}, "tolerations": [{"operator": "Exists"}]}
    rendered = render(config({"sharing": {"mps": {}}, "agent": {"image": "reg/gpudra:1", **placement}}))
    assert [o["metadata"]["name"] for o in rendered.objects if o["kind"] == "DaemonSet"] == ["gpudra-agent",
                                                                                             "gpudra-mps"]
    assert rendered.daemonset is rendered.objects[0]
    mps, agent = rendered.mps_daemonset, rendered.daemonset
    assert mps is not None and agent is not None
    pod = mps["spec"]["template"]["spec"]
    assert mps["spec"]["updateStrategy"] == {"type": "OnDelete"}  # never rolled with the agents
    assert pod["nodeSelector"] == agent["spec"]["template"]["spec"]["nodeSelector"]
    assert pod["tolerations"] == agent["spec"]["template"]["spec"]["tolerations"]
    assert container(mps)["image"] == container(agent)["image"] == "reg/gpudra:1"
    assert "serviceAccountName" not in pod and pod["automountServiceAccountToken"] is False
    # of the plugin directory only mps/, at the host's path (CDI gives containers its directories by
    # that path), its tmpfs mounts propagated to the host; no checkpoint, no kubelet socket
    agent_mounts = {m["name"]: m["mountPath"] for m in container(agent)["volumeMounts"]}
    mps_dir = agent_mounts["plugin"] + "/mps"
    assert container(mps)["volumeMounts"][0] == {"name": "mps", "mountPath": mps_dir,
                                                 "mountPropagation": "Bidirectional"}
    assert [v["hostPath"]["path"] for v in pod["volumes"]] == [mps_dir, "/"]
    assert not any(m["mountPath"] == agent_mounts["plugin"] or agent_mounts["plugin"].startswith(m["mountPath"])
                   for m in container(mps)["volumeMounts"] if m["mountPath"] != mps_dir)
    assert container(mps)["securityContext"] == {"privileged": True, "readOnlyRootFilesystem": True}
    # what the supervisor makes of its arguments
    import argparse

    parser = argparse.ArgumentParser(prog="gpudra")
    mpssupervisor.add_parser(parser.add_subparsers())
    parsed = parser.parse_args(container(mps)["args"])
    assert parsed.shm_size == 64 * 2**20 and parsed.max_shm_size == 2**30  # a claim's /dev/shm, and its bound
    assert str(parsed.plugin_dir) == agent_mounts["plugin"] and parsed.isolate_shm
    assert parsed.plugin_dir / "mps" == Path(mps_dir)  # where the supervisor works: what it is given


def test_spec_sharing_mps_shm_size_is_each_claims_dev_shm() -> None:
    from gpudra_operator.spec import SpecError

    mps = render(config({"sharing": {"mps": {"shmSize": "1Gi", "maxShmSize": "4Gi"}}})).mps_daemonset
    assert mps is not None
    args = container(mps)["args"]
    assert args[args.index("--shm-size") + 1] == "1Gi" and args[args.index("--max-shm-size") + 1] == "4Gi"
    for bad in ("512Ki", "1048576001m", "-1Gi", "2Gi"):  # under 1Mi; not whole bytes; negative; above the bound
        with pytest.raises(SpecError, match="spec.sharing.mps.shmSize"):
            render(config({"sharing": {"mps": {"shmSize": bad}}}))
    with pytest.raises(SpecError, match="spec.sharing.mps.maxShmSize"):
        render(config({"sharing": {"mps": {"shmSize": "1Mi", "maxShmSize": "1Ki"}}}))
