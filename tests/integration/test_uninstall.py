"""Uninstall on the real control plane: what stays behind, and what happens to pods still on claims.

An agent (a process, as in its DaemonSet pod) stopped while its GpuDraConfig is in place leaves
everything for the next one; stopped once the config is gone, it removes its node's ResourceSlices,
CDI specs, checkpoint, plugin directory and sockets, unless a claim is still prepared there: then the
claim's spec, its MPS daemon and the checkpoint stay (a Warning Event on the Node says so), until a
reinstalled agent unprepares it. `gpudra uninstall`, as the chart's pre-delete hook runs it (its
own ServiceAccount with the chart's hook RBAC; once as a process, once in the operator image as the
Job runs it), refuses while a pod holds a claim of the driver, naming both, and otherwise deletes
the config while the operator runs and waits until its DeviceClass, DaemonSet, slices and the
node's files are gone. Configs carry no finalizer: with the operator gone first, deleting the
config is enough (garbage collector and agent). `gpudra uninstall` then `kubectl delete -k`
leaves nothing of gpudra, admission policies included."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
import yaml
from chartregistry import helm_binary
from seedobjects import published_devices
import test_images
from test_images import podman
from test_install import (AGENT_NS, BASE, CLUSTER_ROLE_BINDING, OPERATOR_NS, TokenClient, agent_pod, kustomize,
                          request_token, token_kubeconfig)
import test_kubelet_plugin
from test_kubelet_plugin import allocated_claim, ref
from test_mps import daemons_of, mps_config, supervisor

from kubernetes_asyncio.client.exceptions import ApiException

from gpudra_core.kubeapi import Kube, Obj, ResourceType, resource_type
from gpudra_dev.kubelet_client import DraClient
from gpudra_dev.localcluster import mockstate
from gpudra_dev.localcluster.agents import AgentProcess, start_agent
from gpudra_dev.localcluster.controlplane import ControlPlane
from gpudra_dev.localcluster.fakedriverroot import make_driver_root
from gpudra_dev.localcluster.kubelet_sim import KubeletSimulator
from gpudra_dev.localcluster.objects import create_scratch_namespace, delete_namespace, events_about
from gpudra_dev.localcluster.operatorproc import OperatorProcess, start_operator
from gpudra_dev.localcluster.waiting import wait_for
from gpudra_driver.plugin.plugin import socket_paths

# fixtures of those modules, for these tests too
driver, plugin_agents = test_kubelet_plugin.driver, test_kubelet_plugin.plugin_agents
images = test_images.images
REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "manifests" / "helm" / "gpudra"
CONFIG = resource_type("gpudra.io/v1alpha1", "GpuDraConfig")
SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
DEVICE_CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")
DAEMONSET = resource_type("apps/v1", "DaemonSet")
POD = resource_type("v1", "Pod")
CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")
CLUSTER_ROLE = resource_type("rbac.authorization.k8s.io/v1", "ClusterRole")


@pytest.fixture
def driver_root(tmp_path: Path) -> Iterator[Path]:
    root = make_driver_root(tmp_path / "driver-root", "dgx-h100")
    yield root
    mockstate.kill_mps_daemons(root)  # any a failed test left, with their claims' tmpfs
    with open("/proc/self/mounts") as mounts:
        leftovers = [line.split()[1] for line in mounts if line.split()[1].startswith(f"{tmp_path}/")]
    for mount_point in reversed(leftovers):
        subprocess.run(["umount", mount_point], check=False, timeout=30)


def gpudra_config(name: str, driver: str, **agent: object) -> Obj:
    return {"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig", "metadata": {"name": name},
            "spec": {"driverName": driver, "deviceClasses": [{"name": driver, "template": "all"}], "agent": agent}}


async def node_slices(kube: Kube, driver: str, node: str) -> list[Obj]:
    return [s async for s in kube.list(SLICE, field_selector=f"spec.driver={driver},spec.nodeName={node}")]


def node_files(workdir: Path, driver: str) -> list[str]:
    """What the driver has on the node: its plugin directory's entries, its CDI specs, its
    registration sockets (empty after a clean uninstall)."""
    kubelet = workdir / "kubelet"
    plugin_dir = kubelet / "plugins" / driver
    found = [f"plugin dir: {p.name}" for p in plugin_dir.iterdir()] if plugin_dir.exists() else []
    if plugin_dir.exists():
        found.append(f"plugin dir {plugin_dir}")
    found += [f"CDI spec {p.name}" for p in (workdir / "cdi").glob(f"k8s.{driver}-claim_*.json")]
    found += [f"registration {p.name}" for p in (kubelet / "plugins_registry").glob(f"{driver}-*")]
    return found


async def test_an_agent_cleans_its_node_only_when_its_config_is_gone_and_no_claim_is_prepared(
        kube: Kube, namespace: str, fake_nodes, plugin_agents, driver: str, driver_root: Path,
        crd_installed: Obj) -> None:
    node = (await fake_nodes("uninstall"))["metadata"]["name"]
    name = f"uninstall-{secrets.token_hex(3)}"
    await kube.create(gpudra_config(name, driver))  # no operator here
    agent_args = ("--config", name)
    first = plugin_agents(node, driver, nvml="mock:dgx-h100", driver_root=driver_root, extra_args=agent_args)
    mps_supervisor = supervisor(first, driver_root)
    try:
        # A restart (a rolling update, a deleted pod): the config is in place, everything stays.
        await published_devices(kube, driver, node, 8)
        await first.registered()
        assert first.agent.stop() == 0, first.agent.log_tail()
        assert f"stopping, not uninstalling (GpuDraConfig {name} is in place)" in first.agent.log_path.read_text()
        assert len(await node_slices(kube, driver, node)) == 1
        assert (first.workdir / "kubelet" / "plugins" / driver / "checkpoint.json").exists()

        # An uninstall under a prepared claim (an MPS one, with its daemon): the node keeps the claim.
        second = plugin_agents(node, driver, nvml="mock:dgx-h100", driver_root=driver_root, workdir=first.workdir,
                               extra_args=agent_args)
        claim = await allocated_claim(kube, namespace, "held", driver, node, ["gpu-1"],
                                      config=mps_config(driver, activeThreadPercentage=50))
        uid = claim["metadata"]["uid"]
        async with DraClient((await second.registered()).endpoint) as kubelet:
            assert (await second.prepare(kubelet, [ref(claim)])).claims[uid].error == ""
        [daemon] = daemons_of(driver_root, uid)
        await kube.delete(CONFIG, name)
        assert second.agent.stop() == 0, second.agent.log_tail()
        log = second.agent.log_path.read_text()
        assert f"uninstall: GpuDraConfig {name} is gone" in log
        assert f"but this node still holds claim {namespace}/held: the CDI specs" in log
        assert await node_slices(kube, driver, node) == []  # nothing new is allocated here
        assert second.spec_path(uid).exists() and second.checkpoint() == {uid: "PrepareCompleted"}
        assert [d.pid for d in daemons_of(driver_root, uid)] == [daemon.pid]  # its containers keep their MPS
        [event] = [e for e in await events_about(kube, node) if e["reason"] == "UninstallKeptPreparedClaims"]
        assert event["type"] == "Warning" and f"{namespace}/held" in event["message"]

        # gpudra installed again: its agent unprepares the claim when its pod ends; then the
        # uninstall leaves nothing: no slices, specs, checkpoint, plugin directory, sockets or daemons.
        await kube.create(gpudra_config(name, driver))
        third = plugin_agents(node, driver, nvml="mock:dgx-h100", driver_root=driver_root, workdir=first.workdir,
                              extra_args=agent_args)
        async with DraClient((await third.registered()).endpoint) as kubelet:
            assert (await kubelet.unprepare([ref(claim)])).claims[uid].error == ""
        assert daemons_of(driver_root, uid) == []
        await wait_for(lambda: _published(kube, driver, node), timeout=30, what="the third agent's slice")
        await kube.delete(CONFIG, name)
        mps_supervisor.stop()  # its DaemonSet goes with the config too
        assert third.agent.stop() == 0, third.agent.log_tail()
        assert "uninstall: removed 0 CDI spec(s)" in third.agent.log_path.read_text(), third.agent.log_tail()
        assert await node_slices(kube, driver, node) == []
        assert node_files(first.workdir, driver) == []
        assert mockstate.mps_daemons(driver_root) == []
    finally:
        mps_supervisor.stop()  # first: it would start a daemon the fixture kills again
        await kube.delete(CONFIG, name)


async def _published(kube: Kube, driver: str, node: str) -> bool:
    return bool(await node_slices(kube, driver, node))


def hook_objects(operator_ns: str, agent_ns: str, *args: str) -> list[Obj]:
    """The chart's pre-delete hook as `helm template` renders it for these namespaces."""
    out = subprocess.run([helm_binary(), "template", "gpudra", str(CHART), "--kube-version", "v1.35.4",
                          "--set", f"namespaces.operator={operator_ns}", "--set", f"namespaces.agent={agent_ns}",
                          "--show-only", "templates/uninstall-hook.yaml", *args],
                         check=True, capture_output=True, text=True, timeout=60).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def run_uninstall(kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`gpudra uninstall` as the hook's container runs it (the Job's args), off the event loop's thread."""
    return subprocess.run([sys.executable, "-m", "gpudra.cli", "uninstall", *args],
                          env={**os.environ, "KUBECONFIG": str(kubeconfig)},
                          capture_output=True, text=True, timeout=180)


@dataclass
class Scene:
    """The operator (a process) running one GpuDraConfig whose agent DaemonSet has a pod on one fake
    node, and that pod's agent as a process, as its container; the kubelet's part played here
    (pod status by the simulator, SIGTERM to the agent once its pod is deleted)."""
    kube: Kube
    name: str
    driver: str
    node: str
    operator_ns: str
    agent_ns: str
    workdir: Path
    pod_uid: str
    pod: Obj
    operator: OperatorProcess
    agent: AgentProcess

    @property
    def dra_socket(self) -> Path:
        return socket_paths(self.workdir / "kubelet", self.driver, self.pod_uid)[0]

    async def stop_agent_when_its_pod_goes(self) -> int:
        """The kubelet's part when the agent's pod is deleted: SIGTERM to its container."""
        async def going() -> bool:
            current = await self.kube.get(POD, self.pod["metadata"]["name"], self.agent_ns)
            return current is None or bool(current["metadata"].get("deletionTimestamp"))

        await wait_for(going, timeout=120, what="the agent pod to be deleted")
        return await asyncio.to_thread(self.agent.stop)

    async def everything_gone(self) -> None:
        """Nothing of the config is left: in the API, on the node, nor a finalizer."""
        kube = self.kube
        await wait_for(lambda: _absent(kube, DEVICE_CLASS, self.driver), timeout=60, what="the DeviceClass to go")
        await wait_for(lambda: _absent(kube, DAEMONSET, "gpudra-agent", self.agent_ns), timeout=60,
                       what="the agent DaemonSet to go")
        assert self.agent.process.returncode == 0, self.agent.log_tail()
        assert await kube.get(CONFIG, self.name) is None
        assert [s async for s in kube.list(SLICE, field_selector=f"spec.driver={self.driver}")] == []
        assert node_files(self.workdir, self.driver) == [], self.agent.log_tail()
        assert [c["metadata"]["name"] async for c in kube.list(CONFIG)
                if any(f.startswith("gpudra.io") for f in c["metadata"].get("finalizers") or [])] == []
        assert "forbidden" not in self.agent.log_path.read_text().lower()


async def remove_config(kube: Kube, name: str) -> None:
    """A test's config gone, with an earlier release's finalizer a test may have left on it."""
    if await kube.get(CONFIG, name) is not None:
        await kube.patch(CONFIG, name, {"metadata": {"finalizers": None}})
        await kube.delete(CONFIG, name)


async def _absent(kube: Kube, rtype: ResourceType, name: str, namespace: str | None = None) -> bool:
    return await kube.get(rtype, name, namespace) is None


@pytest_asyncio.fixture(loop_scope="session")
async def scene(cluster: ControlPlane, kube: Kube, fake_nodes, driver: str, crd_installed: Obj, short_dir: Path,
                tmp_path: Path) -> AsyncIterator[Scene]:
    operator_ns, agent_ns = await create_scratch_namespace(kube, "ops"), await create_scratch_namespace(kube, "gpus")
    label = secrets.token_hex(3)
    node = (await fake_nodes("un", labels={"gpudra-uninstall": label}))["metadata"]["name"]
    name = f"un-{label}"
    simulator = asyncio.create_task(KubeletSimulator(kube).run())
    operator = start_operator(kubeconfig=cluster.kubeconfig, log_path=tmp_path / "operator.log",
                              args=("--namespace", agent_ns, "--liveness-port", "0"),
                              env={"POD_NAMESPACE": operator_ns, "GPUDRA_DRIFT_INTERVAL": "3"})
    agent: AgentProcess | None = None
    try:
        await kube.create({"apiVersion": "v1", "kind": "ServiceAccount",
                           "metadata": {"name": "gpudra-agent", "namespace": agent_ns}})
        await kube.create(gpudra_config(name, driver, namespace=agent_ns, nodeSelector={"gpudra-uninstall": label}))

        async def agent_pod() -> Obj | None:
            pods = [p async for p in kube.list(POD, agent_ns, field_selector=f"spec.nodeName={node}")]
            return pods[0] if pods else None

        pod = await wait_for(agent_pod, timeout=60, what=f"the operator's agent pod on {node}")
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["GPUDRA_CONFIG"] == name  # what the agent reads when it is stopped
        pod_uid, workdir = str(uuid.uuid4()), short_dir / node
        agent = start_agent(kubeconfig=cluster.kubeconfig, node_name=node, nvml="fake:l4x2", driver=driver,
                            workdir=workdir, extra_args=("--pod-uid", pod_uid),
                            env={"GPUDRA_CONFIG": env["GPUDRA_CONFIG"]})
        await published_devices(kube, driver, node, 2)
        await wait_for(lambda: kube.get(DEVICE_CLASS, driver), timeout=30, what="the config's DeviceClass")
        yield Scene(kube, name, driver, node, operator_ns, agent_ns, workdir, pod_uid, pod, operator, agent)
    finally:
        simulator.cancel()
        if agent is not None:
            agent.stop()
        operator.stop()
        await remove_config(kube, name)
        for ns in (operator_ns, agent_ns):
            await delete_namespace(kube, ns)
        print(f"\n--- operator log tail ---\n{operator.log_tail()}")
        if agent is not None:
            print(f"\n--- agent log tail ---\n{agent.log_tail()}")


async def test_the_uninstall_hook_refuses_under_a_running_pod_then_removes_everything(
        cluster: ControlPlane, kube: Kube, namespace: str, scene: Scene, tmp_path: Path) -> None:
    hook = hook_objects(scene.operator_ns, scene.agent_ns)
    assert {o["kind"] for o in hook} == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Job"}
    [job] = [o for o in hook if o["kind"] == "Job"]
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args == ["uninstall", f"--agent-namespace={scene.agent_ns}", "--timeout=240"]
    try:
        for obj in hook:  # the hook's ServiceAccount and RBAC, as Helm creates them before the Job
            if obj["kind"] != "Job":
                await kube.apply(obj)
        hook_kubeconfig = token_kubeconfig(cluster, await request_token(kube, scene.operator_ns, "gpudra-uninstall"),
                                           tmp_path / "hook.kubeconfig")
        # A pod runs on a claim of the driver, prepared on the node.
        worker = await kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "worker", "namespace": namespace},
                                    "spec": {"nodeName": scene.node, "containers": [{"name": "c", "image": "x"}]}})
        claim = await allocated_claim(kube, namespace, "held", scene.driver, scene.node, ["gpu-0"])
        claim = await kube.patch(CLAIM, "held", {"status": {"reservedFor": [
            {"resource": "pods", "name": "worker", "uid": worker["metadata"]["uid"]}]}},
            namespace=namespace, subresource="status")
        uid = claim["metadata"]["uid"]
        async with DraClient(scene.dra_socket) as kubelet:
            assert (await kubelet.prepare([ref(claim)])).claims[uid].error == ""

            refused = await asyncio.to_thread(run_uninstall, hook_kubeconfig, *args[1:])
            assert refused.returncode == 1, refused.stdout + refused.stderr
            assert f"pod {namespace}/worker (claim {namespace}/held)" in refused.stderr, refused.stderr
            assert "uninstall.force=true" in refused.stderr
            live = await kube.get(CONFIG, scene.name)
            assert live is not None and not live["metadata"].get("deletionTimestamp")  # nothing touched

            # The pod ends: the kubelet unprepares its claim; the claim controller's part by hand.
            assert (await kubelet.unprepare([ref(claim)])).claims[uid].error == ""
        await kube.delete(POD, "worker", namespace, grace_period_seconds=0)
        await kube.patch(CLAIM, "held", {"status": {"reservedFor": None}}, namespace=namespace, subresource="status")

        stopping = asyncio.create_task(scene.stop_agent_when_its_pod_goes())
        started = time.monotonic()
        done = await asyncio.to_thread(run_uninstall, hook_kubeconfig, *args[1:])
        print(f"[uninstall] gpudra uninstall took {time.monotonic() - started:.1f}s")
        assert await stopping == 0, scene.agent.log_tail()
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"done: GpuDraConfig(s) {scene.name} and everything they created are gone" in done.stdout
        assert "forbidden" not in done.stderr.lower()
        await scene.everything_gone()
        assert f"uninstall: GpuDraConfig {scene.name} is " in scene.agent.log_path.read_text()
    finally:
        for obj in hook:
            if obj["kind"] in ("ClusterRole", "ClusterRoleBinding"):
                await kube.delete(resource_type("rbac.authorization.k8s.io/v1", obj["kind"]), obj["metadata"]["name"])


async def test_with_the_operator_gone_deleting_the_config_is_enough(kube: Kube, scene: Scene) -> None:
    """What `kubectl delete -k` (or a prune) can do: remove the operator before its config. The
    config carries no finalizer, so it goes at once; the garbage collector removes the DeviceClass
    and the DaemonSet (owned by the config), and the agent, stopped with its pod, finds its config
    gone and removes its node's slices and files: nothing is left, no operator needed."""
    live = await kube.get(CONFIG, scene.name)
    assert live is not None and not live["metadata"].get("finalizers")
    assert scene.operator.stop() == 0
    stopping = asyncio.create_task(scene.stop_agent_when_its_pod_goes())
    await kube.delete(CONFIG, scene.name)
    assert await kube.get(CONFIG, scene.name) is None  # not Terminating: gone
    assert await stopping == 0, scene.agent.log_tail()
    await scene.everything_gone()
    assert f"uninstall: GpuDraConfig {scene.name} is gone" in scene.agent.log_path.read_text()


async def test_an_earlier_releases_finalizer_is_dropped_and_the_operator_still_tears_down(
        kube: Kube, scene: Scene) -> None:
    """After an upgrade from a release that guarded configs with the finalizer gpudra.io/cleanup,
    the operator removes it (no handler needs it); deleting the config while the operator runs then
    tears it down: its DeviceClass, its agents and, once they are gone, the driver's slices."""
    await kube.patch(CONFIG, scene.name, {"metadata": {"finalizers": ["gpudra.io/cleanup"]}})
    await wait_for(lambda: _unguarded(kube, scene.name), timeout=30, what="the earlier release's finalizer to go")
    stopping = asyncio.create_task(scene.stop_agent_when_its_pod_goes())
    await kube.delete(CONFIG, scene.name)
    assert await stopping == 0, scene.agent.log_tail()
    await scene.everything_gone()

    async def torn_down() -> bool:
        return f"GpuDraConfig {scene.name} removed: its DeviceClasses, agents and " in scene.operator.log()

    await wait_for(torn_down, timeout=30, what="the operator's teardown to end")


async def _unguarded(kube: Kube, name: str) -> bool:
    config = await kube.get(CONFIG, name)
    return config is not None and not config["metadata"].get("finalizers")


async def test_an_agent_whose_rbac_went_first_uninstalls_on_what_its_watch_saw(
        cluster: ControlPlane, kube: Kube, crd_installed: Obj, fake_nodes, driver: str, short_dir: Path,
        tmp_path: Path) -> None:
    """What a bare `kubectl delete -k` or a GitOps prune can do to an agent: delete its
    ClusterRoleBinding, then (with the CRD) its config, and only then its pod. At SIGTERM the API
    server refuses the agent (403), but the watch of its config it opened at start-up kept
    delivering and saw the config deleted: it removes its node's files. (Its slices it may no longer
    delete; the kubelet does.)"""
    suffix = secrets.token_hex(3)
    agent_ns = await create_scratch_namespace(kube, "rbac")
    node = (await fake_nodes("rb"))["metadata"]["name"]
    name = f"rb-{suffix}"
    [role] = [o for o in kustomize(cluster) if o["kind"] == "ClusterRole" and o["metadata"]["name"] == "gpudra-agent"]
    role = {**role, "metadata": {"name": f"gpudra-agent-{suffix}"}}  # the shipped rules, under a name of its own
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": f"gpudra-agent-{suffix}"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role["metadata"]["name"]},
               "subjects": [{"kind": "ServiceAccount", "name": "gpudra-agent", "namespace": agent_ns}]}
    agent: AgentProcess | None = None
    try:
        await kube.create({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "gpudra-agent", "namespace": agent_ns}})
        await kube.create(role)
        await kube.create(binding)
        pod = await kube.create(agent_pod(agent_ns, node, "agent"))
        kubeconfig = token_kubeconfig(cluster, await request_token(kube, agent_ns, "gpudra-agent", pod),
                                      tmp_path / "agent.kubeconfig")
        await kube.create(gpudra_config(name, driver, namespace=agent_ns))
        workdir = short_dir / node
        agent = start_agent(kubeconfig=kubeconfig, node_name=node, nvml="fake:l4x2", driver=driver, workdir=workdir,
                            env={"GPUDRA_CONFIG": name})
        await published_devices(kube, driver, node, 2)
        await wait_for(lambda: _logged(agent, f"GpuDraConfig {name} is in place (watched)"), timeout=30,
                       what="the agent's watch of its config")

        await kube.delete(CLUSTER_ROLE_BINDING, binding["metadata"]["name"])
        async with TokenClient(kubeconfig, "gpudra-agent") as as_agent:
            async def refused() -> bool:
                try:
                    await as_agent.get(CONFIG, name)
                except ApiException as error:
                    return error.status == 403
                return False

            await wait_for(refused, timeout=30, what="the API server to refuse the agent")
        await kube.delete(CONFIG, name)
        await wait_for(lambda: _logged(agent, f"GpuDraConfig {name} is gone or being deleted"), timeout=30,
                       what="the agent's watch to see its config deleted")
        assert agent.stop() == 0, agent.log_tail()
        log = agent.log_path.read_text()
        assert "(403: " in log and f"and the watch saw GpuDraConfig {name} deleted" in log, agent.log_tail()
        assert node_files(workdir, driver) == [], agent.log_tail()
    finally:
        if agent is not None:
            agent.stop()
        await remove_config(kube, name)
        await kube.delete(CLUSTER_ROLE_BINDING, binding["metadata"]["name"])
        await kube.delete(CLUSTER_ROLE, role["metadata"]["name"])
        async for leftover in kube.list(SLICE, field_selector=f"spec.driver={driver}"):  # the kubelet's part
            await kube.delete(SLICE, leftover["metadata"]["name"])
        await delete_namespace(kube, agent_ns)


async def _logged(agent: AgentProcess, line: str) -> bool:
    return line in agent.log_path.read_text()


async def test_gpudra_uninstall_then_kubectl_delete_k_leaves_nothing(
        cluster: ControlPlane, kube: Kube, crd_installed: Obj, fake_nodes, driver: str, short_dir: Path,
        tmp_path: Path) -> None:
    """The documented order for kubectl (and GitOps prunes): `gpudra uninstall`, then `kubectl delete
    -k manifests/base`. The operator and the agent run with tokens of their shipped ServiceAccounts
    (the agent's bound to its DaemonSet pod): the agent's role lets it read its config at SIGTERM.
    Afterwards nothing of gpudra is left: no config, DeviceClass, slice, node file, finalizer,
    admission policy or binding, RBAC, namespace, CRD."""
    objects = kustomize(cluster)
    label = secrets.token_hex(3)
    node = (await fake_nodes("dk", labels={"gpudra-uninstall": label}))["metadata"]["name"]
    name = f"dk-{label}"
    simulator = asyncio.create_task(KubeletSimulator(kube).run())
    cluster.kubectl("apply", "-k", str(BASE))
    operator: OperatorProcess | None = None
    agent: AgentProcess | None = None
    try:
        cluster.kubectl("wait", "--for=condition=Established", "crd/gpudraconfigs.gpudra.io", "--timeout=60s")
        operator = start_operator(kubeconfig=token_kubeconfig(cluster, await request_token(kube, OPERATOR_NS, "gpudra-operator"),
                                                              tmp_path / "operator.kubeconfig"),
                                  log_path=tmp_path / "operator.log", args=("--namespace", AGENT_NS, "--liveness-port", "0"),
                                  env={"POD_NAMESPACE": OPERATOR_NS, "GPUDRA_DRIFT_INTERVAL": "3"})
        await kube.create(gpudra_config(name, driver, namespace=AGENT_NS, nodeSelector={"gpudra-uninstall": label}))

        async def agent_pod() -> Obj | None:
            pods = [p async for p in kube.list(POD, AGENT_NS, field_selector=f"spec.nodeName={node}")]
            return pods[0] if pods else None

        pod = await wait_for(agent_pod, timeout=60, what=f"the agent pod on {node}")
        workdir = short_dir / node
        agent_kubeconfig = token_kubeconfig(cluster, await request_token(kube, AGENT_NS, "gpudra-agent", pod),
                                            tmp_path / "agent.kubeconfig")
        agent = start_agent(kubeconfig=agent_kubeconfig, node_name=node, nvml="fake:l4x2", driver=driver,
                            workdir=workdir, env={"GPUDRA_CONFIG": name})
        await published_devices(kube, driver, node, 2)
        scene = Scene(kube, name, driver, node, OPERATOR_NS, AGENT_NS, workdir, "", pod, operator, agent)

        stopping = asyncio.create_task(scene.stop_agent_when_its_pod_goes())
        done = await asyncio.to_thread(run_uninstall, cluster.kubeconfig)
        assert await stopping == 0, agent.log_tail()
        assert done.returncode == 0, done.stdout + done.stderr
        await scene.everything_gone()
        said = agent.log_path.read_text()  # being deleted (foreground), or gone already, when its pod went
        assert (f"uninstall: GpuDraConfig {name} is being deleted" in said
                or f"uninstall: GpuDraConfig {name} is gone" in said), agent.log_tail()
        assert "forbidden" not in operator.log().lower()
        operator.stop()

        # off the event loop: the simulated kubelet confirms the operator pods' deletion meanwhile
        deleted = await asyncio.to_thread(cluster.kubectl, "delete", "-k", str(BASE), "--timeout=120s", check=False,
                                          timeout=180)
        assert deleted.returncode == 0, deleted.stdout + deleted.stderr + cluster.kubectl(
            "get", "ns,pods", "-A", "-o", "wide", check=False).stdout + cluster.kubectl(
            "get", "ns", OPERATOR_NS, AGENT_NS, "-o", "yaml", check=False).stdout
        left = cluster.kubectl("get", "-f", "-", "-o", "name", "--ignore-not-found", input=yaml.safe_dump_all(objects),
                               check=False)
        assert left.stdout.split() == [], left.stdout + left.stderr
        policies = cluster.kubectl("get", "validatingadmissionpolicies,validatingadmissionpolicybindings", "-o", "name")
        assert [p for p in policies.stdout.split() if "gpudra" in p] == []
        assert [s async for s in kube.list(SLICE, field_selector=f"spec.driver={driver}")] == []
    finally:
        simulator.cancel()
        for process in (agent, operator):
            if process is not None:
                process.stop()
        await remove_config(kube, name)
        cluster.kubectl("delete", "-k", str(BASE), "--ignore-not-found", "--wait=false", check=False)
        await restore_crd(kube)


async def restore_crd(kube: Kube) -> None:
    """The session's CRD (the crd_installed fixture) back for the tests after this one."""
    crd = yaml.safe_load((REPO / "crds" / "gpudraconfig.yaml").read_text())
    crd_type = resource_type("apiextensions.k8s.io/v1", "CustomResourceDefinition")

    async def applied() -> bool:  # the deleted CRD's name is taken until its deletion completes
        current = await kube.get(crd_type, crd["metadata"]["name"])
        if current is not None and current["metadata"].get("deletionTimestamp"):
            return False
        await kube.apply(crd)
        live = await kube.get(crd_type, crd["metadata"]["name"])
        return any(c["type"] == "Established" and c["status"] == "True"
                   for c in ((live or {}).get("status") or {}).get("conditions") or [])

    await wait_for(applied, timeout=120, what="the GpuDraConfig CRD served again")


@pytest.mark.timeout(1200)  # the images fixture builds the images when make test did not
async def test_the_hook_job_runs_in_the_operator_image(
        cluster: ControlPlane, kube: Kube, crd_installed: Obj, namespace: str, images: dict[str, str],
        tmp_path: Path) -> None:
    """The Job as the chart renders it (the image's entrypoint `gpudra`, the Job's args, user 65532, a
    read-only root), with the hook's own token, against the real API server: it refuses while a pod
    holds a claim of the driver, then removes the config."""
    suffix = secrets.token_hex(3)
    name, driver = f"img-{suffix}", f"img-{suffix}.gpudra.io"
    operator_ns = await create_scratch_namespace(kube, "ops")
    hook = hook_objects(operator_ns, AGENT_NS)
    [job] = [o for o in hook if o["kind"] == "Job"]
    container = job["spec"]["template"]["spec"]["containers"][0]
    try:
        for obj in hook:
            if obj["kind"] != "Job":
                await kube.apply(obj)
        await kube.create(gpudra_config(name, driver, namespace=AGENT_NS))  # no operator here
        worker = await kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "worker", "namespace": namespace},
                                    "spec": {"containers": [{"name": "c", "image": "x"}]}})
        await allocated_claim(kube, namespace, "held", driver, "some-node", ["gpu-0"])
        await kube.patch(CLAIM, "held", {"status": {"reservedFor": [
            {"resource": "pods", "name": "worker", "uid": worker["metadata"]["uid"]}]}},
            namespace=namespace, subresource="status")
        # What the Job's pod gets: its ServiceAccount's token and the cluster's CA, readable by 65532.
        mounted = tmp_path / "kube"
        mounted.mkdir()
        (mounted / "ca.crt").write_bytes(cluster.pki.ca.cert.read_bytes())
        token = await request_token(kube, operator_ns, "gpudra-uninstall")
        config = yaml.safe_load(token_kubeconfig(cluster, token, tmp_path / "hook.kubeconfig").read_text())
        config["clusters"][0]["cluster"]["certificate-authority"] = "/kube/ca.crt"
        (mounted / "config").write_text(yaml.safe_dump(config))
        for path in (mounted, *mounted.iterdir()):
            path.chmod(0o755 if path.is_dir() else 0o644)

        def hook_job() -> subprocess.CompletedProcess[str]:
            return podman("run", "--rm", "--network=host", "--read-only", "--tmpfs", "/tmp", "--user", "65532:65532",
                          "-v", f"{mounted}:/kube:ro", "-e", "KUBECONFIG=/kube/config",
                          *(f"--env={e['name']}={e['value']}" for e in container["env"]),
                          images["operator"], *container["args"], check=False)

        refused = await asyncio.to_thread(hook_job)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert f"pod {namespace}/worker (claim {namespace}/held)" in refused.stderr, refused.stderr
        assert await kube.get(CONFIG, name) is not None

        await kube.delete(POD, "worker", namespace, grace_period_seconds=0)
        await kube.patch(CLAIM, "held", {"status": {"reservedFor": None}}, namespace=namespace, subresource="status")
        done = await asyncio.to_thread(hook_job)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"done: GpuDraConfig(s) {name} and everything they created are gone" in done.stdout
        assert await kube.get(CONFIG, name) is None
    finally:
        await remove_config(kube, name)
        for obj in hook:
            if obj["kind"] in ("ClusterRole", "ClusterRoleBinding"):
                await kube.delete(resource_type("rbac.authorization.k8s.io/v1", obj["kind"]), obj["metadata"]["name"])
        await delete_namespace(kube, operator_ns)
