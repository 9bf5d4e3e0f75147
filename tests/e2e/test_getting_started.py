"""README's "Getting started on a cluster", every command as written, on a node with a real
container runtime: the release's kubelet on containerd (tests/realruntime.py), an image registry on
this machine (tests/localregistry.py), and the shared control plane.

The commands are read from the README: each line of its ``sh`` blocks and each inline code span
that starts with a command (``kubectl``, ``podman``, ``ctr``, ``make``, ``gpudra``, ...). The test
runs every one of them and ends by checking that the set it ran is the set the README holds, so a
command added to the README without a test fails here. It runs them with only these substitutions:

* ``registry.example.com`` -> the local registry (``localhost:<port>``, HTTPS with a test CA that
  podman trusts through ``SSL_CERT_FILE`` and containerd through its ``hosts.toml``);
* ``my-overlay`` -> a directory with the README's ``kustomization.yaml`` (its ``../manifests/base``
  the path to this repository's) plus the test-only patch below;
* placeholders filled from the cluster: ``<node>`` (the test node), ``<name>`` (one of its
  ResourceSlices), ``<claim>`` (the seed pod's claim);
* the node is a GPU Operator node (its driver under ``/run/nvidia/driver``), so, as the README says
  for one, the sample GpuDraConfig gets ``driverRoot: /run/nvidia/driver`` (a copy that differs in
  that field only) and ``gpudra discover`` gets ``--driver-root /run/nvidia/driver`` (and
  ``-o json``, to compare); it runs "on the node": in the node's mount namespace;
* ``ctr`` reaches the node's containerd through ``CONTAINERD_ADDRESS`` (its own socket); the
  operator image gets the agent image's ``podman save`` and ``ctr`` commands with its own name
  ("the same for the operator image"), and the test checks that the node then has every image
  ``manifests/base`` names.

What stands in for a real cluster's parts:

* **The pod network** (the one deviation in what gets installed): the node runs no CNI plugin, so
  a mutating webhook puts every pod of the README's namespaces on the host network, with the API
  server at 127.0.0.1 and free host ports (tests/hostnetwork.py), and the overlay's test-only
  patch labels the operator's namespace ``privileged`` so Pod Security admits that.
* **The node**: its driver root is a fake one with the mock NVML and real device nodes
  (``make_driver_root``), bind-mounted at ``/run/nvidia/driver`` in the node's namespace, as are
  its kubelet directory at ``/var/lib/kubelet`` and its CDI directory at ``/var/run/cdi``: the
  config's defaults. The test lifts the node's not-ready taint once it is Ready (no node-lifecycle
  controller runs in the shared control plane).
* **The workload's image** ``nvcr.io/nvidia/cuda:12.8.1-base-ubuntu24.04`` is preloaded (nothing
  is pulled from outside this machine; every other registry leads to a closed local port): static
  busybox whose ``nvidia-smi`` runs the driver's, which CDI mounts from the driver root, then holds
  the GPU until the test has looked at the claim, as a real job holds it while it runs.

The node, the registry and the webhook are tests/installnode.py's. The Helm chart is installed,
upgraded, rolled back and uninstalled on the same kind of node by tests/e2e/test_helm_lifecycle.py."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import pytest_asyncio
import yaml
import installnode
from installnode import (DRIVER_ROOT, PODMAN_CONF, RELEASE, SEED, InstallNode, forget_images, install_node,
                         seed_workload_image, touch_in_container, without_make_flags)
from realruntime import RealRuntimeNode

from gpudra_core.kubeapi import Kube, Obj, ResourceType, resource_type
from gpudra_dev.localcluster.controlplane import ControlPlane
from gpudra_dev.localcluster.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
SECTION = "## Getting started on a cluster"
SAMPLE = REPO / "manifests" / "samples" / "gpudraconfig.yaml"
PROGRAMS = ("kubectl", "podman", "docker", "ctr", "make", "gpudra", "helm", "kind", "crictl", "nerdctl")
EXAMPLE_REGISTRY = "registry.example.com"
NAMESPACES = ["gpudra-operator", "gpudra-system", "default"]

CONFIG = resource_type("gpudra.io/v1alpha1", "GpuDraConfig")
POD = resource_type("v1", "Pod")
NAMESPACE = resource_type("v1", "Namespace")
SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")
TEMPLATE = resource_type("resource.k8s.io/v1", "ResourceClaimTemplate")
JOB = resource_type("batch/v1", "Job")
DEVICE_CLASS = resource_type("resource.k8s.io/v1", "DeviceClass")
DAEMONSET = resource_type("apps/v1", "DaemonSet")

pytestmark = pytest.mark.timeout(1500)  # make images may have to build both images first


# -- the README ---------------------------------------------------------------------------------------

@dataclass
class Guide:
    commands: list[str]  # shlex-joined, in the README's order
    yaml_blocks: list[str]


def read_guide(text: str) -> Guide:
    """The commands and YAML blocks of the README's getting-started section. A command is a line of
    an ``sh`` block (its ``#`` comment dropped) or an inline code span starting with a program."""
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    section = text[start:end if end >= 0 else None]
    commands: list[str] = []
    yaml_blocks: list[str] = []
    prose: list[str] = []
    for i, part in enumerate(re.split(r"^```", section, flags=re.M)):
        if i % 2 == 0:
            prose.append(part)
            continue
        lang, _, body = part.partition("\n")
        if lang.strip() == "sh":
            commands += [shlex.join(argv) for line in body.splitlines() if (argv := shlex.split(line, comments=True))]
        elif lang.strip() == "yaml":
            yaml_blocks.append(body)
    for span in re.findall(r"`([^`\n]+)`", "".join(prose)):
        argv = shlex.split(span)
        if argv and argv[0] in PROGRAMS:
            commands.append(shlex.join(argv))
    return Guide(commands, yaml_blocks)


def guide() -> Guide:
    return read_guide(README.read_text())


@dataclass
class Runner:
    """Runs README commands (given as the README writes them) with substitutions; remembers which."""

    commands: list[str]
    env: dict[str, str]
    substitutions: dict[str, str]
    ran: set[str] = field(default_factory=set)
    log: list[str] = field(default_factory=list)

    def run(self, command: str, *, extra: Mapping[str, str] = {}, append: tuple[str, ...] = (),
            prefix: tuple[str, ...] = (), env: Mapping[str, str] = {}, cwd: Path = REPO,
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """Run ``command`` (it must be in the README) with the global substitutions and ``extra``;
        ``append`` adds documented options, ``prefix`` runs it elsewhere (on the node)."""
        key = shlex.join(shlex.split(command))
        assert key in self.commands, f"not a command of the README's getting-started section: {key}"
        replace = {**self.substitutions, **extra}
        argv = []
        for token in shlex.split(command):
            for old, new in replace.items():
                token = token.replace(old, new)
            argv.append(token)
        argv = [*prefix, *argv, *append]
        started = time.monotonic()
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                                env={**self.env, **env})
        took = time.monotonic() - started
        self.ran.add(key)
        self.log.append(f"{took:6.1f}s  {shlex.join(argv)}")
        print(f"[getting-started] $ {shlex.join(argv)}  ({took:.1f}s)\n{result.stdout[-3000:]}")
        assert result.returncode == 0, (f"{shlex.join(argv)} exited {result.returncode}:\n"
                                        f"{result.stdout[-5000:]}\n{result.stderr[-5000:]}")
        return result


# -- the node, the registry, the pod network ------------------------------------------------------------

def pod_log(node: RealRuntimeNode, pod: Obj, container: str) -> str:
    return installnode.pod_log(node, pod, container)


async def pods_report(kube: Kube, setup: InstallNode) -> str:
    """Every pod of the README's namespaces: phase, container states and the last log lines."""
    lines = []
    for namespace in NAMESPACES:
        async for pod in kube.list(POD, namespace):
            statuses = [(s["name"], s.get("state"), s.get("restartCount"))
                        for s in pod.get("status", {}).get("containerStatuses") or []]
            lines.append(f"pod {namespace}/{pod['metadata']['name']}: {pod.get('status', {}).get('phase')} "
                         f"{pod.get('status', {}).get('conditions')} {statuses}")
            for container in pod["spec"]["containers"]:
                lines.append(f"  {container['name']} log:\n{pod_log(setup.node, pod, container['name'])[-3000:]}")
    return "\n".join(lines)


@pytest_asyncio.fixture(loop_scope="session")
async def setup(cluster: ControlPlane, kube: Kube) -> AsyncIterator[InstallNode]:
    """The node (Ready, untainted), the registry, the webhook; then, on the way out, everything the
    README's commands made, except the CRD (the session's other tests share it), and the names
    make images gave the images for the local registry."""
    async def remove(setup: InstallNode) -> None:
        try:
            await remove_installed(cluster, kube, setup)
        finally:
            forget_images(f"{setup.registry.host}/gpudra/{image}:{version()}" for image in ("gpudra-operator", "gpudra"))

    async with install_node(cluster, kube, prefix="gs", namespaces=NAMESPACES,
                            taint="gpudra.io/getting-started=:PreferNoSchedule", remove_installed=remove) as ready:
        yield ready


async def remove_installed(cluster: ControlPlane, kube: Kube, setup: InstallNode) -> None:
    """Delete what the README's commands created, while the kubelet still runs to confirm its pods
    gone; the GpuDraConfig first, which the operator tears down. The CRD stays."""
    await kube.delete(JOB, "train", "default", propagation="Background")
    await kube.delete(TEMPLATE, "gpu-64gi", "default")
    if await kube.get(CONFIG, "default") is not None:
        await kube.delete(CONFIG, "default")
    base = [d for d in yaml.safe_load_all(cluster.kubectl("kustomize", str(REPO / "manifests" / "base")).stdout) if d]
    rest = [o for o in base if o["kind"] not in ("CustomResourceDefinition", "Namespace")]
    cluster.kubectl("delete", "-f", "-", "--ignore-not-found", "--wait=false", input=yaml.safe_dump_all(rest))
    for namespace in ("gpudra-operator", "gpudra-system"):
        await kube.delete(NAMESPACE, namespace)

    async def gone() -> bool:
        pods = [p async for p in kube.list(POD, "default", label_selector="job-name=train")]
        return (not pods and await absent(kube, NAMESPACE, "gpudra-operator")
                and await absent(kube, NAMESPACE, "gpudra-system"))

    try:
        await wait_for(gone, timeout=120, what="the README's namespaces and pods to be deleted")
    except AssertionError as error:
        raise AssertionError(f"{error}\n{await pods_report(kube, setup)}") from None


async def assert_no_crash_loop(kube: Kube) -> None:
    """Fail now, not at the deadline, when a container of the README's pods keeps exiting."""
    for namespace in ("gpudra-operator", "gpudra-system"):
        async for pod in kube.list(POD, namespace):
            for status in pod.get("status", {}).get("containerStatuses") or []:
                assert status.get("restartCount", 0) < 2, f"{namespace}/{pod['metadata']['name']} keeps restarting"


async def absent(kube: Kube, rtype: ResourceType, name: str, namespace: str | None = None) -> bool:
    return await kube.get(rtype, name, namespace) is None


def version() -> str:
    found = re.search(r'^version = "(.*)"', (REPO / "pyproject.toml").read_text(), re.M)
    assert found
    return found.group(1)


def command_env(setup: InstallNode, cluster: ControlPlane) -> dict[str, str]:
    """PATH with this repository's gpudra, the cluster's kubectl and the node's ctr; KUBECONFIG (the
    session cluster's); podman as hack/podman/containers.conf runs it on these machines."""
    path = os.pathsep.join([str(Path(sys.executable).parent), str(cluster.bin_dir), str(setup.node.bin_dir),
                            os.environ.get("PATH", "")])
    return {**without_make_flags(os.environ), "PATH": path, "KUBECONFIG": str(cluster.kubeconfig), "CONTAINERS_CONF": str(PODMAN_CONF)}


# -- the test -----------------------------------------------------------------------------------------

def overlay(directory: Path, guide: Guide, registry: str) -> tuple[Path, Obj]:
    """``my-overlay``: the README's kustomization (its base path and registry substituted) plus the
    test-only patch that lets the operator's namespace run pods on the host network."""
    (block,) = [b for b in guide.yaml_blocks if b.lstrip().startswith("resources:")]
    kustomization = yaml.safe_load(block.replace(EXAMPLE_REGISTRY, registry))
    assert kustomization["resources"] == ["../manifests/base"], kustomization
    kustomization["resources"] = [os.path.relpath(REPO / "manifests" / "base", directory)]
    kustomization["patches"] = [{"patch": yaml.safe_dump({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": "gpudra-operator", "labels": {
            f"pod-security.kubernetes.io/{mode}": "privileged" for mode in ("enforce", "audit", "warn")}}})}]
    directory.mkdir(parents=True)
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return directory, kustomization


def gpu_operator_config(out: Path) -> Path:
    """The sample with ``spec.agent.driverRoot: /run/nvidia/driver`` (the README's GPU Operator note)."""
    config = yaml.safe_load(SAMPLE.read_text())
    assert "driverRoot" not in config["spec"]["agent"]
    config["spec"]["agent"]["driverRoot"] = DRIVER_ROOT
    out.write_text(yaml.safe_dump(config))
    return out


async def test_getting_started_on_a_cluster_works_as_written(cluster: ControlPlane, kube: Kube, setup: InstallNode) -> None:
    readme = guide()
    node = setup.node
    registry = setup.registry.host
    work = setup.workdir / "user"
    work.mkdir()
    runner = Runner(readme.commands, command_env(setup, cluster), {f"{EXAMPLE_REGISTRY}/gpudra": f"{registry}/gpudra"})
    tag = version()
    assert f"gpudra:{tag}" in README.read_text(), f"the README's image tags are not the version {tag}"

    # -- 1. install: build, push, apply the overlay ------------------------------------------------
    runner.run("make images IMAGE_REGISTRY=registry.example.com/gpudra", timeout=1200)
    push_env = setup.registry.client_env()
    runner.run(f"podman push registry.example.com/gpudra/gpudra-operator:{tag}", env=push_env)
    runner.run(f"podman push registry.example.com/gpudra/gpudra:{tag}", env=push_env)
    my_overlay, kustomization = overlay(setup.workdir / "my-overlay", readme, registry)
    runner.run("kubectl apply --server-side -k my-overlay", extra={"my-overlay": str(my_overlay)})
    assert {i["newName"] for i in kustomization["images"]} == {f"{registry}/gpudra/gpudra-operator",
                                                                f"{registry}/gpudra/gpudra"}

    # No registry: the images under their default names, saved and imported into the node's containerd.
    runner.run("make images", timeout=1200)
    ctr_env = {"CONTAINERD_ADDRESS": str(node.socket)}
    for image, tar in ((f"ghcr.io/gpudra/gpudra:{tag}", "gpudra.tar"),
                       (f"ghcr.io/gpudra/gpudra-operator:{tag}", "gpudra-operator.tar")):
        # The README spells out the agent image's commands; "the same for the operator image".
        same = {"gpudra.tar": tar, f"ghcr.io/gpudra/gpudra:{tag}": image}
        runner.run(f"podman save --format oci-archive -o gpudra.tar ghcr.io/gpudra/gpudra:{tag}", extra=same, cwd=work)
        runner.run("ctr -n k8s.io images import gpudra.tar", extra=same, env=ctr_env, cwd=work)
        (work / tar).unlink()
    imported = set(node.ctr("images", "ls", "-q").stdout.split())
    base = cluster.kubectl("kustomize", str(REPO / "manifests" / "base")).stdout
    base_images = set(re.findall(r"ghcr\.io/gpudra/[\w-]+:[\w.]+", base))
    assert base_images == {f"ghcr.io/gpudra/gpudra:{tag}", f"ghcr.io/gpudra/gpudra-operator:{tag}"}, base_images
    assert base_images <= imported, f"manifests/base names {base_images}; the node has {imported}"

    runner.run("kubectl label node <node> gpudra.io/gpu-node=true", extra={"<node>": node.node_name})

    # -- 2. configure ----------------------------------------------------------------------------
    config = gpu_operator_config(setup.workdir / "gpudraconfig.yaml")
    runner.run("kubectl apply --server-side -f manifests/samples/gpudraconfig.yaml",
               extra={"manifests/samples/gpudraconfig.yaml": str(config)})
    started = time.monotonic()

    async def ready() -> Obj | None:
        node.kubelet.assert_running()
        await assert_no_crash_loop(kube)
        live = await kube.get(CONFIG, "default")
        conditions = ((live or {}).get("status") or {}).get("conditions") or []
        return live if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions) else None

    try:
        await wait_for(ready, timeout=240, what="GpuDraConfig default to be Ready")
    except AssertionError as error:
        live = await kube.get(CONFIG, "default")
        raise AssertionError(f"{error}\nstatus: {live and live.get('status')}\n{await pods_report(kube, setup)}\n"
                             f"{setup.failure()}") from None
    print(f"[getting-started] GpuDraConfig Ready {time.monotonic() - started:.1f}s after it was applied")
    runner.run("kubectl wait --for=condition=Ready gdc/default --timeout=5m")
    got = runner.run("kubectl get gdc").stdout
    assert re.search(r"^default\s+gpu\.gpudra\.io\s+True\s+1/1\s", got, re.M), got
    described = runner.run("kubectl describe gdc default").stdout
    for condition in ("Ready", "AgentsReady", "DeviceClassesReady", "Degraded"):
        assert condition in described, described
    # The pods run the images the overlay named, pulled from the registry.
    for namespace, image in (("gpudra-operator", "gpudra-operator"), ("gpudra-system", "gpudra")):
        images = {c["image"] async for p in kube.list(POD, namespace) for c in p["spec"]["containers"]}
        assert images == {f"{registry}/gpudra/{image}:{tag}"}, images
    rendered = list(yaml.safe_load_all(runner.run("gpudra render -f manifests/samples/gpudraconfig.yaml").stdout))
    assert {(o["kind"], o["metadata"]["name"]) for o in rendered if o} >= {
        ("DaemonSet", "gpudra-agent"), ("DeviceClass", "gpu.gpudra.io"), ("DeviceClass", "gpu-64gi.gpudra.io")}

    # -- 3. what the scheduler sees ---------------------------------------------------------------
    classes = runner.run("kubectl get deviceclasses").stdout
    for name in ("gpu.gpudra.io", "gpu-full.gpudra.io", "mig.gpudra.io", "gpu-64gi.gpudra.io"):
        assert name in classes, classes
    assert node.node_name in runner.run("kubectl get resourceslices -o wide").stdout
    slices = [s async for s in kube.list(SLICE, field_selector=f"spec.driver=gpu.gpudra.io,spec.nodeName={node.node_name}")]
    published = {d["name"]: d for s in slices for d in s["spec"].get("devices") or []}
    assert len(published) == 8, sorted(published)
    one = yaml.safe_load(runner.run("kubectl get resourceslice <name> -o yaml",
                                    extra={"<name>": slices[0]["metadata"]["name"]}).stdout)
    assert one["spec"]["nodeName"] == node.node_name
    assert node.holder is not None
    discovered = json.loads(runner.run("gpudra discover", prefix=("nsenter", "-t", str(node.holder.pid), "-m", "--"),
                                       append=("--driver-root", DRIVER_ROOT, "-o", "json"),
                                       env={"NODE_NAME": node.node_name}).stdout)
    assert sorted(d["name"] for d in discovered["devices"]) == sorted(published), discovered["devices"]
    simulated = runner.run("gpudra discover --nvml fake:dgx-h100").stdout
    assert "H100" in simulated, simulated

    # -- 4. claim a GPU --------------------------------------------------------------------------
    template, _ = yaml.safe_load_all(SEED.read_text())
    (shown,) = [yaml.safe_load(b) for b in readme.yaml_blocks if "ResourceClaimTemplate" in b]
    del template["metadata"]["namespace"]
    assert shown == template, "the README's ResourceClaimTemplate is not the one in manifests/samples/seed-workload.yaml"
    tar, image = seed_workload_image(setup.workdir / "images" / "cuda.tar")
    refused = node.crictl("pull", f"{image}-not-here", check=False)  # the guard of write_registry_hosts
    assert refused.returncode != 0 and "127.0.0.1:1" in refused.stderr, refused
    node.import_image(tar)
    runner.run("kubectl apply -f manifests/samples/seed-workload.yaml")
    started = time.monotonic()

    async def holding() -> tuple[Obj, str] | None:
        node.kubelet.assert_running()
        pods = [p async for p in kube.list(POD, "default", label_selector="job-name=train")]
        assert all(p["status"].get("phase") != "Failed" for p in pods), [p["status"] for p in pods]
        running = [p for p in pods if p["status"].get("phase") == "Running"]
        if not running:
            return None
        output = pod_log(node, running[0], "train")
        return (running[0], output) if "GPU 0:" in output else None

    try:
        pod, output = await wait_for(holding, timeout=120, what="the seed Job's pod to run nvidia-smi with its GPU")
    except AssertionError as error:
        raise AssertionError(f"{error}\n{await pods_report(kube, setup)}\n{setup.failure()}") from None
    print(f"[getting-started] the seed pod ran nvidia-smi {time.monotonic() - started:.1f}s after the apply:\n{output}")
    assert pod["spec"]["nodeName"] == node.node_name
    assert pod["metadata"]["name"] in runner.run("kubectl get pods -o wide").stdout
    (status,) = pod["status"]["resourceClaimStatuses"]
    claim_name = status["resourceClaimName"]
    claims = runner.run("kubectl get resourceclaims -A").stdout
    assert re.search(rf"^default\s+{re.escape(claim_name)}\s+allocated,reserved\s", claims, re.M), claims
    allocation = json.loads(runner.run("kubectl get resourceclaim <claim> -o jsonpath='{.status.allocation}'",
                                       extra={"<claim>": claim_name}).stdout)
    (result,) = allocation["devices"]["results"]
    assert (result["driver"], result["pool"]) == ("gpu.gpudra.io", node.node_name), result
    uuid = published[result["device"]]["attributes"]["uuid"]["string"]
    assert re.search(rf"^GPU 0: .* \(UUID: {re.escape(uuid)}\) ", output, re.M), f"not the claim's GPU {uuid}:\n{output}"

    release(node, pod)
    runner.run("kubectl wait --for=condition=complete job/train --timeout=5m")
    await wait_for(lambda: absent(kube, CLAIM, claim_name, "default"), timeout=60,
                   what=f"claim {claim_name} to be deleted once its pod is done")

    print("[getting-started] commands run:\n" + "\n".join(runner.log))
    assert runner.ran == set(readme.commands), (
        f"README commands no test ran: {sorted(set(readme.commands) - runner.ran)}")


def release(node: RealRuntimeNode, pod: Obj) -> None:
    """Let the workload's container end: create RELEASE in its root filesystem."""
    touch_in_container(node, pod, RELEASE)


def test_the_guide_is_read_whole() -> None:
    """The parser finds every kind of command the section has (a README reshaped so that it finds
    none would make the e2e test vacuous)."""
    commands = guide().commands
    for expected in ("kubectl apply --server-side -k my-overlay", "ctr -n k8s.io images import gpudra.tar",
                     "gpudra discover", "kubectl wait --for=condition=complete job/train --timeout=5m",
                     "kubectl get resourceclaim '<claim>' -o 'jsonpath={.status.allocation}'"):
        assert expected in commands, commands
