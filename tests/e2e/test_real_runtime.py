"""The seed pod on a node with a real container runtime: the release's kubelet on containerd's CRI
socket (containerd built from its Go module, Debian's runc, CDI on), the agent as the node's DRA
kubelet plugin (a host process, the mock NVML on a fake driver root with real device nodes).

The real scheduler allocates the seed's claim (a GPU with >= 64Gi), the kubelet has the agent
prepare it, containerd resolves the claim's CDI device ID against the agent's spec and runc
starts the container: a static busybox image (tests/ociimage.py) with no NVIDIA file of its own,
running ``ls -l /dev/nvidia*; nvidia-smi; env``. Everything NVIDIA it shows came from CDI: the
claim's device node and control nodes, ``NVIDIA_VISIBLE_DEVICES`` with the GPU's UUID, and the
driver root's mock ``nvidia-smi`` (static, tests/mocknvml/nvidia_smi.c), which lists the GPUs whose
device nodes it finds. A second pod with another claim sees only its own GPU; two pods that share one
claim both see its GPU. Deleting the pods unprepares the claims (their CDI specs gone), and tearing the node down leaves nothing: no
containers, shims, mounts, processes or cgroup directories (tests/realruntime.py).

Then the agent as the operator deploys it: the DaemonSet ``render`` makes for a GpuDraConfig pointing
it at this node's directories, from the agent image (built by hack/images.sh with podman, moved
into containerd with ``podman save --format oci-archive`` + ``ctr images import``), as a pod of this
kubelet: Ready, registered, and the one that prepares and unprepares the seed pod's claim. Two
changes to the rendered DaemonSet: the host network (this node runs no CNI plugin) with the API
server at 127.0.0.1, and free host ports for metrics and health.

Last, MPS (spec.sharing.mps) as rendered: the agent and the MPS supervisor as pods; a pod's MPS claim
gets its control daemon in the supervisor's pod, the pipe directory and /dev/shm through CDI, and
keeps both through a rolling update of the agent's DaemonSet."""

from __future__ import annotations

import importlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
import yaml
from nodestate import checkpoint_states, checkpoint_touched
from realkubelet import kubelet_binary
from realruntime import CGROUP_ROOT, TEST_IMAGE, RealRuntimeNode, read_cri_log, runtime_problem
from scrape import sample_value, scrape

from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_dev.localcluster.agents import AgentProcess, start_agent
from gpudra_dev.localcluster.controlplane import ControlPlane, free_port
from gpudra_dev.localcluster.fakedriverroot import make_driver_root, make_pci_sysfs
from gpudra_dev.localcluster.objects import delete_node
from gpudra_dev.localcluster.waiting import wait_for
from gpudra_operator.render import render

try:  # tests/seedobjects.py, or tests/integration/ (on sys.path only when integration tests are collected)
    seedobjects = importlib.import_module("seedobjects")
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
    seedobjects = importlib.import_module("seedobjects")

CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")
DEVICE_CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")
POD = resource_type("v1", "Pod")
EVENT = resource_type("v1", "Event")
TAINT = "gpudra.io/real-runtime"
DONE = "gpudra-e2e-done"
# Everything after DONE keeps the pod running (its claim prepared) until the test deletes it.
SCRIPT = f"ls -l /dev/nvidia*; nvidia-smi; echo nvidia-smi-exit=$?; env; echo {DONE}; exec sleep 3600"

GiB = 1024**3
UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}

pytestmark = pytest.mark.timeout(600)


def to_bytes(quantity: str) -> int:
    suffix = quantity[-2:]
    return int(quantity[:-2]) * UNITS[suffix] if suffix in UNITS else int(quantity)


@dataclass
class Node:
    runtime: RealRuntimeNode
    driver: str
    cdi_dir: Path
    driver_root: Path
    agent: AgentProcess | None = None  # the agent as a host process (None: it runs in a pod)

    @property
    def name(self) -> str:
        return self.runtime.node_name

    @property
    def kubelet_dir(self) -> Path:
        return self.runtime.kubelet.root_dir

    def spec_path(self, claim_uid: str) -> Path:
        return self.cdi_dir / f"k8s.{self.driver}-claim_{claim_uid}.json"

    def checkpoint(self) -> dict[str, str]:
        return checkpoint_states(self.kubelet_dir, self.driver)

    def failure(self) -> str:
        agent = f"\nagent log:\n{self.agent.log_tail(20)}" if self.agent is not None else ""
        return f"{self.runtime.describe()}\nkubelet log:\n{self.runtime.kubelet.log_tail(40)}{agent}"


@asynccontextmanager
async def runtime_node_of(cluster: ControlPlane, kube: Kube, profile: str = "dgx-h100") -> AsyncIterator[Node]:
    """containerd + the real kubelet, Ready, with a fake driver root of ``profile`` and a
    DeviceClass for this test's own driver name; no agent yet."""
    if problem := runtime_problem():
        pytest.fail(problem, pytrace=False)
    name, driver = f"runtime-{secrets.token_hex(3)}", f"r{secrets.token_hex(4)}.gpudra.io"
    workdir = Path(tempfile.mkdtemp(prefix="gpudra-rt-", dir="/tmp"))  # short: unix sockets live here
    cdi_dir = workdir / "cdi"
    runtime: RealRuntimeNode | None = None
    node: Node | None = None
    class_created = False
    try:
        runtime = RealRuntimeNode(workdir, kubelet_binary=kubelet_binary(cluster.bin_dir),
                                  kubeconfig=cluster.kubeconfig, node_name=name, cdi_dir=cdi_dir,
                                  taint=f"{TAINT}=:NoSchedule")
        driver_root = make_driver_root(workdir / "driver-root", profile)
        smi = driver_root / "usr/bin/nvidia-smi"
        assert smi.read_bytes()[:4] == b"\x7fELF", \
            f"{smi} is the shell-script stand-in, not the static mock: make mock-nvidia-smi"
        started = time.monotonic()
        runtime.start()
        await kube.create({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": driver},
                           "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]}})
        class_created = True
        try:
            await runtime.kubelet.wait_ready(kube)
        except AssertionError as error:
            raise AssertionError(f"{error}\n{runtime.describe()}\nkubelet log:\n{runtime.kubelet.log_tail(40)}") from None
        print(f"\n[real-runtime] containerd + kubelet ready in {time.monotonic() - started:.1f}s")
        node = Node(runtime, driver, cdi_dir, driver_root)
        yield node
    finally:
        if node is not None and node.agent is not None:
            node.agent.stop()
        problems = runtime.stop() if runtime is not None else []
        if class_created:
            await kube.delete(DEVICE_CLASS, driver)
        await delete_node(kube, name)
        if problems:
            print(f"[real-runtime] teardown problems: {problems}")
        leftovers = runtime.leftovers() if runtime is not None else []
        if leftovers:
            print(f"[real-runtime] left {workdir} for inspection: {leftovers}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


@pytest_asyncio.fixture(loop_scope="session")
async def runtime_node(cluster: ControlPlane, kube: Kube) -> AsyncIterator[Node]:
    async with runtime_node_of(cluster, kube) as node:
        yield node


async def start_host_agent(cluster: ControlPlane, node: Node, profile: str, *extra_args: str) -> None:
    """The node's agent as a host process on the mock NVML of ``profile``, registered with the
    kubelet (stopped by the runtime node's teardown)."""
    node.agent = agent = start_agent(
        kubeconfig=cluster.kubeconfig, node_name=node.name, nvml=f"mock:{profile}", driver=node.driver,
        workdir=node.runtime.workdir / "agent", kubelet_dir=node.kubelet_dir, cdi_dir=node.cdi_dir,
        driver_root=node.driver_root, extra_args=("--pod-uid", str(uuid.uuid4()), *extra_args))

    async def registered() -> bool:
        assert agent.process.poll() is None, f"agent exited:\n{agent.log_tail()}"
        node.runtime.kubelet.assert_running()
        return "registered with the kubelet as" in agent.log_path.read_text(errors="replace")

    await wait_for(registered, timeout=60, what=f"the kubelet to register the agent ({agent.log_path})")


@pytest_asyncio.fixture(loop_scope="session")
async def node(cluster: ControlPlane, kube: Kube, runtime_node: Node) -> Node:
    """The runtime node with its agent as a host process (stopped by runtime_node's teardown)."""
    await start_host_agent(cluster, runtime_node, "dgx-h100")
    await seedobjects.published_devices(kube, runtime_node.driver, runtime_node.name, 8)
    return runtime_node


def gpu_pod(node: Node, namespace: str, pod_name: str) -> tuple[Obj, Obj]:
    """The seed's claim template and pod (from manifests/samples), pinned to the node, on the host
    network, tolerating the node's taints, running SCRIPT in the local busybox image."""
    template, pod = seedobjects.seed_objects(node.driver, namespace)
    template["metadata"]["name"] = f"{pod_name}-gpu"
    pod["metadata"]["name"] = pod_name
    spec = pod["spec"]
    spec["resourceClaims"][0]["resourceClaimTemplateName"] = template["metadata"]["name"]
    (container,) = spec["containers"]
    container.update(image=TEST_IMAGE, imagePullPolicy="Never", command=["sh", "-c", SCRIPT])
    spec.update(nodeSelector={"kubernetes.io/hostname": node.name}, hostNetwork=True,
                automountServiceAccountToken=False, enableServiceLinks=False, terminationGracePeriodSeconds=1,
                restartPolicy="Never",
                # The kubelet registers its Node with the not-ready taint; the node lifecycle
                # controller that would lift it is off in the tests' cluster.
                tolerations=[{"key": key, "operator": "Exists", "effect": "NoSchedule"}
                             for key in (TAINT, "node.kubernetes.io/not-ready")])
    return template, pod


def container_log(node: Node, pod: Obj, container: str) -> str:
    """The container's output, from the log file the runtime writes in the kubelet's pod log
    directory (CRI format: ``<time> <stream> <P|F> <text>``; P lines are partial)."""
    meta = pod["metadata"]
    return read_cri_log(node.runtime.kubelet.pod_logs_dir / f"{meta['namespace']}_{meta['name']}_{meta['uid']}"
                        / container / "0.log")


async def printed_output(kube: Kube, node: Node, name: str, namespace: str, what: str) -> tuple[Obj, str]:
    """Once pod ``name`` runs and its container ``train`` has printed DONE: (the pod, the output).
    A timeout says the pod's status, the namespace's events and what the node logged."""
    async def printed() -> tuple[Obj, str] | None:
        node.runtime.kubelet.assert_running()
        got = await kube.get(POD, name, namespace)
        if not got or got["status"].get("phase") != "Running":
            assert not got or got["status"].get("phase") not in ("Failed", "Succeeded"), got["status"]
            return None
        output = container_log(node, got, "train")
        return (got, output) if DONE in output else None

    try:
        found: tuple[Obj, str] = await wait_for(printed, timeout=120, what=f"pod {name} to {what}")
        return found
    except AssertionError as error:
        events = [(e.get("reason"), e.get("message")) async for e in kube.list(EVENT, namespace)]
        raise AssertionError(f"{error}\npod: {(await kube.get(POD, name, namespace) or {}).get('status')}\n"
                             f"events: {events}\n{node.failure()}") from None


async def run_gpu_pod(kube: Kube, node: Node, namespace: str, pod_name: str,
                      shared_claim: str | None = None) -> tuple[Obj, Obj, str]:
    """Create the pod (its own claim from the seed's template, or the ResourceClaim
    ``shared_claim``); wait until it runs and its container has printed SCRIPT's output. Returns
    (pod, its claim, the output)."""
    template, pod = gpu_pod(node, namespace, pod_name)
    if shared_claim is None:
        await kube.create(template)
    else:
        pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": shared_claim}]
    await kube.create(pod)
    started = time.monotonic()
    got, output = await printed_output(kube, node, pod_name, namespace, "run and print on the real runtime")
    print(f"[real-runtime] {pod_name}: created -> output in {time.monotonic() - started:.1f}s")
    if shared_claim is None:  # a template's claim: its generated name is in the pod's status
        (status,) = got["status"]["resourceClaimStatuses"]
        shared_claim = status["resourceClaimName"]
    claim = await kube.get(CLAIM, shared_claim, namespace)
    assert claim is not None
    uid = claim["metadata"]["uid"]
    assert node.spec_path(uid).is_file() and node.checkpoint().get(uid) == "PrepareCompleted", node.checkpoint()
    return got, claim, output


def allowed_nvidia_minors(node: Node, pod_name: str) -> set[int] | None:
    """The minors of major 195 (/dev/nvidia*) the device cgroup (v1) of the pod's container
    allows; None without a cgroup v1 devices hierarchy."""
    (cid,) = node.runtime.crictl("ps", "-q", "--no-trunc", "--label", f"io.kubernetes.pod.name={pod_name}").stdout.split()
    pid = json.loads(node.runtime.crictl("inspect", cid).stdout)["info"]["pid"]
    paths = [line.split(":", 2)[2] for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
             if "devices" in line.split(":")[1].split(",")]
    if not paths:
        return None
    rules = (CGROUP_ROOT / "devices" / paths[0].lstrip("/") / "devices.list").read_text().splitlines()
    assert "a *:* rwm" not in rules, f"container {cid} may open any device"
    return {int(rule.split()[1].split(":")[1]) for rule in rules if rule.startswith("c 195:")}


def assert_sees_only(output: str, gpu: Obj, driver_version: str) -> None:
    """The container's output shows ``gpu`` (its device node, its UUID, nvidia-smi's view) and no other GPU."""
    uuid_, minor = gpu["attributes"]["uuid"]["string"], gpu["attributes"]["minor"]["int"]
    lines = output.splitlines()
    listed = {m.group(2): m.group(1) for line in lines
              if (m := re.match(r"^c\S+\s+\d+\s+\S+\s+\S+\s+(\d+,\s*\d+)\s.*\s(/dev/nvidia\S*)$", line))}
    gpu_nodes = {path for path in listed if re.fullmatch(r"/dev/nvidia[0-9]+", path)}
    assert gpu_nodes == {f"/dev/nvidia{minor}"}, f"GPU device nodes in the container: {gpu_nodes}\n{output}"
    assert re.fullmatch(rf"195,\s*{minor}", listed[f"/dev/nvidia{minor}"]), listed
    for control in ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset"):
        assert control in listed, f"{control} not injected:\n{output}"
    env = dict(line.split("=", 1) for line in lines if re.match(r"^[A-Z_][A-Z0-9_]*=", line))
    assert env.get("NVIDIA_VISIBLE_DEVICES") == uuid_, f"NVIDIA_VISIBLE_DEVICES: {env.get('NVIDIA_VISIBLE_DEVICES')}"
    assert env.get("NVIDIA_CTK_LIBCUDA_DIR") == "/usr/lib/x86_64-linux-gnu"
    assert f"gpudra mock nvidia-smi: driver {driver_version}, GPUs: {uuid_}" in lines, output
    assert "nvidia-smi-exit=0" in lines, output
    assert re.search(rf"^GPU 0: .* \(UUID: {re.escape(uuid_)}\) /dev/nvidia{minor}$", output, re.M), output


async def test_the_seed_pod_runs_on_containerd_with_only_its_claims_gpu_injected_by_cdi(
        kube: Kube, namespace: str, node: Node) -> None:
    devices = await seedobjects.published_devices(kube, node.driver, node.name, 8)
    first, first_claim, first_output = await run_gpu_pod(kube, node, namespace, "train")
    second, second_claim, second_output = await run_gpu_pod(kube, node, namespace, "train-2")

    print(f"[real-runtime] the output of pod train's container:\n{first_output}")
    node.runtime.remember()  # the IDs of both pods' sandboxes and containers, for the cgroup check
    gpus = []
    for claim, output in ((first_claim, first_output), (second_claim, second_output)):
        (allocated,) = claim["status"]["allocation"]["devices"]["results"]
        assert (allocated["driver"], allocated["pool"]) == (node.driver, node.name)
        gpu = devices[allocated["device"]]
        assert to_bytes(gpu["capacity"]["memory"]["value"]) >= 64 * GiB  # the seed template's selector
        assert_sees_only(output, gpu, gpu["attributes"]["driverVersion"]["version"])
        gpus.append(gpu["attributes"]["uuid"]["string"])
    assert gpus[0] != gpus[1], "both pods got the same GPU"

    # A claim shared by two pods: prepared once, both containers get its GPU through CDI.
    template, _ = gpu_pod(node, namespace, "shared")
    await kube.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                       "metadata": {"name": "shared-gpu", "namespace": namespace}, "spec": template["spec"]["spec"]})
    sharers = [await run_gpu_pod(kube, node, namespace, name, shared_claim="shared-gpu")
               for name in ("share-1", "share-2")]
    shared_claim = sharers[1][1]
    assert len(shared_claim["status"]["reservedFor"]) == 2
    (allocated,) = shared_claim["status"]["allocation"]["devices"]["results"]
    shared_gpu = devices[allocated["device"]]
    for _, _, output in sharers:
        assert_sees_only(output, shared_gpu, shared_gpu["attributes"]["driverVersion"]["version"])
    assert shared_gpu["attributes"]["uuid"]["string"] not in gpus
    node.runtime.remember()

    # The containers run in containerd, with the CDI device ID of their own claim.
    containers = node.runtime.crictl("ps", "-q", "--no-trunc").stdout.split()
    assert len(containers) == 4, node.runtime.describe()
    # runc's device cgroup lets each container open its own GPU's node (and the control nodes), no other GPU's.
    for pod, claim in ((first, first_claim), (second, second_claim)):
        (allocated,) = claim["status"]["allocation"]["devices"]["results"]
        allowed = allowed_nvidia_minors(node, pod["metadata"]["name"])
        if allowed is not None:
            assert allowed == {devices[allocated["device"]]["attributes"]["minor"]["int"], 254, 255}, allowed

    # Deleting the pods unprepares the claims: their specs and checkpoint entries go.
    uids = [c["metadata"]["uid"] for c in (first_claim, second_claim, shared_claim)]
    for pod in (first, second, *(pod for pod, _, _ in sharers)):
        await kube.delete(POD, pod["metadata"]["name"], namespace)

    async def unprepared() -> bool:
        node.runtime.kubelet.assert_running()
        checkpoint = node.checkpoint()
        return not any(node.spec_path(uid).exists() or uid in checkpoint for uid in uids)

    try:
        await wait_for(unprepared, timeout=90, what=f"the kubelet to unprepare claims {uids}")
    except AssertionError as error:
        raise AssertionError(f"{error}\n{node.failure()}") from None

    async def gone() -> bool:
        pods = (first, second, *(pod for pod, _, _ in sharers))
        return all([await kube.get(POD, p["metadata"]["name"], namespace) is None for p in pods])

    await wait_for(gone, timeout=60, what="the pods to be deleted by the kubelet")
    assert not list(node.cdi_dir.glob(f"k8s.{node.driver}-claim_*.json"))
    assert not node.runtime.crictl("ps", "-q").stdout.split(), "containers still running after their pods were deleted"

    # Tear the node down now (the fixture's teardown does it again, harmlessly) and look for leftovers.
    assert node.agent is not None and node.agent.stop() == 0, node.agent and node.agent.log_tail()
    node.runtime.remember()
    problems = node.runtime.stop()
    assert not problems, problems
    assert node.runtime.ids, "no sandbox or container IDs were recorded"
    assert node.runtime.leftovers() == []


# -- the agent as the operator deploys it: the rendered DaemonSet's pod on the real runtime ----------

AGENT_RBAC = Path(__file__).resolve().parents[2] / "manifests" / "base" / "agent-rbac.yaml"
PODMAN_CONF = Path(__file__).resolve().parents[2] / "hack" / "podman" / "containers.conf"
DAEMONSET = resource_type("apps/v1", "DaemonSet")
IMAGES_SH = Path(__file__).resolve().parents[2] / "hack" / "images.sh"
IMAGE_FIX = "hack/images.sh agent (or: make images), which builds it with podman"
AGENT_IMAGE_ENV = "GPUDRA_TEST_AGENT_IMAGE"  # make test builds the images first and names them


def agent_image() -> str:
    """$GPUDRA_TEST_AGENT_IMAGE, else what hack/images.sh builds (or finds up to date: it caches by
    the hash of the image's inputs) for the working tree."""
    if image := os.environ.get(AGENT_IMAGE_ENV):
        return image
    proc = subprocess.run([str(IMAGES_SH), "agent"], capture_output=True, text=True, timeout=1100)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise AssertionError(f"hack/images.sh agent exited {proc.returncode} (missing podman, runc or debootstrap: "
                             f"hack/debian-packages.sh):\n{proc.stderr[-5000:]}")
    return proc.stdout.strip().splitlines()[-1].split()[-1]


def export_agent_image(image: str, out: Path) -> Path:
    """The agent image from podman's store as an OCI archive (``ctr images import`` reads it)."""
    podman = shutil.which("podman")
    if podman is None:
        raise AssertionError(f"no podman to export the agent image {image} from: hack/debian-packages.sh, then {IMAGE_FIX}")
    env = {**os.environ, **({"CONTAINERS_CONF": str(PODMAN_CONF)} if PODMAN_CONF.is_file() else {})}
    if subprocess.run([podman, "image", "exists", image], env=env).returncode != 0:
        raise AssertionError(f"no agent image {image} in podman's store: {IMAGE_FIX}")
    out.parent.mkdir(parents=True, exist_ok=True)
    saved = subprocess.run([podman, "save", "--format", "oci-archive", "-o", str(out), image], env=env,
                           capture_output=True, text=True, timeout=300)
    assert saved.returncode == 0, f"podman save {image}: {saved.stderr}"
    return out


def agent_rbac(namespace: str, suffix: str) -> list[Obj]:
    """manifests/base/agent-rbac.yaml for a ServiceAccount in ``namespace``, its cluster-wide and
    ``default`` objects renamed with ``suffix`` (the session cluster is shared)."""
    objects = [doc for doc in yaml.safe_load_all(AGENT_RBAC.read_text()) if doc]
    for obj in objects:
        meta = obj["metadata"]
        if obj["kind"] == "ServiceAccount":
            meta["namespace"] = namespace
        else:
            meta["name"] = f"{meta['name']}-{suffix}"
            if "roleRef" in obj:
                obj["roleRef"]["name"] = f"{obj['roleRef']['name']}-{suffix}"
            for subject in obj.get("subjects") or []:
                subject["namespace"] = namespace
    return objects


def rt_config(node: Node, namespace: str, apiserver_port: int, *, mps: bool = False) -> Obj:
    """A GpuDraConfig that points the agent at this node's kubelet, CDI and driver-root directories."""
    config: Obj = {"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig", "metadata": {"name": f"rt-{node.name}"},
                   "spec": {"driverName": node.driver, "agent": {
                       "namespace": namespace, "imagePullPolicy": "Never",
                       "nodeSelector": {"kubernetes.io/hostname": node.name},
                       "tolerations": [{"key": key, "operator": "Exists", "effect": "NoSchedule"}
                                       for key in (TAINT, "node.kubernetes.io/not-ready")],
                       "kubeletDir": str(node.kubelet_dir), "cdiDir": str(node.cdi_dir),
                       "driverRoot": str(node.driver_root), "extraArgs": ["--sysfs", "/host-sys"],
                       "extraEnv": [{"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
                                    {"name": "KUBERNETES_SERVICE_PORT", "value": str(apiserver_port)}]}}}
    if mps:
        config["spec"]["sharing"] = {"mps": {}}
    return config


def agent_daemonset(node: Node, namespace: str, image: str, apiserver_port: int, metrics_port: int,
                    health_port: int, sysfs: Path, *, mps: bool = False) -> Obj:
    """The DaemonSet the operator renders for :func:`rt_config`, with the changes this node needs:
    the host network (it runs no CNI plugin), with the API server at 127.0.0.1 (its certificate's
    SAN); ports of its own for metrics and health (the host's); and ``sysfs``, a sysfs with the fake
    GPUs on its PCI bus (the host's /sys has none), mounted at /host-sys and passed as ``--sysfs``."""
    config = rt_config(node, namespace, apiserver_port, mps=mps)
    daemonset = render(config, agent_image=image).daemonset
    assert daemonset is not None
    spec = daemonset["spec"]["template"]["spec"]
    spec["hostNetwork"] = True
    spec["terminationGracePeriodSeconds"] = 10
    (container,) = spec["containers"]
    args = container["args"]
    for flag, port in (("--metrics-port", metrics_port), ("--health-port", health_port)):
        args[args.index(flag) + 1] = str(port)
    container["ports"] = [{"name": "metrics", "containerPort": metrics_port, "protocol": "TCP"},
                          {"name": "health", "containerPort": health_port, "protocol": "TCP"}]
    for probe in ("startupProbe", "livenessProbe"):
        container[probe]["grpc"]["port"] = health_port
    spec["volumes"].append({"name": "host-sys", "hostPath": {"path": str(sysfs), "type": "Directory"}})
    container["volumeMounts"].append({"name": "host-sys", "mountPath": "/host-sys", "readOnly": True})
    return daemonset


@pytest.mark.timeout(1500)  # run alone, hack/images.sh may have to build the agent image first
async def test_the_agent_as_the_operator_renders_it_runs_as_a_pod_and_prepares_the_seed_pods_claim(
        cluster: ControlPlane, kube: Kube, namespace: str, runtime_node: Node) -> None:
    node = runtime_node
    started = time.monotonic()
    image = agent_image()
    tar = export_agent_image(image, node.runtime.workdir / "images" / "agent.tar")
    node.runtime.import_image(tar)
    tar.unlink()
    print(f"\n[real-runtime] agent image {image} found, exported and imported in {time.monotonic() - started:.1f}s")

    rbac = agent_rbac(namespace, secrets.token_hex(3))
    try:
        for obj in rbac:
            await kube.create(obj)
        metrics_port = free_port()
        sysfs = make_pci_sysfs(node.runtime.workdir / "sys", "dgx-h100")
        daemonset = agent_daemonset(node, namespace, image, cluster.apiserver_port, metrics_port, free_port(), sysfs)
        await kube.create(daemonset)
        started = time.monotonic()
        selector = ",".join(f"{k}={v}" for k, v in daemonset["spec"]["selector"]["matchLabels"].items())

        async def agent_pod_ready() -> Obj | None:
            node.runtime.kubelet.assert_running()
            pods = [p async for p in kube.list(POD, namespace, label_selector=selector)]
            ready = [p for p in pods if any(c["type"] == "Ready" and c["status"] == "True"
                                           for c in p.get("status", {}).get("conditions") or [])]
            return ready[0] if ready else None

        try:
            agent_pod = await wait_for(agent_pod_ready, timeout=120, what="the agent DaemonSet's pod to be Ready")
        except AssertionError as error:
            pods = [p.get("status") async for p in kube.list(POD, namespace, label_selector=selector)]
            raise AssertionError(f"{error}\nagent pods: {pods}\n{node.failure()}") from None
        print(f"[real-runtime] agent pod Ready in {time.monotonic() - started:.1f}s")
        assert agent_pod["spec"]["nodeName"] == node.name
        devices = await seedobjects.published_devices(kube, node.driver, node.name, 8)

        async def registered() -> bool:
            return "registered with the kubelet as" in container_log(node, agent_pod, "agent")

        await wait_for(registered, timeout=60, what="the kubelet to register the agent pod's plugin")

        pod, claim, output = await run_gpu_pod(kube, node, namespace, "train")
        (allocated,) = claim["status"]["allocation"]["devices"]["results"]
        gpu = devices[allocated["device"]]
        assert_sees_only(output, gpu, gpu["attributes"]["driverVersion"]["version"])
        uid = claim["metadata"]["uid"]
        node.runtime.remember()

        await kube.delete(POD, "train", namespace)

        async def unprepared() -> bool:
            node.runtime.kubelet.assert_running()
            return not node.spec_path(uid).exists() and uid not in node.checkpoint()

        try:
            await wait_for(unprepared, timeout=90, what=f"the agent pod to unprepare claim {uid}")
        except AssertionError as error:
            raise AssertionError(f"{error}\nagent log:\n{container_log(node, agent_pod, 'agent')[-3000:]}\n"
                                 f"{node.failure()}") from None
        # The pod's agent (its metrics port is the host's) did both.
        metrics = scrape(metrics_port)
        assert sample_value(metrics, "gpudra_agent_node_prepare_total") == 1, metrics
        assert sample_value(metrics, "gpudra_agent_node_unprepare_total") == 1, metrics

        await kube.delete(DAEMONSET, daemonset["metadata"]["name"], namespace)

        async def agent_gone() -> bool:
            return not [p async for p in kube.list(POD, namespace, label_selector=selector)]

        await wait_for(agent_gone, timeout=60, what="the agent pod to be deleted with its DaemonSet")
    finally:
        for obj in rbac:
            if obj["kind"] != "ServiceAccount":  # the namespace takes it
                await kube.delete(resource_type(obj["apiVersion"], obj["kind"]), obj["metadata"]["name"],
                                  obj["metadata"].get("namespace"))

    problems = node.runtime.stop()
    assert not problems, problems
    assert node.runtime.leftovers() == []


# -- MPS through an agent rolling update: the supervisor's daemon outlives the agent pod ----------

MPS_SCRIPT = (f"env; ls /tmp/nvidia-mps; echo from-the-pod > /dev/shm/written-by-pod; echo {DONE}; "
              "exec sleep 3600")


def host_mps_daemons(pipe_dir: Path) -> list[int]:
    """Host PIDs of the mock MPS control daemons serving ``pipe_dir`` (the supervisor's pod has a
    PID namespace of its own, so the mock's registry holds PIDs the host does not know)."""
    wanted = f"CUDA_MPS_PIPE_DIRECTORY={pipe_dir}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if cmdline[:1] and cmdline[0].endswith(b"nvidia-cuda-mps-control") and b"-f" in cmdline \
                and wanted in environ and state != b"Z":
            pids.append(int(entry.name))
    return pids


@pytest.mark.timeout(1500)  # hack/images.sh may have to build the agent image first
async def test_an_mps_claims_daemon_outlives_a_rolling_update_of_the_agent_pods(
        cluster: ControlPlane, kube: Kube, namespace: str, runtime_node: Node) -> None:
    """spec.sharing.mps as the operator renders it, on containerd: the agent and the MPS supervisor
    as pods. A pod's MPS claim gets its daemon in the supervisor's pod and, through CDI, its pipe
    directory and /dev/shm; the agent's DaemonSet is rolled; the daemon and the pod stay; the pod's
    end stops the daemon and puts the GPU back to DEFAULT."""
    from gpudra_dev.localcluster import mockstate

    node = runtime_node
    image = agent_image()
    tar = export_agent_image(image, node.runtime.workdir / "images" / "agent.tar")
    node.runtime.import_image(tar)
    tar.unlink()
    rbac = agent_rbac(namespace, secrets.token_hex(3))
    state = mockstate.state_dir(node.driver_root)
    state.mkdir(parents=True, exist_ok=True)
    mock_state = {"name": mockstate.STATE_ENV, "value": "/mock-state"}  # the driver root is mounted read-only
    try:
        for obj in rbac:
            await kube.create(obj)
        sysfs = make_pci_sysfs(node.runtime.workdir / "sys", "dgx-h100")
        agents = agent_daemonset(node, namespace, image, cluster.apiserver_port, free_port(), free_port(), sysfs,
                                 mps=True)
        # host network: a second instance beside the first would find the host's ports taken
        agents["spec"]["updateStrategy"]["rollingUpdate"] = {"maxSurge": 0, "maxUnavailable": 1}
        supervisor = mps_daemonset(node, namespace, image, cluster.apiserver_port)
        for daemonset in (agents, supervisor):
            pod_spec = daemonset["spec"]["template"]["spec"]
            pod_spec["volumes"].append({"name": "mock-state", "hostPath": {"path": str(state), "type": "Directory"}})
            (container,) = pod_spec["containers"]
            container["volumeMounts"].append({"name": "mock-state", "mountPath": "/mock-state"})
            container["env"].append(mock_state)
            await kube.create(daemonset)
        agent_pod = await ready_pod(kube, node, namespace, agents)
        await ready_pod(kube, node, namespace, supervisor)
        devices = await seedobjects.published_devices(kube, node.driver, node.name, 8)
        await wait_for(lambda: _contains(container_log(node, agent_pod, "agent"), "registered with the kubelet as"),
                       timeout=60, what="the kubelet to register the agent pod's plugin")

        claim_obj, *_ = yaml.safe_load_all(REPO_SAMPLES.joinpath("claim-mps.yaml").read_text())
        claim_obj["metadata"]["namespace"] = namespace
        claim_obj["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = node.driver
        claim_obj["spec"]["devices"]["config"][0]["opaque"]["driver"] = node.driver
        await kube.create(claim_obj)
        _, pod = gpu_pod(node, namespace, "mps")
        pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim_obj["metadata"]["name"]}]
        pod["spec"]["containers"][0]["command"] = ["sh", "-c", MPS_SCRIPT]
        await kube.create(pod)

        async def printed() -> tuple[Obj, str] | None:
            got = await kube.get(POD, "mps", namespace)
            if not got or got["status"].get("phase") != "Running":
                return None
            output = container_log(node, got, "train")
            return (got, output) if DONE in output else None

        try:
            running, output = await wait_for(printed, timeout=120, what="the MPS pod to run and print")
        except AssertionError as error:
            raise AssertionError(f"{error}\n{node.failure()}\nagent:\n{container_log(node, agent_pod, 'agent')[-3000:]}")
        claim = await kube.get(CLAIM, claim_obj["metadata"]["name"], namespace)
        assert claim is not None
        uid = claim["metadata"]["uid"]
        gpu = devices[claim["status"]["allocation"]["devices"]["results"][0]["device"]]["attributes"]["uuid"]["string"]
        mps_dir = node.kubelet_dir / "plugins" / node.driver / "mps" / uid
        assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in output.splitlines(), output
        assert "control" in output.splitlines(), f"no control socket in the pod's /tmp/nvidia-mps:\n{output}"
        [daemon] = host_mps_daemons(mps_dir / "pipe")
        # one /dev/shm, where MPS meets its clients: the pod's file is in the daemon's (--isolate-shm),
        # the claim's tmpfs of the default size (mounted in the node's mount namespace, not the host's)
        assert Path(f"/proc/{daemon}/root/dev/shm/written-by-pod").read_text() == "from-the-pod\n"
        mounts = [line.split() for line in Path(f"/proc/{daemon}/mountinfo").read_text().splitlines()]
        shm = [fields for fields in mounts if fields[4] == "/dev/shm"][-1]  # the top of the stack
        assert shm[shm.index("-") + 1] == "tmpfs" and "size=65536k" in shm[-1], (shm, mounts)
        assert mockstate.compute_mode(node.driver_root, gpu) == 3  # EXCLUSIVE_PROCESS

        # The rolling update: a new agent pod replaces the old one. The daemon and the pod stay.
        await kube.patch(DAEMONSET, agents["metadata"]["name"], {"spec": {"template": {"metadata": {
            "annotations": {"kubectl.kubernetes.io/restartedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ")}}}}},
            namespace=namespace)

        async def replaced() -> Obj | None:
            pods = [p async for p in kube.list(POD, namespace, label_selector=_selector(agents))]
            fresh = [p for p in pods if p["metadata"]["uid"] != agent_pod["metadata"]["uid"] and _ready(p)]
            return fresh[0] if fresh and len(pods) == 1 else None

        new_agent = await wait_for(replaced, timeout=120, what="the agent pod to be replaced by the rolling update")
        assert host_mps_daemons(mps_dir / "pipe") == [daemon]
        still = await kube.get(POD, "mps", namespace)
        assert still is not None and still["status"]["phase"] == "Running"
        assert still["status"]["containerStatuses"][0]["restartCount"] == 0

        await kube.delete(POD, "mps", namespace)

        async def released() -> bool:
            # the claim leaves the checkpoint first; its GPU's compute mode is put back after its
            # daemon stops, and only then does the checkpoint forget the GPU
            return (not host_mps_daemons(mps_dir / "pipe") and not mps_dir.exists() and uid not in node.checkpoint()
                    and gpu not in checkpoint_touched(node.kubelet_dir, node.driver))

        try:
            await wait_for(released, timeout=90, what="the new agent to unprepare the claim, its daemon to stop "
                                                      "and its GPU's settings to be put back")
        except AssertionError as error:
            raise AssertionError(f"{error}\nagent:\n{container_log(node, new_agent, 'agent')[-3000:]}") from None
        assert mockstate.compute_mode(node.driver_root, gpu) == 0
        for daemonset in (agents, supervisor):
            await kube.delete(DAEMONSET, daemonset["metadata"]["name"], namespace)
    finally:
        for obj in rbac:
            if obj["kind"] != "ServiceAccount":
                await kube.delete(resource_type(obj["apiVersion"], obj["kind"]), obj["metadata"]["name"],
                                  obj["metadata"].get("namespace"))
    problems = node.runtime.stop()
    assert not problems, problems
    assert node.runtime.leftovers() == []


REPO_SAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "samples"


async def _contains(text: str, needle: str) -> bool:
    return needle in text


def _selector(daemonset: Obj) -> str:
    return ",".join(f"{k}={v}" for k, v in daemonset["spec"]["selector"]["matchLabels"].items())


def _ready(pod: Obj) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions") or [])


async def ready_pod(kube: Kube, node: Node, namespace: str, daemonset: Obj) -> Obj:
    async def probe() -> Obj | None:
        node.runtime.kubelet.assert_running()
        pods = [p async for p in kube.list(POD, namespace, label_selector=_selector(daemonset))]
        return next((p for p in pods if _ready(p)), None)

    try:
        return await wait_for(probe, timeout=120, what=f"DaemonSet {daemonset['metadata']['name']}'s pod to be Ready")
    except AssertionError as error:
        pods = [p.get("status") async for p in kube.list(POD, namespace, label_selector=_selector(daemonset))]
        raise AssertionError(f"{error}\npods: {pods}\n{node.failure()}") from None


def mps_daemonset(node: Node, namespace: str, image: str, apiserver_port: int) -> Obj:
    """The MPS supervisor's DaemonSet as the operator renders it for this node's config, on the host
    network (this node has no CNI plugin)."""
    rendered = render(rt_config(node, namespace, apiserver_port, mps=True), agent_image=image).mps_daemonset
    assert rendered is not None
    rendered["spec"]["template"]["spec"]["hostNetwork"] = True
    rendered["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 10
    return rendered
