"""The Helm chart's whole life on a node with a real container runtime, with GPU workloads running:
install from an OCI registry, `helm test`, upgrade from the previous release to this tree, version
skew held for as long as a rollout can last, rollback, uninstall.

The previous release is built from the commit hack/previous-release pins (hack/previous-release.sh:
a worktree of it, its own hack/images.sh, its chart packaged); this tree's images by hack/images.sh
and its chart by helm. Both charts are pushed to a registry on this machine and installed from
there (``helm install oci://...``), and the node's containerd pulls both releases' images from the
same registry. The node, the registry and the pod network's stand-in are tests/installnode.py's,
on a control plane of this module's own (the chart installs the CRD, which the session's shared
control plane already has from other tests). The operator's and agents' namespaces are made by
the test with Pod Security ``privileged`` (the chart's ``namespaces.create=false``), because the
stand-in for the pod network puts their pods on the host network.

Under load: one pod runs on a prepared claim, printing its GPU and holding it; a second pod's claim
is prepared but not used yet (its init container waits, so the GPU's container has not started).
Through the upgrade the running pod keeps its container (never restarted), no claim is unprepared
or prepared again (their CDI specs and checkpoint entries untouched), a watch on the node's
ResourceSlices sees them never go (the longest time without one is measured), the operator's Lease
moves to a new replica, and a pod created during the upgrade starts. Then the waiting pod's GPU
container starts on the claim the previous release prepared.

Skew: with the node cut off from the registry, the new operator's agents cannot be pulled, so the previous
release's agent keeps the node for as long as that lasts (maxSurge keeps the old agent until the new
one is Ready): it prepares a new pod's claim under the new operator, and the config is never Degraded.
The reverse on rollback: the previous release's operator with this tree's agent.

On this tree's chart, `helm test` (gpudra status in the operator image) passes and the seed workload
(manifests/samples/seed-workload.yaml as it is) runs on a GPU of >= 64Gi and completes.

Rollback (`helm rollback`): the previous release's agent reads the checkpoint this tree's agent
wrote (claims prepared by either) and unprepares a claim this tree prepared."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import pytest_asyncio
import yaml
from installnode import (DRIVER_ROOT, RELEASE, SEED, InstallNode, forget_images, install_node, node_pulls, pod_log,
                         podman, seed_workload_image, touch_in_container, without_make_flags)
from nodestate import checkpoint_states
from realruntime import TEST_IMAGE

from gpudra_core.kubeapi import Kube, Obj, connect, resource_type
from gpudra_dev.localcluster.controlplane import ControlPlane, find_binaries
from gpudra_dev.localcluster.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "manifests" / "samples" / "gpudraconfig.yaml"
CHART = REPO / "manifests" / "helm" / "gpudra"
OPERATOR_NS, AGENT_NS, WORK_NS = "gpudra-operator", "gpudra-system", "default"
EARLIER_FINALIZER = "gpudra.io/cleanup"  # what the previous release guards configs with
DRIVER = "gpu.gpudra.io"
RELEASE_NAME = "gpudra"
DONE = "gpudra-lifecycle-done"
GO = "/tmp/gpudra-go"  # in a waiting pod's init container: the test lets it end

CONFIG = resource_type("gpudra.io/v1alpha1", "GpuDraConfig")
CRD = resource_type("apiextensions.k8s.io/v1", "CustomResourceDefinition")
POD = resource_type("v1", "Pod")
NAMESPACE = resource_type("v1", "Namespace")
SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")
TEMPLATE = resource_type("resource.k8s.io/v1", "ResourceClaimTemplate")
LEASE = resource_type("coordination.k8s.io/v1", "Lease")
NODE = resource_type("v1", "Node")
DEVICE_CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")
JOB = resource_type("batch/v1", "Job")
POLICIES = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies"
BINDINGS = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings"

pytestmark = pytest.mark.timeout(2400)  # the previous release's images may have to be built first


# -- the two releases --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Release:
    name: str                 # "previous" or "this tree"
    operator_image: str       # in podman's store
    agent_image: str
    chart: Path               # the packaged chart
    chart_version: str
    tree: Path                # its sources: manifests/base for `kubectl apply -k`

    def tag(self) -> str:
        return self.agent_image.rsplit(":", 1)[1]


def helm_binary() -> str:
    proc = subprocess.run([str(REPO / "hack" / "helm-bin.sh")], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0 and proc.stdout.strip(), f"hack/helm-bin.sh (make helm-bin) failed:\n{proc.stderr[-3000:]}"
    return proc.stdout.strip().splitlines()[-1]


def previous_release() -> Release:
    proc = subprocess.run([str(REPO / "hack" / "previous-release.sh")], capture_output=True, text=True, timeout=2000)
    assert proc.returncode == 0, (f"hack/previous-release.sh (make previous-release) exited {proc.returncode}:\n"
                                  f"{proc.stderr[-5000:]}")
    out = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    return Release("previous", out["operator_image"], out["agent_image"], Path(out["chart"]), out["chart_version"],
                   Path(out["tree"]))


def this_tree(helm: str, out: Path) -> Release:
    proc = subprocess.run([str(REPO / "hack" / "images.sh"), "operator", "agent"], capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, f"hack/images.sh (make images) exited {proc.returncode}:\n{proc.stderr[-5000:]}"
    refs = proc.stdout.strip().splitlines()[-1].split()
    operator = next(r for r in refs if "/gpudra-operator:" in r)
    agent = next(r for r in refs if "/gpudra:" in r)
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    out.mkdir(parents=True, exist_ok=True)
    packaged = subprocess.run([helm, "package", str(CHART), "--destination", str(out)], capture_output=True, text=True,
                              timeout=120)
    assert packaged.returncode == 0, packaged.stderr
    return Release("this tree", operator, agent, out / f"gpudra-{version}.tgz", version, REPO)


# -- the cluster -------------------------------------------------------------------------------------

@dataclass
class Lab:
    plane: ControlPlane
    kube: Kube
    node: InstallNode
    helm: str
    previous: Release
    current: Release
    pushed: list[str] = field(default_factory=list)  # image names given for the registry

    def env(self) -> dict[str, str]:
        return {**without_make_flags(os.environ),
                "KUBECONFIG": str(self.plane.kubeconfig), "HELM_CACHE_HOME": str(self.node.workdir / "helm-cache"),
                "HELM_CONFIG_HOME": str(self.node.workdir / "helm-config"),
                "HELM_DATA_HOME": str(self.node.workdir / "helm-data")}

    def helm_run(self, *args: str, timeout: float = 400, check: bool = True) -> subprocess.CompletedProcess[str]:
        started = time.monotonic()
        proc = subprocess.run([self.helm, *args], capture_output=True, text=True, timeout=timeout, env=self.env())
        print(f"[helm] helm {' '.join(args)}  ({time.monotonic() - started:.1f}s, exit {proc.returncode})\n"
              f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        if check:
            assert proc.returncode == 0, f"helm {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
        return proc

    @property
    def chart_ref(self) -> str:
        return f"oci://{self.node.registry.host}/charts/gpudra"

    def image_values(self, release: Release) -> list[str]:
        registry = self.node.registry.host
        return ["--set", f"operator.image.repository={registry}/gpudra/gpudra-operator",
                "--set", f"operator.image.tag={release.tag()}",
                "--set", f"agent.image.repository={registry}/gpudra/gpudra",
                "--set", f"agent.image.tag={release.tag()}",
                "--set", "namespaces.create=false", *self.one_replica(release)]

    def one_replica(self, release: Release) -> list[str]:
        """The previous release names its Lease holder after the host name and PID, the same for
        two replicas of one node on the host network (the stand-in for a pod network here): both
        would lead. This tree names it after the pod; the previous release runs one replica here."""
        return ["--set", "operator.replicas=1"] if release is self.previous else []

    def install_args(self, release: Release) -> list[str]:
        return [self.chart_ref, "--version", release.chart_version, "--ca-file", str(self.node.registry.ca),
                *self.image_values(release)]


def push(lab: Lab, release: Release) -> None:
    """Both images into the registry under its host, and the chart as an OCI artifact."""
    env = lab.node.registry.client_env()
    for image, name in ((release.operator_image, "gpudra-operator"), (release.agent_image, "gpudra")):
        target = f"{lab.node.registry.host}/gpudra/{name}:{release.tag()}"
        tagged = podman("tag", image, target)
        assert tagged.returncode == 0, tagged.stderr
        lab.pushed.append(target)
        pushed = podman("push", target, env=env, timeout=600)
        assert pushed.returncode == 0, f"podman push {target}: {pushed.stderr}"
    lab.helm_run("push", str(release.chart), f"oci://{lab.node.registry.host}/charts",
                 "--ca-file", str(lab.node.registry.ca))


async def remove_everything(lab_box: dict[str, Lab], setup: InstallNode) -> None:
    lab = lab_box.get("lab")
    try:
        if lab is not None:
            for name in await workload_pods(lab.kube):
                await lab.kube.delete(POD, name, WORK_NS)
            await wait_for(lambda: _no_workloads(lab.kube), timeout=120, what="the workload pods to go")
            if lab.helm_run("status", RELEASE_NAME, check=False).returncode == 0:
                lab.helm_run("uninstall", RELEASE_NAME, "--wait", "--timeout", "5m", check=False)
            if await lab.kube.get(CONFIG, "default") is not None:  # no uninstall hook took it
                await lab.kube.delete(CONFIG, "default")
            for namespace in (OPERATOR_NS, AGENT_NS):
                await lab.kube.delete(NAMESPACE, namespace)
            await wait_for(lambda: _namespaces_gone(lab.kube), timeout=180, what="the operator's and agents' namespaces to go")
    finally:
        if lab is not None:
            forget_images(lab.pushed)


async def workload_pods(kube: Kube) -> list[str]:
    return [p["metadata"]["name"] async for p in kube.list(POD, WORK_NS, label_selector="gpudra-test=lifecycle")]


async def _no_workloads(kube: Kube) -> bool:
    return not await workload_pods(kube)


async def _namespaces_gone(kube: Kube) -> bool:
    return all([await kube.get(NAMESPACE, n) is None for n in (OPERATOR_NS, AGENT_NS)])


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def lab(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Lab]:
    helm = helm_binary()
    started = time.monotonic()
    previous = previous_release()
    current = this_tree(helm, tmp_path_factory.mktemp("charts"))
    print(f"\n[lifecycle] both releases built (or found) in {time.monotonic() - started:.1f}s: "
          f"{previous.agent_image}, {current.agent_image}")
    plane = ControlPlane(find_binaries(), tmp_path_factory.mktemp("lifecycle-cluster"))
    plane.start()
    api = await connect(str(plane.kubeconfig))
    kube = Kube(api, field_manager="gpudra-tests")
    box: dict[str, Lab] = {}
    try:
        async with install_node(plane, kube, prefix="hl", namespaces=[OPERATOR_NS, AGENT_NS, WORK_NS],
                                taint="gpudra.io/lifecycle=:PreferNoSchedule",
                                remove_installed=lambda setup: remove_everything(box, setup)) as node:
            box["lab"] = lab = Lab(plane, kube, node, helm, previous, current)
            for namespace in (OPERATOR_NS, AGENT_NS):
                await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace, "labels": {
                    f"pod-security.kubernetes.io/{mode}": "privileged" for mode in ("enforce", "audit", "warn")}}})
            await kube.patch(NODE, node.name, {"metadata": {"labels": {"gpudra.io/gpu-node": "true"}}})
            for release in (previous, current):
                push(lab, release)
            yield lab
    finally:
        await api.close()
        plane.stop()


# -- what the test watches ---------------------------------------------------------------------------

@dataclass
class SliceWatch:
    """The node's ResourceSlices of the driver, from a watch: when the node had none, and for how long."""
    kube: Kube
    node: str
    names: set[str] = field(default_factory=set)
    empty_since: float | None = None
    gaps: list[float] = field(default_factory=list)
    events: int = 0
    task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        listed = [s async for s in self.kube.list(SLICE, field_selector=f"spec.driver={DRIVER},spec.nodeName={self.node}")]
        self.names = {s["metadata"]["name"] for s in listed}
        assert self.names, "the node publishes no ResourceSlice before the upgrade"
        version = await self._resource_version()
        self.task = asyncio.create_task(self._run(version))

    async def _resource_version(self) -> str:
        answer = await self.kube.request("GET", SLICE.path(), query={"limit": "1"})
        return str(answer["metadata"]["resourceVersion"])

    async def _run(self, version: str) -> None:
        while True:
            async for kind, obj in self.kube.watch(SLICE, field_selector=f"spec.driver={DRIVER},spec.nodeName={self.node}",
                                                   resource_version=version, timeout_seconds=300):
                version = obj.get("metadata", {}).get("resourceVersion", version)
                name = obj.get("metadata", {}).get("name")
                if kind == "ERROR":
                    raise AssertionError(f"the slice watch broke: {obj}")
                self.events += 1
                if kind == "DELETED":
                    self.names.discard(name)
                    if not self.names and self.empty_since is None:
                        self.empty_since = time.monotonic()
                elif kind in ("ADDED", "MODIFIED"):
                    self.names.add(name)
                    if self.empty_since is not None:
                        self.gaps.append(time.monotonic() - self.empty_since)
                        self.empty_since = None

    def longest_gap(self) -> float:
        open_gap = [time.monotonic() - self.empty_since] if self.empty_since is not None else []
        return max([*self.gaps, *open_gap], default=0.0)

    async def stop(self) -> None:
        if self.task is not None:
            if self.task.done() and self.task.exception():
                raise self.task.exception()  # type: ignore[misc]
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


@dataclass(frozen=True)
class Prepared:
    """What a prepared claim left on the node: proof that it was not prepared again."""
    uid: str
    spec_inode: int
    spec_mtime_ns: int
    spec_text: str


def prepared(setup: InstallNode, uid: str) -> Prepared:
    spec = setup.workdir / "cdi" / f"k8s.{DRIVER}-claim_{uid}.json"
    stat = spec.stat()
    return Prepared(uid, stat.st_ino, stat.st_mtime_ns, spec.read_text())


def checkpoint(setup: InstallNode) -> dict[str, str]:
    return checkpoint_states(setup.workdir / "kubelet", DRIVER)


# -- workloads ---------------------------------------------------------------------------------------

def gpu_pod(name: str, *, wait_first: bool = False) -> tuple[Obj, Obj]:
    """A claim template for one GPU and a pod using it that prints its GPUs and holds them; with
    ``wait_first``, an init container that waits for GO first, so the claim is prepared (the kubelet
    prepares claims before any container) and the GPU's container not started yet."""
    template = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": f"{name}-gpu", "namespace": WORK_NS},
                "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}}}}
    container = {"name": "train", "image": TEST_IMAGE, "imagePullPolicy": "Never",
                 "command": ["sh", "-c", f"nvidia-smi -L; echo {DONE}; exec sleep 3600"],
                 "resources": {"claims": [{"name": "gpu"}]}}
    spec: Obj = {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1, "containers": [container],
                 "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": f"{name}-gpu"}]}
    if wait_first:
        spec["initContainers"] = [{"name": "wait", "image": TEST_IMAGE, "imagePullPolicy": "Never",
                                   "command": ["sh", "-c", f"while [ ! -e {GO} ]; do sleep 0.2; done"]}]
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": WORK_NS, "labels": {"gpudra-test": "lifecycle"}}, "spec": spec}
    return template, pod


async def start_gpu_pod(lab: Lab, name: str, *, wait_first: bool = False) -> None:
    template, pod = gpu_pod(name, wait_first=wait_first)
    await lab.kube.create(template)
    await lab.kube.create(pod)


async def claim_of(lab: Lab, pod_name: str) -> Obj:
    async def named() -> Obj | None:
        pod = await lab.kube.get(POD, pod_name, WORK_NS)
        statuses = ((pod or {}).get("status") or {}).get("resourceClaimStatuses") or []
        return await lab.kube.get(CLAIM, statuses[0]["resourceClaimName"], WORK_NS) if statuses else None

    found: Obj = await wait_for(named, timeout=60, what=f"pod {pod_name}'s claim")
    return found


async def running_with_gpu(lab: Lab, pod_name: str, timeout: float = 180) -> tuple[Obj, str]:
    """Once the pod's GPU container has printed its GPUs: (the pod, what it printed)."""
    node = lab.node.node

    async def printed() -> tuple[Obj, str] | None:
        node.kubelet.assert_running()
        pod = await lab.kube.get(POD, pod_name, WORK_NS)
        if not pod or pod["status"].get("phase") != "Running":
            assert not pod or pod["status"].get("phase") not in ("Failed", "Succeeded"), pod["status"]
            return None
        output = pod_log(node, pod, "train")
        return (pod, output) if DONE in output else None

    try:
        found: tuple[Obj, str] = await wait_for(printed, timeout=timeout, what=f"pod {pod_name} to run with its GPU")
        return found
    except AssertionError as error:
        pod = await lab.kube.get(POD, pod_name, WORK_NS)
        raise AssertionError(f"{error}\npod: {(pod or {}).get('status')}\n{await agents_report(lab)}\n"
                             f"{lab.node.failure()}") from None


async def claim_prepared(lab: Lab, pod_name: str) -> Obj:
    claim = await claim_of(lab, pod_name)
    uid = claim["metadata"]["uid"]

    async def done() -> bool:
        return checkpoint(lab.node).get(uid) == "PrepareCompleted"

    await wait_for(done, timeout=120, what=f"pod {pod_name}'s claim {uid} to be prepared")
    allocated = await lab.kube.get(CLAIM, claim["metadata"]["name"], WORK_NS)  # prepared: allocated
    assert allocated is not None and allocated["status"].get("allocation"), allocated
    return allocated


def assert_sees_its_gpu(output: str, claim: Obj, devices: dict[str, Obj]) -> None:
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    uuid = devices[result["device"]]["attributes"]["uuid"]["string"]
    gpus = re.findall(r"^GPU \d+: .*\(UUID: (GPU-[0-9a-f-]+)\)", output, re.M)
    assert gpus == [uuid], f"the pod should see exactly its claim's GPU {uuid}:\n{output}"


async def published(lab: Lab) -> dict[str, Obj]:
    slices = [s async for s in lab.kube.list(SLICE, field_selector=f"spec.driver={DRIVER},spec.nodeName={lab.node.name}")]
    return {d["name"]: d for s in slices for d in s["spec"].get("devices") or []}


# -- the operator and the agents ---------------------------------------------------------------------

async def agents_report(lab: Lab) -> str:
    lines = []
    for namespace in (OPERATOR_NS, AGENT_NS):
        async for pod in lab.kube.list(POD, namespace):
            statuses = [(s["name"], s.get("image"), s.get("state"), s.get("restartCount"))
                        for s in pod.get("status", {}).get("containerStatuses") or []]
            lines.append(f"pod {namespace}/{pod['metadata']['name']}: {pod.get('status', {}).get('phase')} {statuses}")
            for container in pod["spec"]["containers"]:
                lines.append(f"  log:\n{pod_log(lab.node.node, pod, container['name'])[-2500:]}")
    config = await lab.kube.get(CONFIG, "default")
    lines.append(f"config status: {(config or {}).get('status')}")
    return "\n".join(lines)


def _ready(pod: Obj) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions") or [])


async def agent_pods(lab: Lab) -> list[Obj]:
    return [p async for p in lab.kube.list(POD, AGENT_NS, label_selector="app.kubernetes.io/name=gpudra-agent")
            if not p["metadata"].get("deletionTimestamp")]


async def operator_pods(lab: Lab) -> list[Obj]:
    return [p async for p in lab.kube.list(POD, OPERATOR_NS, label_selector="app.kubernetes.io/name=gpudra-operator")
            if not p["metadata"].get("deletionTimestamp")]


async def wait_agents_on(lab: Lab, release: Release, timeout: float = 240) -> Obj:
    """Until the node's only agent runs ``release``'s image and is Ready; returns its pod."""
    image = f"{lab.node.registry.host}/gpudra/gpudra:{release.tag()}"

    async def settled() -> Obj | None:
        lab.node.node.kubelet.assert_running()
        pods = [p async for p in lab.kube.list(POD, AGENT_NS, label_selector="app.kubernetes.io/name=gpudra-agent")]
        if len(pods) == 1 and pods[0]["spec"]["containers"][0]["image"] == image and _ready(pods[0]):
            return pods[0]
        return None

    try:
        pod: Obj = await wait_for(settled, timeout=timeout, what=f"the node's agent to run {image} alone, Ready")
        return pod
    except AssertionError as error:
        raise AssertionError(f"{error}\n{await agents_report(lab)}\n{lab.node.failure()}") from None


async def wait_guarded(lab: Lab, finalizer: str | None) -> None:
    """Until GpuDraConfig default carries ``finalizer`` alone (None: no finalizer)."""
    want = [finalizer] if finalizer else []

    async def guarded() -> bool:
        config = await lab.kube.get(CONFIG, "default")
        return config is not None and (config["metadata"].get("finalizers") or []) == want

    await wait_for(guarded, timeout=60, what=f"GpuDraConfig default with the finalizers {want}")


async def wait_config_ready(lab: Lab, timeout: float = 180) -> Obj:
    async def ready() -> Obj | None:
        config = await lab.kube.get(CONFIG, "default")
        generation = (config or {}).get("metadata", {}).get("generation")
        conditions = ((config or {}).get("status") or {}).get("conditions") or []
        agents = ((config or {}).get("status") or {}).get("agents") or {}
        ok = any(c["type"] == "Ready" and c["status"] == "True" and c.get("observedGeneration") == generation
                 for c in conditions)
        return config if ok and agents.get("ready") == agents.get("desired") == agents.get("updated") == 1 else None

    try:
        config: Obj = await wait_for(ready, timeout=timeout, what="GpuDraConfig default to be Ready with its agent")
        return config
    except AssertionError as error:
        raise AssertionError(f"{error}\n{await agents_report(lab)}") from None


async def lease_holder(lab: Lab) -> str | None:
    lease = await lab.kube.get(LEASE, "gpudra-operator", OPERATOR_NS)
    return ((lease or {}).get("spec") or {}).get("holderIdentity")


async def wait_operator_on(lab: Lab, release: Release, *, not_held_by: str | None = None,
                           timeout: float = 180) -> str:
    """Until every operator pod runs ``release``'s image, Ready, and the Lease has a holder other than
    ``not_held_by`` that renews it; returns the holder."""
    image = f"{lab.node.registry.host}/gpudra/gpudra-operator:{release.tag()}"
    seen: dict[str, object] = {}

    async def led() -> str | None:
        pods = await operator_pods(lab)
        lease = await lab.kube.get(LEASE, "gpudra-operator", OPERATOR_NS)
        spec = (lease or {}).get("spec") or {}
        holder, renewed = spec.get("holderIdentity"), spec.get("renewTime")
        settled = pods and all(p["spec"]["containers"][0]["image"] == image and _ready(p) for p in pods)
        if not settled or not holder or holder == not_held_by:
            return None
        if seen.get(holder) not in (None, renewed):
            return str(holder)  # renewed while watched: a live leader
        seen[holder] = renewed
        return None

    try:
        holder: str = await wait_for(led, timeout=timeout, what=f"the operator to run {image} and lead")
        return holder
    except AssertionError as error:
        raise AssertionError(f"{error}\nholder: {await lease_holder(lab)}\n{await agents_report(lab)}") from None


def user_config() -> Obj:
    """The sample GpuDraConfig as a platform team applies it on a GPU Operator node: every field it
    sets is what the upgrade must keep."""
    config = yaml.safe_load(SAMPLE.read_text())
    config["spec"]["agent"]["driverRoot"] = DRIVER_ROOT
    config["spec"]["agent"]["nodeSelector"] = {"gpudra.io/gpu-node": "true"}
    config["spec"]["agent"]["tolerations"].append({"key": "gpudra.io/lifecycle", "operator": "Exists"})
    return config


def subset_of(wanted: object, got: object, path: str = "spec") -> list[str]:
    """Paths where ``got`` lacks or changed what ``wanted`` sets."""
    if isinstance(wanted, dict):
        if not isinstance(got, dict):
            return [path]
        return [p for k, v in wanted.items() for p in subset_of(v, got.get(k), f"{path}.{k}")]
    if isinstance(wanted, list):
        if not isinstance(got, list) or len(got) != len(wanted):
            return [path]
        return [p for i, (w, g) in enumerate(zip(wanted, got)) for p in subset_of(w, g, f"{path}[{i}]")]
    return [] if wanted == got else [f"{path}: {wanted!r} -> {got!r}"]


# -- the test ----------------------------------------------------------------------------------------

async def test_install_upgrade_under_load_skew_and_rollback(lab: Lab) -> None:
    kube, setup = lab.kube, lab.node
    previous, current = lab.previous, lab.current

    # -- install the previous release from the registry, as users of it did ----------------------
    lab.helm_run("install", RELEASE_NAME, *lab.install_args(previous), "--wait", "--timeout", "5m")
    user = user_config()
    platform = Kube(kube.api, field_manager="platform-team")
    await platform.apply(user)
    await wait_agents_on(lab, previous)
    await wait_config_ready(lab)
    old_leader = await wait_operator_on(lab, previous)
    await wait_guarded(lab, EARLIER_FINALIZER)
    devices = await published(lab)
    assert len(devices) == 8, sorted(devices)

    # -- the load: a pod running on its claim, a pod whose claim is prepared but not used yet -----
    await start_gpu_pod(lab, "steady")
    steady, steady_output = await running_with_gpu(lab, "steady")
    steady_claim = await claim_of(lab, "steady")
    assert_sees_its_gpu(steady_output, steady_claim, devices)
    await start_gpu_pod(lab, "waiting", wait_first=True)
    waiting_claim = await claim_prepared(lab, "waiting")
    before = {uid: prepared(setup, uid) for uid in (steady_claim["metadata"]["uid"], waiting_claim["metadata"]["uid"])}
    steady_container = steady["status"]["containerStatuses"][0]["containerID"]

    # -- upgrade to this tree, watching the slices --------------------------------------------------
    # The new operator's image is on the node, which then cannot reach the registry: the operator
    # rolls, the new agent cannot be pulled, and the previous release's agent keeps the node (maxSurge) for as
    # long as that lasts: the skew of a slow rollout, held.
    watch = SliceWatch(kube, setup.name)
    await watch.start()
    setup.node.crictl("pull", f"{setup.registry.host}/gpudra/gpudra-operator:{current.tag()}", timeout=300)
    node_pulls(setup, allowed=False)
    started = time.monotonic()
    lab.helm_run("upgrade", RELEASE_NAME, *lab.install_args(current), "--wait", "--timeout", "5m")
    new_leader = await wait_operator_on(lab, current, not_held_by=old_leader)
    await start_gpu_pod(lab, "skewed")  # during the upgrade: the new operator, the previous agent
    skewed, skewed_output = await running_with_gpu(lab, "skewed")
    assert_sees_its_gpu(skewed_output, await claim_of(lab, "skewed"), devices)
    (old_agent,) = [p for p in await agent_pods(lab) if _ready(p)]
    assert old_agent["spec"]["containers"][0]["image"].endswith(f":{previous.tag()}"), old_agent["spec"]
    config = await kube.get(CONFIG, "default")
    conditions = {c["type"]: c for c in ((config or {}).get("status") or {}).get("conditions") or []}
    print(f"[lifecycle] skew held {time.monotonic() - started:.1f}s (new operator, previous agent): "
          f"{ {t: (c['status'], c.get('reason')) for t, c in conditions.items()} }")
    assert conditions.get("Degraded", {}).get("status") != "True", conditions
    node_pulls(setup, allowed=True)
    new_agent = await wait_agents_on(lab, current)
    await wait_config_ready(lab)
    took = time.monotonic() - started
    await watch.stop()
    print(f"[lifecycle] upgrade {previous.chart_version} -> {current.chart_version} in {took:.1f}s; the node's "
          f"slices: {watch.events} watch events, longest time without one {watch.longest_gap():.3f}s "
          f"({len(watch.gaps)} gaps); Lease {old_leader} -> {new_leader}")
    assert watch.longest_gap() == 0.0 and not watch.gaps, f"the node's ResourceSlices went away: {watch.gaps}"
    assert new_leader != old_leader
    await wait_guarded(lab, None)  # this tree's operator needs no finalizer, and drops the earlier one

    # The running pod kept its container; no claim was unprepared or prepared again.
    steady_now = await kube.get(POD, "steady", WORK_NS)
    assert steady_now is not None and steady_now["status"]["phase"] == "Running"
    (status,) = steady_now["status"]["containerStatuses"]
    assert (status["containerID"], status["restartCount"]) == (steady_container, 0), status
    for uid, was in before.items():
        assert prepared(setup, uid) == was, f"claim {uid}'s CDI spec was written again during the upgrade"
        assert checkpoint(setup).get(uid) == "PrepareCompleted"
    # The waiting pod's GPU container starts on the claim the previous release prepared.
    touch_in_container(setup.node, await kube.get(POD, "waiting", WORK_NS) or {}, GO, container="wait")
    _, waiting_output = await running_with_gpu(lab, "waiting")
    assert_sees_its_gpu(waiting_output, waiting_claim, devices)
    assert prepared(setup, waiting_claim["metadata"]["uid"]) == before[waiting_claim["metadata"]["uid"]]
    # This tree's agent prepares claims too.
    await start_gpu_pod(lab, "newcomer")
    _, newcomer_output = await running_with_gpu(lab, "newcomer")
    newcomer_claim = await claim_of(lab, "newcomer")
    assert_sees_its_gpu(newcomer_output, newcomer_claim, devices)

    # The user's fields survived the chart's CRD and the new operator.
    config = await kube.get(CONFIG, "default")
    assert config is not None
    assert subset_of(user["spec"], config["spec"]) == [], subset_of(user["spec"], config["spec"])
    managers = {m["manager"] for m in config["metadata"].get("managedFields") or []}
    assert "platform-team" in managers, managers
    crd = await kube.get(CRD, "gpudraconfigs.gpudra.io")
    assert crd is not None and crd["status"]["storedVersions"] == ["v1alpha1"], crd and crd["status"]

    # `helm test`: gpudra status in the operator's image, with read-only rights.
    lab.helm_run("test", RELEASE_NAME, "--timeout", "5m")
    await run_the_seed(lab, devices)

    # -- rollback, with the reverse skew held: the previous operator, this tree's agent -------------
    setup.node.crictl("rmi", f"{setup.registry.host}/gpudra/gpudra:{previous.tag()}", check=False)
    node_pulls(setup, allowed=False)
    started = time.monotonic()
    lab.helm_run("rollback", RELEASE_NAME, "1", "--wait", "--timeout", "5m")
    await wait_operator_on(lab, previous, not_held_by=new_leader)
    await start_gpu_pod(lab, "reverse")
    _, reverse_output = await running_with_gpu(lab, "reverse")
    assert_sees_its_gpu(reverse_output, await claim_of(lab, "reverse"), devices)
    (still_new,) = [p for p in await agent_pods(lab) if _ready(p)]
    assert still_new["metadata"]["uid"] == new_agent["metadata"]["uid"], "this tree's agent should hold the node"
    print(f"[lifecycle] reverse skew held {time.monotonic() - started:.1f}s (previous operator, this tree's agent)")
    node_pulls(setup, allowed=True)
    rolled_back = await wait_agents_on(lab, previous)
    await wait_config_ready(lab)
    await wait_guarded(lab, EARLIER_FINALIZER)  # the previous operator adds it back
    # The previous release's agent read the checkpoint this tree's agent wrote, and unprepares a
    # claim this tree prepared; it prepares new ones.
    assert (rolled_back["status"]["containerStatuses"][0]["restartCount"]) == 0, rolled_back["status"]
    newcomer_uid = newcomer_claim["metadata"]["uid"]
    assert checkpoint(setup).get(newcomer_uid) == "PrepareCompleted"
    await kube.delete(POD, "newcomer", WORK_NS)

    async def unprepared() -> bool:
        spec = setup.workdir / "cdi" / f"k8s.{DRIVER}-claim_{newcomer_uid}.json"
        return not spec.exists() and newcomer_uid not in checkpoint(setup)

    await wait_for(unprepared, timeout=120, what="the previous release's agent to unprepare this tree's claim")
    await start_gpu_pod(lab, "after-rollback")
    _, after_output = await running_with_gpu(lab, "after-rollback")
    assert_sees_its_gpu(after_output, await claim_of(lab, "after-rollback"), devices)
    steady_now = await kube.get(POD, "steady", WORK_NS)
    assert steady_now is not None and steady_now["status"]["containerStatuses"][0]["restartCount"] == 0
    assert prepared(setup, steady_claim["metadata"]["uid"]) == before[steady_claim["metadata"]["uid"]]

    # -- upgrade again (this tree reads what the previous release wrote since), then uninstall -----
    lab.helm_run("upgrade", RELEASE_NAME, *lab.install_args(current), "--wait", "--timeout", "5m")
    await wait_operator_on(lab, current)
    await wait_agents_on(lab, current)
    await wait_config_ready(lab)
    await wait_guarded(lab, None)
    after_uid = (await claim_of(lab, "after-rollback"))["metadata"]["uid"]
    assert checkpoint(setup).get(after_uid) == "PrepareCompleted"
    # The workloads end first (docs/deploy.md#uninstall); this tree's agent unprepares the claim the
    # previous release prepared after the rollback.
    await end_workloads(lab)
    lab.helm_run("uninstall", RELEASE_NAME, "--wait", "--timeout", "5m")
    await wait_for(lambda: _agents_gone(lab), timeout=120, what="the agents to go with the uninstall")
    await assert_nothing_left(lab)
    # The CRD stays (crds.keep); deleting it is the user's explicit last step.
    lab.plane.kubectl("delete", "crd", "gpudraconfigs.gpudra.io", "--wait=true", timeout=120)


async def run_the_seed(lab: Lab, devices: dict[str, Obj]) -> None:
    """manifests/samples/seed-workload.yaml as it is: its Job's pod gets a GPU of >= 64Gi, runs
    nvidia-smi on it, and completes; its claim goes with it."""
    setup = lab.node
    tar, _ = seed_workload_image(setup.workdir / "images" / "seed.tar")
    setup.node.import_image(tar)
    lab.plane.kubectl("apply", "-f", str(SEED), "-n", WORK_NS)

    async def holding() -> tuple[Obj, str] | None:
        setup.node.kubelet.assert_running()
        pods = [p async for p in lab.kube.list(POD, WORK_NS, label_selector="job-name=train")]
        assert all(p["status"].get("phase") != "Failed" for p in pods), [p["status"] for p in pods]
        running = [p for p in pods if p["status"].get("phase") == "Running"]
        output = pod_log(setup.node, running[0], "train") if running else ""
        return (running[0], output) if "GPU 0:" in output else None

    try:
        pod, output = await wait_for(holding, timeout=120, what="the seed Job's pod to run nvidia-smi with its GPU")
    except AssertionError as error:
        raise AssertionError(f"{error}\n{await agents_report(lab)}\n{setup.failure()}") from None
    claim = await lab.kube.get(CLAIM, pod["status"]["resourceClaimStatuses"][0]["resourceClaimName"], WORK_NS)
    assert claim is not None
    assert_sees_its_gpu(output, claim, devices)
    touch_in_container(setup.node, pod, RELEASE)

    async def complete() -> bool:
        job = await lab.kube.get(JOB, "train", WORK_NS)
        return any(c["type"] == "Complete" and c["status"] == "True" for c in (job or {}).get("status", {}).get("conditions") or [])

    await wait_for(complete, timeout=120, what="the seed Job to complete")
    await lab.kube.delete(JOB, "train", WORK_NS, propagation="Background")
    await lab.kube.delete(TEMPLATE, "gpu-64gi", WORK_NS)
    await wait_for(lambda: _claim_gone(lab, claim["metadata"]["name"]), timeout=60, what="the seed's claim to go")


async def _claim_gone(lab: Lab, name: str) -> bool:
    return await lab.kube.get(CLAIM, name, WORK_NS) is None


async def end_workloads(lab: Lab) -> None:
    for name in await workload_pods(lab.kube):
        await lab.kube.delete(POD, name, WORK_NS)
    async for template in lab.kube.list(TEMPLATE, WORK_NS):
        await lab.kube.delete(TEMPLATE, template["metadata"]["name"], WORK_NS)
    await wait_for(lambda: _no_workloads(lab.kube), timeout=120, what="the workload pods to go")

    async def unprepared() -> bool:
        return not checkpoint(lab.node) if (lab.node.workdir / "kubelet" / "plugins" / DRIVER).exists() else True

    await wait_for(unprepared, timeout=120, what="every claim to be unprepared")


async def follow_logs(lab: Lab, pods: list[Obj], into: dict[str, str]) -> None:
    """Keep the newest output of each pod's agent container in ``into``: the kubelet removes a
    deleted pod's logs, and an uninstall's decision is in its last lines."""
    while True:
        for pod in pods:
            text = pod_log(lab.node.node, pod, "agent")
            if text:
                into[pod["metadata"]["name"]] = text
        await asyncio.sleep(0.1)


async def _no_slices(lab: Lab) -> bool:
    return not [s async for s in lab.kube.list(SLICE, field_selector=f"spec.driver={DRIVER}")]


async def _agents_gone(lab: Lab) -> bool:
    return not [p async for p in lab.kube.list(POD, AGENT_NS)] and not [p async for p in lab.kube.list(POD, OPERATOR_NS)]


# -- the same with kubectl apply --server-side -k ------------------------------------------------------

def overlay(lab: Lab, release: Release, directory: Path) -> Path:
    """An overlay of ``release``'s manifests/base: its images from the registry, and both namespaces
    Pod Security privileged (the host-network stand-in for the pod network needs it)."""
    registry = lab.node.registry.host
    directory.mkdir(parents=True, exist_ok=True)
    kustomization = {
        "resources": [os.path.relpath(release.tree / "manifests" / "base", directory)],
        "images": [{"name": f"ghcr.io/gpudra/{name}", "newName": f"{registry}/gpudra/{name}", "newTag": release.tag()}
                   for name in ("gpudra-operator", "gpudra")],
        "patches": [{"patch": yaml.safe_dump({"apiVersion": "v1", "kind": "Namespace", "metadata": {
            "name": namespace, "labels": {f"pod-security.kubernetes.io/{mode}": "privileged"
                                          for mode in ("enforce", "audit", "warn")}}})}
                    for namespace in (OPERATOR_NS, AGENT_NS)]}
    if release is lab.previous:  # see Lab.one_replica
        kustomization["patches"].append({"patch": yaml.safe_dump({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "gpudra-operator", "namespace": OPERATOR_NS}, "spec": {"replicas": 1}})})
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return directory


def kubectl_k(lab: Lab, verb: str, directory: Path) -> None:
    args = ["apply", "--server-side", "-k", str(directory)] if verb == "apply" else ["delete", "-k", str(directory), "--wait=true"]
    started = time.monotonic()
    proc = lab.plane.kubectl(*args, check=False, timeout=300)
    print(f"[kustomize] kubectl {' '.join(args)} ({time.monotonic() - started:.1f}s, exit {proc.returncode})\n"
          f"{proc.stdout[-1500:]}{proc.stderr[-1500:]}")
    assert proc.returncode == 0, f"kubectl {' '.join(args)}: {proc.stderr[-3000:]}"


async def test_apply_k_upgrade_and_rollback_under_load_then_delete_k(lab: Lab, tmp_path: Path) -> None:
    kube, setup = lab.kube, lab.node
    previous, current = lab.previous, lab.current
    old, new = overlay(lab, previous, tmp_path / "previous"), overlay(lab, current, tmp_path / "current")
    kubectl_k(lab, "apply", old)
    await Kube(kube.api, field_manager="platform-team").apply(user_config())
    await wait_agents_on(lab, previous)
    await wait_config_ready(lab)
    devices = await published(lab)
    await start_gpu_pod(lab, "steady")
    steady, output = await running_with_gpu(lab, "steady")
    claim = await claim_of(lab, "steady")
    assert_sees_its_gpu(output, claim, devices)
    uid = claim["metadata"]["uid"]
    was = prepared(setup, uid)
    container = steady["status"]["containerStatuses"][0]["containerID"]

    watch = SliceWatch(kube, setup.name)
    await watch.start()
    # the upgrade, the rollback, the upgrade again (this tree's agent reads what the previous one wrote)
    for overlay_dir, release in ((new, current), (old, previous), (new, current)):
        started = time.monotonic()
        kubectl_k(lab, "apply", overlay_dir)
        await wait_operator_on(lab, release)
        await wait_agents_on(lab, release)
        await wait_config_ready(lab)
        print(f"[kustomize] now on {release.name} after {time.monotonic() - started:.1f}s")
        now = await kube.get(POD, "steady", WORK_NS)
        assert now is not None and now["status"]["phase"] == "Running"
        (status,) = now["status"]["containerStatuses"]
        assert (status["containerID"], status["restartCount"]) == (container, 0), status
        assert prepared(setup, uid) == was and checkpoint(setup).get(uid) == "PrepareCompleted"
        name = f"on-{release.tag()}-{len(await workload_pods(kube))}"
        await start_gpu_pod(lab, name)
        _, output = await running_with_gpu(lab, name)
        assert_sees_its_gpu(output, await claim_of(lab, name), devices)
    await watch.stop()
    print(f"[kustomize] the node's slices through upgrade, rollback and upgrade: longest time without one "
          f"{watch.longest_gap():.3f}s ({len(watch.gaps)} gaps, {watch.events} events)")
    assert watch.longest_gap() == 0.0 and not watch.gaps, watch.gaps

    await end_workloads(lab)
    # A bare `kubectl delete -k`, as a GitOps prune does it: the operator, the CRD and with it the
    # config all go at once, in no order gpudra chooses (docs/deploy.md#kubectl-and-gitops). No
    # finalizer holds the config, so the delete finishes; each agent cleans its node as it stops.
    last_words: dict[str, str] = {}
    following = asyncio.create_task(follow_logs(lab, await agent_pods(lab), last_words))
    started = time.monotonic()
    await asyncio.to_thread(kubectl_k, lab, "delete", new)  # the loop follows the logs meanwhile
    try:
        await wait_for(lambda: _agents_gone(lab), timeout=120, what="the agents to go with delete -k")
        # An agent whose RBAC went first cannot delete its node's slices: the kubelet does, 30 s after
        # the driver deregistered (defaultWipingDelay).
        await wait_for(lambda: _no_slices(lab), timeout=90, what="the node's ResourceSlices to go")
        print(f"[kustomize] bare kubectl delete -k: everything gone after {time.monotonic() - started:.1f}s")
        await assert_nothing_left(lab)
    except AssertionError as error:
        raise AssertionError(f"{error}\nthe agents' last words:\n" + "\n".join(
            f"{name}:\n{text[-3000:]}" for name, text in last_words.items())) from None
    finally:
        following.cancel()
    print("[kustomize] the agent's last words: " + " | ".join(
        line for text in last_words.values() for line in text.splitlines()[-4:]))


# -- uninstall ---------------------------------------------------------------------------------------

async def assert_nothing_left(lab: Lab) -> None:
    """What an uninstall must leave of gpudra: nothing but the CRD (and its stored configs only if
    the user keeps them), on the cluster and on the node."""
    kube, setup = lab.kube, lab.node
    slices = [s["metadata"]["name"] async for s in kube.list(SLICE, field_selector=f"spec.driver={DRIVER}")]
    classes = [c["metadata"]["name"] async for c in kube.list(DEVICE_CLASS)]
    configs = [c["metadata"] async for c in kube.list(CONFIG)] if await kube.get(CRD, "gpudraconfigs.gpudra.io") else []
    policies = [p["metadata"]["name"] for p in (await kube.request("GET", POLICIES))["items"]
                if p["metadata"]["name"].startswith("gpudra-")]
    bindings = [b["metadata"]["name"] for b in (await kube.request("GET", BINDINGS))["items"]
                if b["metadata"]["name"].startswith("gpudra-")]
    specs = sorted(p.name for p in (setup.workdir / "cdi").glob(f"k8s.{DRIVER}-*"))
    plugin_dir = setup.workdir / "kubelet" / "plugins" / DRIVER
    registrations = sorted(p.name for p in (setup.workdir / "kubelet" / "plugins_registry").glob(f"{DRIVER}*"))
    pods = {n: [p["metadata"]["name"] async for p in kube.list(POD, n)] for n in (OPERATOR_NS, AGENT_NS)}
    left = {"ResourceSlices": slices, "DeviceClasses": classes,
            "GpuDraConfigs": [(m["name"], m.get("finalizers")) for m in configs],
            "ValidatingAdmissionPolicies": policies, "bindings": bindings, "CDI specs": specs,
            "plugin directory": sorted(p.name for p in plugin_dir.iterdir()) if plugin_dir.exists() else [],
            "registration sockets": registrations, "pods": [p for names in pods.values() for p in names]}
    assert not any(left.values()), f"the uninstall left: { {k: v for k, v in left.items() if v} }"
