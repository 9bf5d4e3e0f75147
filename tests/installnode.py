"""A node to install gpudra on as a user would, with its images pulled from a registry: the release's
kubelet on containerd and runc (tests/realruntime.py), an image registry on this machine
(tests/localregistry.py), and the stand-in for a pod network (tests/hostnetwork.py), on a control
plane of the caller's. Used by the README's getting-started test and by the Helm lifecycle tests.

* **The node**: a fake driver root with the mock NVML and real device nodes (``make_driver_root``),
  bind-mounted at ``/run/nvidia/driver`` in the node's mount namespace, as are its kubelet directory
  at ``/var/lib/kubelet`` and its CDI directory at ``/var/run/cdi``: a GpuDraConfig's defaults,
  with the GPU Operator's driver root. The node's not-ready taint is lifted once it is Ready (no
  node-lifecycle controller runs in these control planes).
* **The registry**: containerd trusts its CA through ``hosts.toml``; every other registry leads to
  a closed local port, so nothing is pulled from outside this machine.
* **The pod network**: the node runs no CNI plugin, so a mutating webhook puts every pod of the
  given namespaces on the host network with the API server at 127.0.0.1 and free host ports; the
  namespaces the pods run in must therefore admit privileged pods (Pod Security)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from hostnetwork import HostNetworkWebhook
from localregistry import LocalRegistry
from ociimage import Entry, busybox_entries, write_image
from realkubelet import kubelet_binary
from realruntime import RealRuntimeNode, read_cri_log, runtime_problem

from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_dev.localcluster.controlplane import ControlPlane
from gpudra_dev.localcluster.fakedriverroot import make_driver_root
from gpudra_dev.localcluster.objects import delete_node
from gpudra_dev.localcluster.pki import LocalPKI
from gpudra_dev.localcluster.waiting import wait_for

REPO = Path(__file__).resolve().parent.parent
PODMAN_CONF = REPO / "hack" / "podman" / "containers.conf"
DRIVER_ROOT = "/run/nvidia/driver"  # the GPU Operator's driver container's
SEED = REPO / "manifests" / "samples" / "seed-workload.yaml"
RELEASE = "/tmp/gpudra-release"  # in the seed workload's container: the test has looked, the job may end
NODE = resource_type("v1", "Node")
WEBHOOKS = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"


@dataclass
class InstallNode:
    workdir: Path
    node: RealRuntimeNode
    driver_root: Path
    registry: LocalRegistry
    webhook: HostNetworkWebhook

    @property
    def name(self) -> str:
        return self.node.node_name

    def failure(self) -> str:
        return (f"{self.node.describe()}\nkubelet log:\n{self.node.kubelet.log_tail(40)}\n"
                f"webhook admitted {self.webhook.admitted}, errors {self.webhook.errors}\n"
                f"registry log:\n{self.registry.log_tail(10)}")


@asynccontextmanager
async def install_node(cluster: ControlPlane, kube: Kube, *, prefix: str, namespaces: list[str], taint: str,
                       remove_installed: Callable[[InstallNode], Awaitable[None]]) -> AsyncIterator[InstallNode]:
    """The node (Ready, untainted), the registry and the webhook; on the way out
    ``remove_installed`` (while the kubelet still runs to see pods go), then everything else. Fails
    the test if anything is left behind."""
    if problem := runtime_problem():
        pytest.fail(problem, pytrace=False)
    # Short: the kubelet dials the agent's registration socket, <this>/kubelet/plugins_registry/
    # gpu.gpudra.io-<pod UID>-reg.sock, by a path that must fit in 107 bytes.
    workdir = Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir="/tmp"))
    name = f"{prefix}-{secrets.token_hex(3)}"
    registry: LocalRegistry | None = None
    webhook: HostNetworkWebhook | None = None
    node: RealRuntimeNode | None = None
    ready: InstallNode | None = None
    webhook_created = False
    try:
        pki = LocalPKI(workdir / "pki")
        registry = LocalRegistry(workdir / "registry", pki)
        webhook = HostNetworkWebhook(f"gpudra-test-host-network-{secrets.token_hex(3)}",
                                     pki.issue("webhook", "127.0.0.1", ips=("127.0.0.1",), server=True),
                                     pki.ca.cert.read_bytes(), cluster.apiserver_port, namespaces)
        driver_root = make_driver_root(workdir / "driver-root", "dgx-h100")
        node = RealRuntimeNode(
            workdir, kubelet_binary=kubelet_binary(cluster.bin_dir), kubeconfig=cluster.kubeconfig, node_name=name,
            cdi_dir=workdir / "cdi", taint=taint,
            binds={"/var/lib/kubelet": workdir / "kubelet", "/var/run/cdi": workdir / "cdi", DRIVER_ROOT: driver_root})
        registry.start()
        write_registry_hosts(workdir / "registry-hosts", registry)
        webhook.start()
        await kube.request("POST", WEBHOOKS, body=webhook.configuration())
        webhook_created = True
        await wait_for_webhook(kube)
        started = time.monotonic()
        node.start()
        await node.kubelet.wait_ready(kube)
        live = await kube.get(NODE, name)
        assert live is not None
        taints = [t for t in live["spec"].get("taints") or [] if t["key"] != "node.kubernetes.io/not-ready"]
        await kube.patch(NODE, name, {"spec": {"taints": taints}})
        print(f"\n[{prefix}] node {name} ready in {time.monotonic() - started:.1f}s")
        ready = InstallNode(workdir, node, driver_root, registry, webhook)
        yield ready
    finally:
        problems = await _tear_down(kube, name, ready, remove_installed, node, registry, webhook,
                                    webhook_created and webhook is not None)
        if problems:
            pytest.fail(f"the {prefix} test left things behind (kept {workdir}): {problems}", pytrace=False)
        shutil.rmtree(workdir, ignore_errors=True)


async def _tear_down(kube: Kube, node_name: str, ready: InstallNode | None,
                     remove_installed: Callable[[InstallNode], Awaitable[None]], node: RealRuntimeNode | None,
                     registry: LocalRegistry | None, webhook: HostNetworkWebhook | None,
                     webhook_created: bool) -> list[str]:
    """Every step tried, whatever failed before; returns what went wrong or was left."""
    problems: list[str] = []

    async def step(what: str, action: Callable[[], object]) -> None:
        try:
            result = action()
            if hasattr(result, "__await__"):
                await result  # type: ignore[misc]
        except Exception as error:  # noqa: BLE001 - teardown goes on
            problems.append(f"{what}: {type(error).__name__}: {error}")

    if ready is not None:
        await step("removing what was installed", lambda: remove_installed(ready))
    if webhook_created and webhook is not None:
        await step("deleting the webhook", lambda: kube.request("DELETE", f"{WEBHOOKS}/{webhook.name}"))
    if webhook is not None:
        await step("stopping the webhook", webhook.stop)
    if node is not None:
        await step("stopping the node", lambda: problems.extend(node.stop()))
        await step("deleting the Node", lambda: delete_node(kube, node_name))
    if registry is not None:
        await step("stopping the registry", registry.stop)
    if node is not None:
        problems += node.leftovers()
    return problems


def without_make_flags(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` less what `make test` exports to its children: a make that a command under test
    runs (`make images`, a helm plugin's) must not inherit the suite's jobserver and flags."""
    return {k: v for k, v in environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}


def pod_log(node: RealRuntimeNode, pod: Obj, container: str) -> str:
    """A container's output (its latest run), from the log the runtime writes under the kubelet's pod
    log directory (CRI format ``<time> <stream> <P|F> <text>``; P lines are partial)."""
    meta = pod["metadata"]
    logs = sorted((node.kubelet.pod_logs_dir / f"{meta['namespace']}_{meta['name']}_{meta['uid']}" / container).glob("*.log"),
                  key=lambda p: int(p.stem) if p.stem.isdigit() else -1)
    return read_cri_log(logs[-1]) if logs else ""  # <restart count>.log: the latest run's


def write_registry_hosts(hosts_dir: Path, registry: LocalRegistry) -> None:
    """containerd's registry config: the local registry with its CA; every other registry at a
    closed local port, so nothing is ever pulled from outside this machine."""
    for directory, content in {**registry.containerd_hosts(), "_default": 'server = "https://127.0.0.1:1"\n'}.items():
        (hosts_dir / directory).mkdir(parents=True, exist_ok=True)
        (hosts_dir / directory / "hosts.toml").write_text(content)


def node_pulls(setup: InstallNode, *, allowed: bool) -> None:
    """Let the node's containerd pull from the registry again, or not: a node cut off from its
    registry (containerd reads hosts.toml at each pull), while clients on this machine still reach it."""
    hosts = setup.workdir / "registry-hosts" / setup.registry.host / "hosts.toml"
    hosts.write_text(setup.registry.containerd_hosts()[setup.registry.host] if allowed
                     else 'server = "https://127.0.0.1:1"\n')


async def wait_for_webhook(kube: Kube) -> None:
    """Until the API server calls the webhook (it picks new configurations up asynchronously)."""
    probe = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "host-network-probe", "namespace": "default"},
             "spec": {"containers": [{"name": "c", "image": "x", "ports": [{"containerPort": 80}]}]}}

    async def admitted() -> bool:
        pod = await kube.create(probe, dry_run=True)
        return pod["spec"].get("hostNetwork") is True

    await wait_for(admitted, timeout=30, what="the API server to call the host-network webhook")


def podman(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """podman as hack/podman/containers.conf runs it on these machines."""
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "CONTAINERS_CONF": str(PODMAN_CONF), **(env or {})})


def forget_images(references: Iterable[str]) -> None:
    """Remove names given to images for the local registry; an image left without a name (its
    default names moved on to a newer build meanwhile) goes too."""
    for reference in references:
        found = podman("image", "inspect", "--format", "{{.Id}}", reference)
        if found.returncode != 0:
            continue
        podman("untag", reference, reference)  # this name only: a bare `untag IMAGE` drops every name
        image = found.stdout.strip()
        if podman("image", "inspect", "--format", "{{len .RepoTags}}", image).stdout.strip() == "0":
            podman("rmi", image)


def touch_in_container(node: RealRuntimeNode, pod: Obj, path: str, container: str | None = None) -> None:
    """Create ``path`` in the root filesystem of the pod's running container (``container``, or its
    only running one), through /proc: how a test lets a workload that waits for it go on."""
    labels = ["--label", f"io.kubernetes.pod.uid={pod['metadata']['uid']}"]
    if container is not None:
        labels += ["--label", f"io.kubernetes.container.name={container}"]
    (cid,) = node.crictl("ps", "-q", "--no-trunc", *labels).stdout.split()
    pid = json.loads(node.crictl("inspect", cid).stdout)["info"]["pid"]
    Path(f"/proc/{pid}/root{path}").touch()


def seed_workload_image(out: Path) -> tuple[Path, str]:
    """The stand-in for the seed Job's image (manifests/samples/seed-workload.yaml), under the Job's
    image name, preloaded on a node (nothing is pulled from outside this machine): static busybox
    whose ``nvidia-smi`` runs the driver's, which CDI mounts from the driver root, then holds the GPU
    until RELEASE exists in its container, as a real job holds it while it runs."""
    _, job = yaml.safe_load_all(SEED.read_text())
    (container,) = job["spec"]["template"]["spec"]["containers"]
    hold = (f'#!/bin/sh\n/usr/bin/nvidia-smi "$@" || exit\n'
            f"while [ ! -e {RELEASE} ]; do sleep 0.1; done\n")
    entries = [*busybox_entries(), Entry("usr/local"), Entry("usr/local/bin"),
               Entry("usr/local/bin/nvidia-smi", hold.encode())]
    return write_image(out, container["image"], entries), container["image"]
