"""The kubelet plugin under a real kubelet (v1.35, the release's binary) instead of the tests'
kubelet-side client: its plugin watcher finds the agent's registration socket, its DRA manager
prepares the seed pod's claim that the real scheduler allocated, its pod workers hand the CDI
device IDs to the container runtime (``fakecri``, which resolves them against the CDI specs as
containerd does), and deleting the pod unprepares the claim. Then a rolling update of the agent:
a second instance registers next to the first, the first stops, and the kubelet goes on with the
second, which unprepares what the first prepared. Then a crash: the agent is SIGKILLed and
restarted in the same pod, and the kubelet registers it again and goes on with it. Then the
kubelet restarts while the agent runs: it registers the agent again, prepares a prepared claim a
second time (its pod's sandbox died meanwhile) and gets the same answer, with the spec rewritten
only when it was lost. Last, a pod with two claims and two containers: each container gets only
its own claim's GPU. And the DaemonSet's probes, as rendered: the kubelet's gRPC prober passes
the startup probe against a serving agent and restarts the container once the agent's liveness
check fails.

The kubelet's Node is tainted so that no other test's pods land on it."""

from __future__ import annotations

import functools
import secrets
import signal
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import pytest_asyncio
from cdispec import validate_claim_spec
from fakecri.gen import api_pb2 as pb
from fakecri.runtime import POD_IP_ANNOTATION, FakeRuntime
from nodestate import checkpoint_states
from realkubelet import RealKubelet, kubelet_binary
from scrape import sample_value, scrape
from seedobjects import published_devices, seed_objects

from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_driver.plugin.plugin import socket_paths
from gpudra_dev.localcluster.agents import AgentProcess, start_agent
from gpudra_dev.localcluster.controlplane import ControlPlane, free_port
from gpudra_dev.localcluster.fakedriverroot import make_driver_root
from gpudra_dev.localcluster.objects import delete_node, events_about
from gpudra_dev.localcluster.waiting import wait_for
from gpudra_operator.render import render

CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")
DEVICE_CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")
POD = resource_type("v1", "Pod")
SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
TAINT = "gpudra.io/real-kubelet"


@dataclass
class NodeAgent:
    """One agent process, as a DaemonSet pod's container runs it."""

    agent: AgentProcess
    pod_uid: str
    metrics_port: int
    registration_socket: Path

    def registrations(self) -> int:
        """How often the kubelet has registered it (NotifyRegistrationStatus, registered)."""
        return self.agent.log_path.read_text(errors="replace").count("registered with the kubelet as")

    def prepared_claims(self) -> float:
        """Claims the kubelet asked it to prepare (its gpudra_agent_node_prepare_total)."""
        return sample_value(scrape(self.metrics_port), "gpudra_agent_node_prepare_total") or 0.0

    def stop(self, sig: int = signal.SIGTERM) -> int:
        return self.agent.stop(sig)


@dataclass
class KubeletNode:
    name: str
    kubelet: RealKubelet
    runtime: FakeRuntime
    workdir: Path
    driver: str
    cdi_dir: Path
    cluster: ControlPlane
    kube: Kube
    agents: list[NodeAgent] = field(default_factory=list)  # all started, stopped at teardown

    @property
    def kubelet_dir(self) -> Path:
        return self.kubelet.root_dir

    @functools.cached_property
    def driver_root(self) -> Path:
        """The node's one fake driver root (mock NVML, real device nodes), shared by its agents."""
        return make_driver_root(self.workdir / "driver-root", "dgx-h100")

    def checkpoint(self) -> dict[str, str]:
        return checkpoint_states(self.kubelet_dir, self.driver)

    def spec_path(self, claim_uid: str) -> Path:
        return self.cdi_dir / f"k8s.{self.driver}-claim_{claim_uid}.json"

    async def serving_agent(self, pod_uid: str | None = None, extra_args: tuple[str, ...] = ()) -> NodeAgent:
        """An agent as the DaemonSet's pod ``pod_uid`` would run it (a new pod when None), once it
        has published the node's 8 GPUs and the kubelet has registered it. Each process logs
        into a directory of its own."""
        pod_uid = pod_uid or str(uuid.uuid4())
        port = free_port()
        process = start_agent(kubeconfig=self.cluster.kubeconfig, node_name=self.name, nvml="mock:dgx-h100",
                              driver=self.driver, workdir=self.workdir / f"agent-{len(self.agents)}",
                              kubelet_dir=self.kubelet_dir, cdi_dir=self.cdi_dir, driver_root=self.driver_root,
                              extra_args=("--pod-uid", pod_uid, "--metrics-port", str(port), *extra_args))
        agent = NodeAgent(process, pod_uid, port, socket_paths(self.kubelet_dir, self.driver, pod_uid)[1])
        self.agents.append(agent)
        await published_devices(self.kube, self.driver, self.name, 8)
        await self.registered(agent)
        return agent

    async def registered(self, agent: NodeAgent, times: int = 1) -> None:
        """The kubelet has registered ``agent`` ``times`` times in all (the agent got its
        NotifyRegistrationStatus)."""
        async def notified() -> bool:
            assert agent.agent.process.poll() is None, f"agent exited:\n{agent.agent.log_tail()}"
            self.kubelet.assert_running()
            return agent.registrations() >= times

        await wait_for(notified, timeout=60, what=f"the kubelet to register the agent ({agent.agent.log_path})")


@pytest_asyncio.fixture(loop_scope="session")
async def kubelet_node(cluster: ControlPlane, kube: Kube, short_dir: Path) -> AsyncIterator[KubeletNode]:
    name, driver = f"kubelet-{secrets.token_hex(3)}", f"k{secrets.token_hex(4)}.gpudra.io"
    cdi_dir = short_dir / "cdi"
    cdi_dir.mkdir()
    socket = short_dir / "cri.sock"
    kubelet = RealKubelet(kubelet_binary(cluster.bin_dir), short_dir / "kubelet", kubeconfig=cluster.kubeconfig,
                          node_name=name, runtime_endpoint=f"unix://{socket}", taint=f"{TAINT}=:NoSchedule")
    runtime = FakeRuntime(socket, [cdi_dir], log_root=kubelet.pod_logs_dir).start()
    node = KubeletNode(name, kubelet, runtime, short_dir, driver, cdi_dir, cluster, kube)
    try:
        kubelet.start()
        await kube.create({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": driver},
                           "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]}})
        await kubelet.wait_ready(kube)
        yield node
    finally:
        for agent in node.agents:
            agent.stop()
        kubelet.stop()
        runtime.stop()
        await kube.delete(DEVICE_CLASS, driver)
        await delete_node(kube, name)


def seed_pod_for(node: KubeletNode, namespace: str, pod_name: str, restart_policy: str = "Never") -> tuple[Obj, Obj]:
    """The seed's claim template and pod, pinned to the kubelet's node (tolerating its taint)."""
    template, pod = seed_objects(node.driver, namespace)
    pod["spec"]["restartPolicy"] = restart_policy
    template["metadata"]["name"] = f"{pod_name}-gpu"
    pod["metadata"]["name"] = pod_name
    spec = pod["spec"]
    spec["resourceClaims"][0]["resourceClaimTemplateName"] = template["metadata"]["name"]
    spec.update(nodeSelector={"kubernetes.io/hostname": node.name}, automountServiceAccountToken=False,
                terminationGracePeriodSeconds=1,
                # The kubelet registers its Node with the not-ready taint; the node lifecycle
                # controller that would lift it is off in this cluster (its fake Nodes have no kubelet).
                tolerations=[{"key": key, "operator": "Exists", "effect": "NoSchedule"}
                             for key in (TAINT, "node.kubernetes.io/not-ready")])
    return template, pod


async def running(kube: Kube, node: KubeletNode, namespace: str, pod_name: str) -> Obj:
    async def probe() -> Obj | None:
        node.kubelet.assert_running()
        pod = await kube.get(POD, pod_name, namespace)
        return pod if pod and pod["status"].get("phase") == "Running" else None

    try:
        return await wait_for(probe, timeout=90, what=f"pod {namespace}/{pod_name} to run on the real kubelet")
    except AssertionError as error:
        pod = await kube.get(POD, pod_name, namespace)
        raise AssertionError(f"{error}\npod status: {pod and pod.get('status')}\nruntime: {node.runtime.describe()}\n"
                             f"kubelet log:\n{node.kubelet.log_tail()}") from None


async def start_seed_pod(kube: Kube, node: KubeletNode, namespace: str, pod_name: str,
                         restart_policy: str = "Never") -> tuple[Obj, Obj]:
    """Create the seed pod, wait until the kubelet runs it; returns (pod, its claim), the claim
    prepared: its spec written, its checkpoint entry complete."""
    template, pod = seed_pod_for(node, namespace, pod_name, restart_policy)
    await kube.create(template)
    await kube.create(pod)
    pod = await running(kube, node, namespace, pod_name)
    (status,) = pod["status"]["resourceClaimStatuses"]
    claim = await kube.get(CLAIM, status["resourceClaimName"], namespace)
    assert claim is not None, f"the claim of running pod {pod_name} is gone"
    uid = claim["metadata"]["uid"]
    assert node.spec_path(uid).is_file() and node.checkpoint().get(uid) == "PrepareCompleted"
    return pod, claim


async def delete_and_wait_unprepared(kube: Kube, node: KubeletNode, pod: Obj, *claim_uids: str) -> None:
    """Delete ``pod``; wait until the kubelet has unprepared its (prepared) claims and deleted it."""
    meta = pod["metadata"]
    for uid in claim_uids:
        assert node.spec_path(uid).is_file() and node.checkpoint().get(uid) == "PrepareCompleted", \
            f"claim {uid} not prepared to begin with"
    await kube.delete(POD, meta["name"], meta["namespace"])

    async def unprepared() -> bool:
        node.kubelet.assert_running()
        checkpoint = node.checkpoint()
        return not any(node.spec_path(uid).exists() or uid in checkpoint for uid in claim_uids)

    await wait_for(unprepared, timeout=90, what=f"the kubelet to unprepare claims {claim_uids} of {meta['name']}")

    async def gone() -> bool:
        return await kube.get(POD, meta["name"], meta["namespace"]) is None

    await wait_for(gone, timeout=60, what=f"pod {meta['name']} to be deleted by its kubelet")


async def slice_uids(kube: Kube, node: KubeletNode) -> set[str]:
    field_selector = f"spec.driver={node.driver},spec.nodeName={node.name}"
    return {s["metadata"]["uid"] async for s in kube.list(SLICE, field_selector=field_selector)}


async def test_a_real_kubelet_prepares_the_seed_pods_claim_and_the_runtime_gets_its_gpu(
        kube: Kube, namespace: str, kubelet_node: KubeletNode) -> None:
    agent = await kubelet_node.serving_agent()
    devices = await published_devices(kube, kubelet_node.driver, kubelet_node.name, 8)
    assert agent.registration_socket.is_socket()
    pod, claim = await start_seed_pod(kube, kubelet_node, namespace, "train")

    uid = claim["metadata"]["uid"]
    (allocated,) = claim["status"]["allocation"]["devices"]["results"]
    assert (allocated["driver"], allocated["pool"]) == (kubelet_node.driver, kubelet_node.name)
    gpu = devices[allocated["device"]]
    # The runtime got the CDI ID of the allocated GPU and nothing else, and it resolved to that
    # GPU's UUID and device node in a spec valid against the CDI schema.
    (container,) = kubelet_node.runtime.runtime.containers_of("train")
    cdi_ids = [device.name for device in container.config.CDI_devices]
    assert cdi_ids == [f"k8s.{kubelet_node.driver}/claim={uid}-{allocated['device']}",
                       f"k8s.{kubelet_node.driver}/claim={uid}_gpu"]  # and its device metadata's mount
    validate_claim_spec(kubelet_node.cdi_dir, uid, cdi_ids)
    metadata = (f"/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpu/gpu/"
                f"{kubelet_node.driver}-metadata.json")
    assert Path(container.cdi.mounts[metadata]).is_file(), container.cdi.mounts
    assert container.cdi.env["NVIDIA_VISIBLE_DEVICES"] == gpu["attributes"]["uuid"]["string"]
    assert f"/dev/nvidia{gpu['attributes']['minor']['int']}" in container.cdi.device_nodes
    assert "/dev/nvidiactl" in container.cdi.device_nodes
    # and the driver's CUDA user space, bind-mounted from files that exist on the host
    driver_version = gpu["attributes"]["driverVersion"]["version"]
    for path in (f"/usr/lib/x86_64-linux-gnu/libcuda.so.{driver_version}",
                 f"/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.{driver_version}", "/usr/bin/nvidia-smi"):
        assert path in container.cdi.mounts, f"{path} not mounted: {sorted(container.cdi.mounts)}"
        assert Path(container.cdi.mounts[path]).exists(), f"{path}: no host source {container.cdi.mounts[path]}"
    assert agent.prepared_claims() == 1

    await delete_and_wait_unprepared(kube, kubelet_node, pod, uid)
    assert len(kubelet_node.runtime.runtime.sandboxes_of("train")) == 1
    assert len(kubelet_node.runtime.runtime.containers_of("train")) == 1
    assert agent.stop() == 0, agent.agent.log_tail()
    assert not agent.registration_socket.exists(), "the stopped agent left its registration socket"


async def test_a_real_kubelet_moves_to_the_new_agent_of_a_rolling_update(
        kube: Kube, namespace: str, kubelet_node: KubeletNode) -> None:
    old = await kubelet_node.serving_agent()
    first, first_claim = await start_seed_pod(kube, kubelet_node, namespace, "before-update")

    # maxSurge 1: the new instance starts and registers next to the old one, then the old stops.
    new = await kubelet_node.serving_agent()
    assert old.stop() == 0, old.agent.log_tail()

    second, second_claim = await start_seed_pod(kube, kubelet_node, namespace, "after-update")
    first_uid, second_uid = first_claim["metadata"]["uid"], second_claim["metadata"]["uid"]
    assert (first_claim["status"]["allocation"]["devices"]["results"][0]["device"]
            != second_claim["status"]["allocation"]["devices"]["results"][0]["device"])
    assert kubelet_node.checkpoint() == {first_uid: "PrepareCompleted", second_uid: "PrepareCompleted"}

    # The old instance prepared the first claim; only the new one is left to unprepare it.
    await delete_and_wait_unprepared(kube, kubelet_node, first, first_uid)
    await delete_and_wait_unprepared(kube, kubelet_node, second, second_uid)
    assert new.prepared_claims() == 1
    assert new.agent.process.poll() is None, new.agent.log_tail()


async def test_a_real_kubelet_registers_an_agent_again_after_it_crashed_and_restarted(
        kube: Kube, namespace: str, kubelet_node: KubeletNode) -> None:
    agent = await kubelet_node.serving_agent()
    first, first_claim = await start_seed_pod(kube, kubelet_node, namespace, "before-crash")

    # The container crashes (SIGKILL: its sockets stay behind) and the kubelet restarts it in the
    # same pod: same pod UID, so the same socket names.
    assert agent.stop(signal.SIGKILL) == -signal.SIGKILL
    assert agent.registration_socket.is_socket()
    restarted = await kubelet_node.serving_agent(agent.pod_uid)
    assert restarted.registration_socket == agent.registration_socket

    second, second_claim = await start_seed_pod(kube, kubelet_node, namespace, "after-crash")
    await delete_and_wait_unprepared(kube, kubelet_node, first, first_claim["metadata"]["uid"])
    await delete_and_wait_unprepared(kube, kubelet_node, second, second_claim["metadata"]["uid"])
    assert restarted.prepared_claims() == 1
    assert restarted.agent.process.poll() is None, restarted.agent.log_tail()


@pytest.mark.parametrize("spec_lost", [False, True], ids=["spec-kept", "spec-lost"])
async def test_a_restarted_kubelet_registers_the_agent_again_and_prepares_a_prepared_claim_again(
        kube: Kube, namespace: str, kubelet_node: KubeletNode, spec_lost: bool) -> None:
    """The kubelet restarts (an upgrade, a config change) while the agent keeps running; in
    between, the pod's sandbox dies (as when the runtime restarts) and, with ``spec_lost``, the
    claim's CDI spec is gone too (the CDI directory wiped: kubernetes#141433 reports pods stuck in
    CreateContainerError after that). The new kubelet, whose DRA manager restores claims from its
    checkpoint as not prepared, prepares the claim again for the pod's new sandbox: the agent
    answers as before, rewriting the spec only if it is gone."""
    agent = await kubelet_node.serving_agent()
    runtime = kubelet_node.runtime.runtime
    pod, claim = await start_seed_pod(kube, kubelet_node, namespace, "across-restart", restart_policy="Always")
    uid = claim["metadata"]["uid"]
    spec = kubelet_node.spec_path(uid)
    content, written, slices = spec.read_bytes(), spec.stat().st_mtime_ns, await slice_uids(kube, kubelet_node)
    (first,) = runtime.containers_of("across-restart")
    assert agent.prepared_claims() == 1

    kubelet_node.kubelet.stop()
    runtime.sandbox_died("across-restart")
    if spec_lost:
        spec.unlink()
    kubelet_node.kubelet.start()
    node = await kubelet_node.kubelet.wait_ready(kube)
    await kubelet_node.registered(agent, times=2)

    async def restarted_in_a_new_sandbox() -> bool:
        kubelet_node.kubelet.assert_running()
        containers = runtime.containers_of("across-restart")
        return len(containers) == 2 and containers[1].state == pb.CONTAINER_RUNNING

    try:
        await wait_for(restarted_in_a_new_sandbox, timeout=90, what="the pod to run again in a new sandbox")
    except AssertionError as error:
        raise AssertionError(f"{error}\nkubelet log:\n{kubelet_node.kubelet.log_tail()}") from None
    second = runtime.containers_of("across-restart")[1]
    assert len(runtime.sandboxes_of("across-restart")) == 2
    assert agent.prepared_claims() == 2  # the kubelet did ask again ...
    # ... and got the same answer. Kubelets before 1.37 append it to the devices restored from
    # their checkpoint, so the runtime gets each CDI ID twice (kubernetes#140471, fixed in 1.37 by
    # #140274; harmless with our specs, see docs/kubelet-plugin.md). A backport may fix older ones.
    first_ids = [device.name for device in first.config.CDI_devices]
    second_ids = [device.name for device in second.config.CDI_devices]
    version = node["status"]["nodeInfo"]["kubeletVersion"]
    fixed = tuple(int(part) for part in version.lstrip("v").split(".")[:2]) >= (1, 37)
    assert second_ids in ([first_ids] if fixed else [first_ids, first_ids * 2]), (version, first_ids, second_ids)
    assert second.cdi == first.cdi
    assert spec.read_bytes() == content
    if not spec_lost:
        assert spec.stat().st_mtime_ns == written, "a prepared claim's spec was rewritten"
    assert kubelet_node.checkpoint() == {uid: "PrepareCompleted"}

    # The new kubelet deleted the node's ResourceSlices when it started (it does so for drivers
    # not registered yet); the agent published them again.
    async def published_again() -> bool:
        return not (await slice_uids(kube, kubelet_node)) & slices

    await wait_for(published_again, timeout=60, what="the agent to publish its ResourceSlices again")
    await published_devices(kube, kubelet_node.driver, kubelet_node.name, 8)

    await delete_and_wait_unprepared(kube, kubelet_node, pod, uid)
    assert agent.agent.process.poll() is None, agent.agent.log_tail()


async def test_each_container_gets_only_the_gpu_of_the_claim_it_references(
        kube: Kube, namespace: str, kubelet_node: KubeletNode) -> None:
    """A pod with two claims and two containers, each referencing one: the kubelet prepares both
    claims and gives each container only its own claim's CDI ID, hence only its own GPU."""
    agent = await kubelet_node.serving_agent()
    devices = await published_devices(kube, kubelet_node.driver, kubelet_node.name, 8)
    template, pod = seed_pod_for(kubelet_node, namespace, "two-gpus")
    spec = pod["spec"]
    (container,) = spec["containers"]
    spec["resourceClaims"] = [{"name": name, "resourceClaimTemplateName": template["metadata"]["name"]}
                              for name in ("gpu-a", "gpu-b")]
    spec["containers"] = [{**container, "name": f"uses-{name}", "resources": {"claims": [{"name": name}]}}
                          for name in ("gpu-a", "gpu-b")]
    await kube.create(template)
    await kube.create(pod)
    pod = await running(kube, kubelet_node, namespace, "two-gpus")

    claims = {}
    for status in pod["status"]["resourceClaimStatuses"]:
        claim = await kube.get(CLAIM, status["resourceClaimName"], namespace)
        assert claim is not None
        claims[status["name"]] = claim
    assert agent.prepared_claims() == 2
    containers = {c.config.metadata.name: c for c in kubelet_node.runtime.runtime.containers_of("two-gpus")}
    uuids = set()
    for name, claim in claims.items():
        uid = claim["metadata"]["uid"]
        (allocated,) = claim["status"]["allocation"]["devices"]["results"]
        got = containers[f"uses-{name}"]
        cdi_id = f"k8s.{kubelet_node.driver}/claim={uid}-{allocated['device']}"
        metadata_id = f"k8s.{kubelet_node.driver}/claim={uid}_gpu"
        assert [device.name for device in got.config.CDI_devices] == [cdi_id, metadata_id]
        visible = got.cdi.env["NVIDIA_VISIBLE_DEVICES"]
        assert visible == devices[allocated["device"]]["attributes"]["uuid"]["string"]
        uuids.add(visible)
    assert len(uuids) == 2, "both containers see the same GPU"

    await delete_and_wait_unprepared(kube, kubelet_node, pod, *(c["metadata"]["uid"] for c in claims.values()))


async def test_a_claim_shared_by_two_pods_and_two_containers_is_prepared_once_and_kept_for_the_last(
        kube: Kube, namespace: str, kubelet_node: KubeletNode) -> None:
    """One ResourceClaim referenced by two pods, the first with two containers using it: all three
    containers get the same GPU; the kubelet prepares the claim once and unprepares it only when
    the last pod using it is gone (its claim cache counts the pods; the agent answers again
    whatever it is asked again)."""
    agent = await kubelet_node.serving_agent()
    devices = await published_devices(kube, kubelet_node.driver, kubelet_node.name, 8)
    template, first = seed_pod_for(kubelet_node, namespace, "shares-a")
    claim_obj = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                 "metadata": {"name": "shared-gpu", "namespace": namespace}, "spec": template["spec"]["spec"]}
    shared = await kube.create(claim_obj)
    uid = shared["metadata"]["uid"]
    (container,) = first["spec"]["containers"]
    first["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": "shared-gpu"}]
    first["spec"]["containers"] = [{**container, "name": name} for name in ("trainer", "sidecar")]
    _, second = seed_pod_for(kubelet_node, namespace, "shares-b")
    second["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": "shared-gpu"}]
    for pod in (first, second):
        await kube.create(pod)
        await running(kube, kubelet_node, namespace, pod["metadata"]["name"])
    claim = await kube.get(CLAIM, "shared-gpu", namespace)
    assert claim is not None and len(claim["status"]["reservedFor"]) == 2
    (allocated,) = claim["status"]["allocation"]["devices"]["results"]
    gpu_uuid = devices[allocated["device"]]["attributes"]["uuid"]["string"]
    cdi_id = f"k8s.{kubelet_node.driver}/claim={uid}-{allocated['device']}"
    containers = [c for pod in ("shares-a", "shares-b") for c in kubelet_node.runtime.runtime.containers_of(pod)]
    assert len(containers) == 3
    for got in containers:  # the GPU, and the mount of the claim's device metadata
        metadata_id = f"k8s.{kubelet_node.driver}/claim={uid}_gpu"
        assert [device.name for device in got.config.CDI_devices] == [cdi_id, metadata_id]
        assert got.cdi.env["NVIDIA_VISIBLE_DEVICES"] == gpu_uuid
    assert agent.prepared_claims() == 1  # prepared once for all three containers

    first_obj = await kube.get(POD, "shares-a", namespace)
    assert first_obj is not None
    await kube.delete(POD, "shares-a", namespace)

    async def first_gone() -> bool:
        return await kube.get(POD, "shares-a", namespace) is None

    await wait_for(first_gone, timeout=60, what="the first pod to be deleted by its kubelet")
    # still in use by the second pod: not unprepared
    assert kubelet_node.spec_path(uid).is_file() and kubelet_node.checkpoint().get(uid) == "PrepareCompleted"
    second_obj = await kube.get(POD, "shares-b", namespace)
    assert second_obj is not None
    await delete_and_wait_unprepared(kube, kubelet_node, second_obj, uid)


async def test_the_kubelet_restarts_an_agent_whose_liveness_probe_fails(
        kube: Kube, namespace: str, kubelet_node: KubeletNode) -> None:
    """The DaemonSet's startup and liveness probes, as the operator renders them, run by the real
    kubelet's gRPC prober against a real agent: the startup probe passes once the agent serves;
    with the agent's registration socket removed from under it, the liveness probe fails and the
    kubelet restarts the container. (The fake runtime runs no processes: the agent is a process of
    the test, and the pod's IP is loopback, where the agent's health port listens.)"""
    health_port = free_port()
    agent = await kubelet_node.serving_agent(extra_args=("--health-port", str(health_port)))
    rendered = render({"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig", "metadata": {"name": "probes"},
                       "spec": {}}).daemonset
    assert rendered is not None
    (container,) = rendered["spec"]["template"]["spec"]["containers"]
    probes = {name: {**container[name], "grpc": {**container[name]["grpc"], "port": health_port}}
              for name in ("startupProbe", "livenessProbe")}
    probes["livenessProbe"].update(periodSeconds=1, failureThreshold=1)  # the same check, sooner
    probes["startupProbe"].update(periodSeconds=1)
    _, pod = seed_pod_for(kubelet_node, namespace, "agent-probes", restart_policy="Always")
    spec = pod["spec"]
    spec.pop("resourceClaims")
    spec["containers"] = [{"name": "agent", "image": container["image"], **probes}]
    pod["metadata"]["annotations"] = {POD_IP_ANNOTATION: "127.0.0.1"}
    await kube.create(pod)

    async def status() -> Obj:
        kubelet_node.kubelet.assert_running()
        got = await kube.get(POD, "agent-probes", namespace)
        assert got is not None
        return (got["status"].get("containerStatuses") or [{}])[0]

    async def started() -> bool:
        return bool((await status()).get("started"))

    await wait_for(started, timeout=60, what="the kubelet's startup probe to pass against the agent")
    assert (await status())["restartCount"] == 0
    agent.registration_socket.unlink()  # the kubelet deregisters the plugin; only a restart brings it back

    async def restarted() -> bool:
        return (await status()).get("restartCount", 0) >= 1

    await wait_for(restarted, timeout=60, what="the kubelet to restart the container after its liveness probe failed")
    messages = [e.get("message", "") for e in await events_about(kube, "agent-probes", namespace)]
    assert any("Liveness probe failed" in m and "NOT_SERVING" in m for m in messages), messages
    assert "liveness check failed" in agent.agent.log_tail()
    await kube.delete(POD, "agent-probes", namespace)

    async def gone() -> bool:
        return await kube.get(POD, "agent-probes", namespace) is None

    await wait_for(gone, timeout=60, what="pod agent-probes to be deleted by its kubelet")

