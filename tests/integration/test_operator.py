"""The operator (a `gpudra operator` subprocess) against the real control plane: children with the
right content and owners, updates and pruning, repair of deleted or hand-edited children, status a
platform team can act on (kubectl get/describe/wait), bad input that loses nothing, conflicts."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio

from counting import CountingKube
from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_operator.events import EventRecorder
from gpudra_dev.localcluster.controlplane import ControlPlane
from gpudra_dev.localcluster.kubelet_sim import KubeletSimulator
from gpudra_dev.localcluster.objects import events_about
from gpudra_dev.localcluster.operatorproc import OperatorProcess, start_operator
from gpudra_dev.localcluster.waiting import wait_for
from gpudra_operator.reconcile import Reconciler

CONFIG = resource_type("gpudra.io/v1alpha1", "GpuDraConfig")
DEVICE_CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")
DAEMONSET = resource_type("apps/v1", "DaemonSet")
SERVICE_ACCOUNT = resource_type("v1", "ServiceAccount")
NODE = resource_type("v1", "Node")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def operator(cluster: ControlPlane, kube: Kube, crd_installed: Obj,
                   tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[OperatorProcess]:
    operator = start_operator(kubeconfig=cluster.kubeconfig, log_path=tmp_path_factory.mktemp("operator") / "operator.log",
                              env={"GPUDRA_DRIFT_INTERVAL": "3"})
    simulator = asyncio.create_task(KubeletSimulator(kube).run())
    try:
        yield operator
    finally:
        simulator.cancel()
        operator.stop()
        print(f"\n--- operator log tail ({operator.log_path}) ---\n{operator.log_tail()}")


@pytest.fixture
def suffix() -> str:
    return secrets.token_hex(3)


def make_config(name: str, namespace: str, driver: str, classes: list[Obj], **agent: Any) -> Obj:
    return {"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/instance": "argo-app"}},
            "spec": {"driverName": driver, "agent": {"namespace": namespace, **agent}, "deviceClasses": classes}}


@pytest_asyncio.fixture(loop_scope="session")
async def configs(kube: Kube, operator: OperatorProcess) -> AsyncIterator[Callable[..., Any]]:
    created: list[str] = []

    async def create(body: Obj) -> Obj:
        created.append(body["metadata"]["name"])
        return await kube.create(body)

    yield create
    for name in created:
        await kube.delete(CONFIG, name)
    for name in created:
        await wait_for(lambda: _absent(kube, CONFIG, name), timeout=60, what=f"GpuDraConfig {name} to be finalized")


async def _absent(kube: Kube, rtype: Any, name: str, namespace: str | None = None) -> bool:
    return await kube.get(rtype, name, namespace) is None


def condition(config: Obj | None, type_: str) -> Obj | None:
    return next((c for c in ((config or {}).get("status") or {}).get("conditions") or [] if c["type"] == type_), None)


def has_condition(kube: Kube, name: str, type_: str, status: str, reason: str | None = None):
    async def probe() -> Obj | None:
        config = await kube.get(CONFIG, name)
        c = condition(config, type_)
        ok = c and c["status"] == status and (reason is None or c["reason"] == reason) and \
            c.get("observedGeneration") == config["metadata"]["generation"]
        return config if ok else None
    return probe


async def agent_namespace(kube: Kube, namespace: str) -> str:
    # The agent's ServiceAccount ships statically (manifests/); a test plays that part.
    await kube.create({"apiVersion": "v1", "kind": "ServiceAccount",
                       "metadata": {"name": "gpudra-agent", "namespace": namespace}})
    return namespace


async def test_create_update_repair_delete(kube: Kube, configs, namespace: str, fake_nodes, cluster: ControlPlane,
                                           suffix: str) -> None:
    await agent_namespace(kube, namespace)
    await fake_nodes("gpu", labels={"gpudra-test": suffix})
    name, driver = f"cfg-{suffix}", f"d{suffix}.gpudra.io"
    classes = [{"name": f"all-{suffix}.gpudra.io", "template": "all"},
               {"name": f"big-{suffix}.gpudra.io", "template": "min-memory", "parameters": {"memory": "64Gi"}}]
    await configs(make_config(name, namespace, driver, classes, nodeSelector={"gpudra-test": suffix}))

    ready = await wait_for(has_condition(kube, name, "Ready", "True"), timeout=60, what=f"{name} Ready=True")
    status = ready["status"]
    assert {c["type"] for c in status["conditions"]} == {"Ready", "AgentsReady", "DeviceClassesReady", "Degraded",
                                                         "ClassMatchesNoDevice"}
    assert status["observedGeneration"] == ready["metadata"]["generation"]
    assert status["agents"] == {"desired": 1, "ready": 1, "updated": 1, "summary": "1/1"}
    assert sorted(c["name"] for c in status["deviceClasses"]) == sorted(c["name"] for c in classes)

    uid = ready["metadata"]["uid"]
    big = await kube.get(DEVICE_CLASS, f"big-{suffix}.gpudra.io")
    assert big["metadata"]["ownerReferences"] == [{"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig",
                                                   "name": name, "uid": uid, "controller": True,
                                                   "blockOwnerDeletion": True}]
    assert big["metadata"]["labels"]["gpudra.io/config"] == name
    assert "app.kubernetes.io/instance" not in big["metadata"]["labels"]  # GitOps tracking never leaks
    assert 'compareTo(quantity("64Gi")) >= 0' in big["spec"]["selectors"][0]["cel"]["expression"]
    ds = await kube.get(DAEMONSET, "gpudra-agent", namespace)
    assert ds["metadata"]["ownerReferences"][0]["uid"] == uid
    container = ds["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:3] == ["agent", "--driver", driver]

    # What a platform team types.
    table = cluster.kubectl("get", "gdc", name).stdout
    header, row = table.splitlines()[:2]
    assert header.split() == ["NAME", "DRIVER", "READY", "AGENTS", "CLASSES", "DEVICES", "UNHEALTHY", "AGE"]
    assert row.split()[:7] == [name, driver, "True", "1/1", "2", "0", "0"]
    described = cluster.kubectl("describe", "gdc", name).stdout
    assert "Type:" in described and "DeviceClassesReady" in described and "Degraded" in described
    waited = cluster.kubectl("wait", "--for=condition=Ready", f"gdc/{name}", "--timeout=30s", check=False)
    assert waited.returncode == 0, waited.stderr

    # A spec change: the image is updated, one class removed (pruned), one changed.
    await kube.patch(CONFIG, name, {"spec": {"agent": {"image": "example.com/gpudra:2"}, "deviceClasses": [
        {"name": f"big-{suffix}.gpudra.io", "template": "min-memory", "parameters": {"memory": "80Gi"}}]}})
    await wait_for(lambda: _absent(kube, DEVICE_CLASS, f"all-{suffix}.gpudra.io"), timeout=30, what="pruned class")

    async def updated() -> bool:
        dc = await kube.get(DEVICE_CLASS, f"big-{suffix}.gpudra.io")
        ds = await kube.get(DAEMONSET, "gpudra-agent", namespace)
        return ('quantity("80Gi")' in dc["spec"]["selectors"][0]["cel"]["expression"]
                and ds["spec"]["template"]["spec"]["containers"][0]["image"] == "example.com/gpudra:2")

    await wait_for(updated, timeout=30, what="the class and the DaemonSet to follow the spec")
    await wait_for(has_condition(kube, name, "Ready", "True"), timeout=60, what="Ready again after the change")

    # Hand-deleted class → restored; hand-edited image → restored.
    await kube.delete(DEVICE_CLASS, f"big-{suffix}.gpudra.io")
    await wait_for(lambda: kube.get(DEVICE_CLASS, f"big-{suffix}.gpudra.io"), timeout=15, what="class restored")
    await kube.patch(DAEMONSET, "gpudra-agent", {"spec": {"template": {"spec": {"containers": [
        {"name": "agent", "image": "evil.example.com/x:1"}]}}}}, namespace=namespace, kind="strategic-merge")

    async def image_restored() -> bool:
        ds = await kube.get(DAEMONSET, "gpudra-agent", namespace)
        return ds["spec"]["template"]["spec"]["containers"][0]["image"] == "example.com/gpudra:2"

    await wait_for(image_restored, timeout=15, what="the DaemonSet image to be restored")

    # Deleting the config removes its children; deleted in the foreground (kubectl delete
    # --cascade=foreground), the config goes only once they are gone (blockOwnerDeletion).
    await kube.delete(CONFIG, name, propagation="Foreground")
    await wait_for(lambda: _absent(kube, CONFIG, name), timeout=60, what="the config and its children to go")
    assert await kube.get(DEVICE_CLASS, f"big-{suffix}.gpudra.io") is None
    assert await kube.get(DAEMONSET, "gpudra-agent", namespace) is None


async def test_nodes_running_nvidias_device_plugin_degrade_the_config_until_it_is_gone(
        kube: Kube, configs, namespace: str, fake_nodes, agents, suffix: str) -> None:
    """The agent on a node where the device plugin advertises nvidia.com/gpu publishes nothing and
    says so on the Node; the operator names the node in Degraded (and an Event on the config), and
    the config is Ready again once the device plugin is gone."""
    await agent_namespace(kube, namespace)
    node = (await fake_nodes("dp", labels={"gpudra-test": suffix}))["metadata"]["name"]
    await kube.patch(NODE, node, {"status": {"allocatable": {"nvidia.com/gpu": "8"}}}, subresource="status")
    name, driver = f"dp-{suffix}", f"dp{suffix}.gpudra.io"
    await configs(make_config(name, namespace, driver, [], nodeSelector={"gpudra-test": suffix}))
    agents(node, "fake:l4x2", driver, rescan_interval=0.2)

    degraded = await wait_for(has_condition(kube, name, "Degraded", "True", "DevicePluginConflict"), timeout=60,
                              what=f"{name} Degraded=True DevicePluginConflict")
    assert f"advertises nvidia.com/gpu on 1 node(s) ({node})" in condition(degraded, "Degraded")["message"]
    assert condition(degraded, "Ready")["status"] == "False"
    async def warned() -> bool:  # `kubectl describe gdc` shows it; posted just after the status
        return any(e["reason"] == "DevicePluginConflict" and e["type"] == "Warning"
                   for e in await events_about(kube, name))

    await wait_for(warned, timeout=10, what="a DevicePluginConflict event on the config")

    await kube.patch(NODE, node, {"status": {"allocatable": {"nvidia.com/gpu": None}}}, subresource="status")
    await wait_for(has_condition(kube, name, "Degraded", "False"), timeout=60, what=f"{name} Degraded=False")


async def test_a_template_bomb_degrades_its_class_and_the_operator_stays_small(
        kube: Kube, configs, namespace: str, suffix: str, operator: OperatorProcess) -> None:
    """The review's live reproduction: an inline template allocating 2.4 GiB in one C call. It
    renders in the bounded worker: its class is named in Degraded, the other class is applied, and
    the operator's peak resident memory stays under 300 MiB (its Deployment's limit is 512Mi)."""
    await agent_namespace(kube, namespace)
    name, driver = f"bomb-{suffix}", f"bomb{suffix}.gpudra.io"
    good = {"name": f"fine-{suffix}.gpudra.io", "template": "full-gpu"}
    bomb = {"name": f"bomb-{suffix}.gpudra.io",
            "inline": "{% set x = (range(100000)|list) * 3000 %}apiVersion: resource.k8s.io/v1\nkind: DeviceClass\n"}
    await configs(make_config(name, namespace, driver, [good, bomb], nodeSelector={"none": suffix}))
    degraded = await wait_for(has_condition(kube, name, "Degraded", "True"), timeout=60, what="Degraded=True")
    message = condition(degraded, "Degraded")["message"]
    assert bomb["name"] in message and "more than the 256 MiB it may use" in message, message
    assert await kube.get(DEVICE_CLASS, good["name"])
    with open(f"/proc/{operator.process.pid}/status") as status:
        peak_kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    assert peak_kib < 300 * 1024, f"operator peak RSS {peak_kib // 1024} MiB"


async def test_broken_template_loses_nothing(kube: Kube, configs, namespace: str, suffix: str) -> None:
    await agent_namespace(kube, namespace)
    name, driver = f"bad-{suffix}", f"b{suffix}.gpudra.io"
    good = {"name": f"good-{suffix}.gpudra.io", "template": "full-gpu"}
    await configs(make_config(name, namespace, driver, [good], nodeSelector={"none": suffix}))
    await wait_for(has_condition(kube, name, "Ready", "True"), timeout=60, what="Ready=True")
    before = await kube.get(DEVICE_CLASS, good["name"])
    ds_before = await kube.get(DAEMONSET, "gpudra-agent", namespace)

    # The same class now from an inline template that renders CEL the API server rejects, plus a
    # second class whose template does not even render.
    broken_cel = ("apiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata:\n  name: {{ name }}\n"
                  "spec:\n  selectors:\n  - cel:\n      expression: 'device.attributes[\"" + driver + "\"].type =='\n")
    await kube.patch(CONFIG, name, {"spec": {"deviceClasses": [
        {"name": good["name"], "inline": broken_cel},
        {"name": f"worse-{suffix}.gpudra.io", "inline": "{{ undefined_thing.x }}"}]}})

    degraded = await wait_for(has_condition(kube, name, "Degraded", "True"), timeout=30, what="Degraded=True")
    message = condition(degraded, "Degraded")["message"]
    assert good["name"] in message and "compilation failed" in message, message
    assert f"worse-{suffix}.gpudra.io" in message and "undefined" in message, message
    assert condition(degraded, "Ready")["status"] == "False"

    after = await kube.get(DEVICE_CLASS, good["name"])
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert after["spec"] == before["spec"]
    ds_after = await kube.get(DAEMONSET, "gpudra-agent", namespace)
    assert ds_after["metadata"]["generation"] == ds_before["metadata"]["generation"]

    async def warning_event() -> Obj | None:
        events = await events_about(kube, name)
        return next((e for e in events if e["type"] == "Warning" and good["name"] in e["message"]), None)

    await wait_for(warning_event, timeout=15, what="a Warning Event naming the broken class")


async def test_newer_config_reports_conflicts_and_touches_nothing(kube: Kube, configs, namespace: str,
                                                                  suffix: str) -> None:
    await agent_namespace(kube, namespace)
    driver = f"c{suffix}.gpudra.io"
    shared_class = {"name": f"shared-{suffix}.gpudra.io", "template": "all"}
    await configs(make_config(f"old-{suffix}", namespace, driver, [shared_class], nodeSelector={"none": suffix}))
    await wait_for(has_condition(kube, f"old-{suffix}", "Ready", "True"), timeout=60, what="old Ready")
    owned = await kube.get(DEVICE_CLASS, shared_class["name"])

    await configs(make_config(f"new-{suffix}", namespace, driver,
                              [dict(shared_class, template="full-gpu")], image="example.com/other:1"))
    conflicted = await wait_for(has_condition(kube, f"new-{suffix}", "Degraded", "True", "Conflict"),
                                timeout=30, what="the newer config to report a conflict")
    message = condition(conflicted, "Degraded")["message"]
    assert f"driver name {driver}" in message and f"old-{suffix}" in message
    assert shared_class["name"] in message and f"namespace {namespace}" in message

    still = await kube.get(DEVICE_CLASS, shared_class["name"])
    assert still["metadata"]["resourceVersion"] == owned["metadata"]["resourceVersion"]
    assert still["metadata"]["labels"]["gpudra.io/config"] == f"old-{suffix}"
    ds = await kube.get(DAEMONSET, "gpudra-agent", namespace)
    assert ds["spec"]["template"]["spec"]["containers"][0]["image"] != "example.com/other:1"
    old = await kube.get(CONFIG, f"old-{suffix}")
    assert condition(old, "Ready")["status"] == "True"


async def test_drift_ticks_write_nothing_when_nothing_changed(kube: Kube, configs, operator: OperatorProcess,
                                                              namespace: str, suffix: str) -> None:
    """A converged config costs reads only: across two drift ticks no object the operator manages
    (the config itself, its DaemonSet, its DeviceClasses) gets a new resourceVersion."""
    await agent_namespace(kube, namespace)
    name = f"idle-{suffix}"
    classes = [{"name": f"idle{i}-{suffix}.gpudra.io", "template": "full-gpu"} for i in range(3)]
    # Values the API server stores differently from how they were asked for (canonical
    # quantities, an empty env value dropped) must not read as drift.
    await configs(make_config(name, namespace, f"i{suffix}.gpudra.io", classes, nodeSelector={"none": suffix},
                              resources={"requests": {"cpu": "0.5", "memory": "1024Mi"}},
                              extraEnv=[{"name": "GPUDRA_EMPTY", "value": ""}]))
    await wait_for(has_condition(kube, name, "Ready", "True"), timeout=60, what="Ready=True")

    async def versions() -> dict[str, str]:
        objects = [await kube.get(CONFIG, name), await kube.get(DAEMONSET, "gpudra-agent", namespace),
                   *[await kube.get(DEVICE_CLASS, c["name"]) for c in classes]]
        return {o["kind"] + "/" + o["metadata"]["name"]: o["metadata"]["resourceVersion"] for o in objects}

    # Let any trailing status write (the DaemonSet controller's first status) settle: two equal
    # snapshots around one drift tick, then two more ticks that must change nothing.
    before = await versions()
    ticks = operator.log_count("drift check done")
    await wait_for(lambda: _more(operator, ticks + 2), timeout=30, what="two drift ticks")
    settled = await versions()
    ticks = operator.log_count("drift check done")
    await wait_for(lambda: _more(operator, ticks + 2), timeout=30, what="two more drift ticks")
    assert await versions() == settled, (before, settled)

    # The same reconcile in-process, every request counted: reads only (a server-side apply that
    # changes nothing would not move a resourceVersion, but it is still a write request).
    counting = CountingKube(kube.api, "gpudra-operator")
    outcome = await Reconciler(counting, EventRecorder(counting)).reconcile(await kube.get(CONFIG, name))
    assert outcome is not None and outcome.applied == []
    assert set(counting.methods) == {"GET"}, counting.methods


async def _more(operator: OperatorProcess, count: int) -> bool:
    return operator.log_count("drift check done") >= count


async def test_spec_sharing_mps_runs_the_mps_supervisor_until_it_leaves_the_spec(
        kube: Kube, configs, namespace: str, suffix: str) -> None:
    """The supervisor's DaemonSet: there while spec.sharing.mps is, never rolled with the agents,
    no API token; removed (only that one) when the option goes."""
    ns = await agent_namespace(kube, namespace)
    body = make_config(f"mps-{suffix}", ns, f"mps-{suffix}.gpudra.io", [])
    body["spec"]["sharing"] = {"mps": {}}
    await configs(body)

    async def supervisor() -> Obj | None:
        return await kube.get(DAEMONSET, "gpudra-mps", ns)

    mps = await wait_for(supervisor, timeout=30, what="the gpudra-mps DaemonSet")
    assert mps["spec"]["updateStrategy"] == {"type": "OnDelete"}
    pod = mps["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and pod["shareProcessNamespace"] is True
    plugin_dir = f"/var/lib/kubelet/plugins/mps-{suffix}.gpudra.io"
    assert pod["containers"][0]["args"] == ["mps-supervisor", "--plugin-dir", plugin_dir, "--driver-root",
                                            "/driver-root", "--isolate-shm", "--shm-size", "64Mi",
                                            "--max-shm-size", "1Gi"]
    assert {v["hostPath"]["path"] for v in pod["volumes"]} == {f"{plugin_dir}/mps", "/"}  # not the checkpoint
    agents = await kube.get(DAEMONSET, "gpudra-agent", ns)
    assert agents is not None and agents["spec"]["updateStrategy"]["type"] == "RollingUpdate"

    await kube.patch(CONFIG, body["metadata"]["name"], {"spec": {"sharing": None}})
    await wait_for(lambda: _absent(kube, DAEMONSET, "gpudra-mps", ns), timeout=30,
                   what="the gpudra-mps DaemonSet to go with spec.sharing.mps")
    assert await kube.get(DAEMONSET, "gpudra-agent", ns) is not None


SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")


async def test_class_counts_run_the_selectors_as_the_clusters_release_does(
        kube: Kube, configs, namespace: str, fake_nodes, suffix: str) -> None:
    """A class matching the devices whose attribute is a URL: ``http://h:80:8080/`` is one on 1.35
    and not from 1.36 (Kubernetes builds with Go 1.26's net/url defaults), so the operator's count
    follows the release it reads from the API server, as the scheduler would allocate. (The
    attribute is one the agent publishes, productName: the operator refuses a class naming any
    other.)"""
    await agent_namespace(kube, namespace)
    node = (await fake_nodes("url", labels={"gpudra-test": suffix}))["metadata"]["name"]
    name, driver, urls = f"rel-{suffix}", f"r{suffix}.gpudra.io", f"urls-{suffix}.gpudra.io"
    selector = f'isURL(device.attributes["{driver}"].productName)'
    inline = ("apiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata:\n  name: {{ name }}\n"
              f"spec:\n  selectors:\n  - cel:\n      expression: '{selector}'\n")
    await configs(make_config(name, namespace, driver, [{"name": urls, "inline": inline}],
                              nodeSelector={"gpudra-test": suffix}))
    await kube.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                       "metadata": {"name": f"{node}-{suffix}"},
                       "spec": {"driver": driver, "nodeName": node,
                                "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                                "devices": [{"name": f"gpu-{i}", "attributes": {"productName": {"string": url}}}
                                            for i, url in enumerate(("http://h:8080/", "http://h:80:8080/"))]}})
    strict = (await kube.server_minor() or 35) >= 36  # Kubernetes 1.36 builds with Go 1.26

    async def counted() -> Obj | None:
        config = await kube.get(CONFIG, name)
        got = {c["name"]: c.get("devices") for c in (config.get("status") or {}).get("deviceClasses") or []}
        return config if got == {urls: 1 if strict else 2} else None

    try:
        await wait_for(counted, timeout=60, what=f"{urls} counting {1 if strict else 2} devices")
    except AssertionError as error:
        raise AssertionError(f"{error}\n{((await kube.get(CONFIG, name)) or {}).get('status')}") from None


async def test_class_counts_follow_slices_and_claims_and_a_class_that_matches_nothing_warns(
        kube: Kube, configs, namespace: str, fake_nodes, cluster: ControlPlane, suffix: str) -> None:
    """status.deviceClasses[] from the operator's watches (the slices a node publishes, the claims
    that hold devices), and ClassMatchesNoDevice the moment a parameter makes a class match nothing."""
    await agent_namespace(kube, namespace)
    node = (await fake_nodes("gpu", labels={"gpudra-test": suffix}))["metadata"]["name"]
    name, driver = f"cnt-{suffix}", f"c{suffix}.gpudra.io"
    everything, big, huge = f"all-{suffix}.gpudra.io", f"big-{suffix}.gpudra.io", f"huge-{suffix}.gpudra.io"
    await configs(make_config(name, namespace, driver, [
        {"name": everything, "template": "all"},
        {"name": big, "template": "min-memory", "parameters": {"memory": "64Gi"}},
        {"name": huge, "template": "min-memory", "parameters": {"memory": "800Gi"}}],  # meant 80Gi
        nodeSelector={"gpudra-test": suffix}))
    await wait_for(has_condition(kube, name, "Ready", "True"), timeout=60, what=f"{name} Ready=True")
    # what an agent on the node publishes: two GPUs, 80Gi and 40Gi
    await kube.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                       "metadata": {"name": f"{node}-{suffix}"},
                       "spec": {"driver": driver, "nodeName": node,
                                "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                                "devices": [{"name": f"gpu-{i}", "attributes": {"type": {"string": "gpu"}},
                                             "capacity": {"memory": {"value": memory}}}
                                            for i, memory in enumerate(("80Gi", "40Gi"))]}})

    def counts_are(expected: dict[str, tuple[int, int, int, int]]):
        async def probe() -> Obj | None:
            config = await kube.get(CONFIG, name)
            got = {c["name"]: (c.get("devices"), c.get("allocated"), c.get("free"), c.get("nodesWithFree"))
                   for c in (config.get("status") or {}).get("deviceClasses") or []}
            return config if got == expected else None
        return probe

    config = await wait_for(counts_are({everything: (2, 0, 2, 1), big: (1, 0, 1, 1), huge: (0, 0, 0, 0)}),
                            timeout=30, what="the per-class counts")
    warning = condition(config, "ClassMatchesNoDevice")
    assert warning is not None and (warning["status"], warning["reason"]) == ("True", "ClassMatchesNoDevice")
    assert warning["message"].startswith(f"DeviceClass {huge} matches none of the 2 devices driver {driver}")
    assert condition(config, "Ready")["status"] == "True"  # a warning: the config itself is applied
    async def warned() -> list[Obj]:
        return [e for e in await events_about(kube, name) if e["reason"] == "ClassMatchesNoDevice"]

    [event] = await wait_for(warned, timeout=10, what="a ClassMatchesNoDevice event")  # posted after the status
    assert event["type"] == "Warning" and huge in event["message"]
    described = cluster.kubectl("describe", "gdc", name).stdout
    assert "ClassMatchesNoDevice" in described and huge in described

    # A claim holds the 80Gi GPU: counted as allocated (the next status refresh, from the claim watch).
    await kube.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                       "metadata": {"name": "holder", "namespace": namespace},
                       "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": big}}]}}})
    await kube.patch(CLAIM, "holder", {"status": {"allocation": {"devices": {"results": [
        {"request": "gpu", "driver": driver, "pool": node, "device": "gpu-0"}]}}}},
        namespace=namespace, subresource="status")
    await wait_for(counts_are({everything: (2, 1, 1, 1), big: (1, 1, 0, 0), huge: (0, 0, 0, 0)}), timeout=30,
                   what="the allocated GPU counted")

    # The agent taints the 40Gi GPU (device health): `kubectl get gdc` counts it unhealthy.
    live = await kube.get(SLICE, f"{node}-{suffix}")
    live["spec"]["devices"][1]["taints"] = [{"key": f"{driver}/xid", "value": "79", "effect": "NoSchedule"}]
    stored = await kube.request("PUT", SLICE.path(name=f"{node}-{suffix}"), body=live)
    # 1.35 drops device taints (DRADeviceTaints off; the agents leave such a device out instead):
    # nothing to count there. CI runs this test on 1.36 and 1.37 too.
    tainted = bool(stored["spec"]["devices"][1].get("taints"))

    async def unhealthy() -> Obj | None:
        config = await kube.get(CONFIG, name)
        return config if (config.get("status") or {}).get("unhealthyDevices") == int(tainted) else None

    await wait_for(unhealthy, timeout=30, what=f"status.unhealthyDevices == {int(tainted)}")
    header, row = cluster.kubectl("get", "gdc", name).stdout.splitlines()[:2]
    assert dict(zip(header.split(), row.split()))["UNHEALTHY"] == str(int(tainted))

    # The parameter fixed: every class matches, the warning clears.
    await kube.patch(CONFIG, name, {"spec": {"deviceClasses": [
        {"name": everything, "template": "all"},
        {"name": big, "template": "min-memory", "parameters": {"memory": "64Gi"}},
        {"name": huge, "template": "min-memory", "parameters": {"memory": "80Gi"}}]}})
    # (the 40Gi GPU, tainted, is not free any more)
    left = 0 if tainted else 1
    config = await wait_for(counts_are({everything: (2, 1, left, left), big: (1, 1, 0, 0), huge: (1, 1, 0, 0)}),
                            timeout=30, what="the fixed class's counts")
    await wait_for(has_condition(kube, name, "ClassMatchesNoDevice", "False", "EveryClassMatches"), timeout=30,
                   what="the warning to clear")

    # The 80Gi GPU published unmonitored and shareable: `kubectl get gdc -o wide` counts both, as the
    # agent's gpudra_agent_devices{health="unmonitored"} and gpudra_agent_shareable_devices do (both
    # fields are dropped where their features are off: 1.35).
    live = await kube.get(SLICE, f"{node}-{suffix}")
    live["spec"]["devices"][0] |= {"taints": [{"key": f"{driver}/unmonitored", "effect": "None"}],
                                   "allowMultipleAllocations": True}
    stored = (await kube.request("PUT", SLICE.path(name=f"{node}-{suffix}"), body=live))["spec"]["devices"][0]
    expected = (int(bool(stored.get("taints"))), int(stored.get("allowMultipleAllocations") is True))

    async def wide() -> Obj | None:
        status = (await kube.get(CONFIG, name)).get("status") or {}
        return status if (status.get("unmonitoredDevices"), status.get("shareableDevices")) == expected else None

    await wait_for(wide, timeout=30, what=f"status unmonitoredDevices, shareableDevices == {expected}")
    header, row = cluster.kubectl("get", "gdc", name, "-o", "wide").stdout.splitlines()[:2]
    columns = dict(zip(header.split(), row.split()))
    assert (columns["UNMONITORED"], columns["SHAREABLE"]) == tuple(str(n) for n in expected), columns
    await kube.delete(SLICE, f"{node}-{suffix}")
