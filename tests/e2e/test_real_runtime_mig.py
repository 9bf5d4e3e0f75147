"""Dynamic MIG on a node with a real container runtime (tests/e2e/test_real_runtime.py's node: the
release's kubelet on containerd and runc, CDI on), the agent a host process with ``--mig dynamic``
on the mock NVML of two MIG-enabled H100s without MIG devices.

The real scheduler gives a pod's claim a 2g.20gb placement; the kubelet has the agent prepare it,
which creates the GPU and compute instance through NVML (the real pynvml on the mock library); the
container sees its GPU's node, its instance's two capability nodes and no other GPU, with the MIG
device's UUID in ``NVIDIA_VISIBLE_DEVICES``. Deleting the pod unprepares the claim: the instance is
destroyed. A claim of the whole GPU 0 turns its MIG mode off at prepare (the container sees the
GPU's node and UUID, no MIG capability) and on again at unprepare. On Kubernetes 1.35 (partitionable devices off) the agent publishes static MIG and says
so; CI runs this file on 1.36.3 and 1.37.2 as well."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from test_real_runtime import DONE, POD, TAINT, TEST_IMAGE, Node, printed_output, runtime_node_of, start_host_agent

from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_dev.localcluster.controlplane import ControlPlane
from gpudra_dev.localcluster.fakedriverroot import LIB_DIR
from gpudra_dev.localcluster.mockstate import STATE_ENV, state_dir
from gpudra_driver.plugin.devicenodes import mig_cap_minor_fallback
from gpudra_dev.localcluster.waiting import wait_for

CLAIM = resource_type("resource.k8s.io/v1", "ResourceClaim")
SLICE = resource_type("resource.k8s.io/v1", "ResourceSlice")
EVENT = resource_type("v1", "Event")
PROFILE = "h100-dynamic-mig"
SCRIPT = (f"ls -l /dev/nvidia* /dev/nvidia-caps/; env | grep ^NVIDIA_VISIBLE_DEVICES=; echo {DONE}; "
          "exec sleep 3600")

pytestmark = pytest.mark.timeout(600)


async def minor_version(kube: Kube) -> int:
    return int("".join(ch for ch in (await kube.request("GET", "/version"))["minor"] if ch.isdigit()))


@pytest_asyncio.fixture(loop_scope="session")
async def mig_node(cluster: ControlPlane, kube: Kube) -> AsyncIterator[Node]:
    async with runtime_node_of(cluster, kube, PROFILE) as node:
        await start_host_agent(cluster, node, PROFILE, "--mig", "dynamic")
        yield node


def mig_instances(node: Node) -> list[tuple[int, int]]:
    """(GPU instance, compute instance) of GPU 0's MIG devices, as the real pynvml on the node's
    mock library lists them (a child process: the library's state is per process)."""
    script = r'''
import ctypes, json, sys, pynvml
from gpudra_dev.localcluster.mockstate import mig_devices
pynvml.nvmlLib = ctypes.CDLL(sys.argv[1])
print(json.dumps(mig_devices(pynvml)))
'''
    library = (node.driver_root / LIB_DIR / "libnvidia-ml.so.1").absolute()
    out = subprocess.run([sys.executable, "-c", script, str(library)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, STATE_ENV: str(state_dir(node.driver_root))})
    assert out.returncode == 0, out.stderr
    return [(gi, ci) for gi, ci in json.loads(out.stdout)]


def mig_mode(node: Node, index: int = 0) -> tuple[int, int]:
    """GPU ``index``'s (current, pending) MIG mode, as the real pynvml on the node's mock library
    answers it (a child process, as for :func:`mig_instances`)."""
    script = r'''
import ctypes, json, sys, pynvml
pynvml.nvmlLib = ctypes.CDLL(sys.argv[1])
pynvml.nvmlInit()
print(json.dumps(pynvml.nvmlDeviceGetMigMode(pynvml.nvmlDeviceGetHandleByIndex(int(sys.argv[2])))))
'''
    library = (node.driver_root / LIB_DIR / "libnvidia-ml.so.1").absolute()
    out = subprocess.run([sys.executable, "-c", script, str(library), str(index)], capture_output=True, text=True,
                         timeout=60, env={**os.environ, STATE_ENV: str(state_dir(node.driver_root))})
    assert out.returncode == 0, out.stderr
    current, pending = json.loads(out.stdout)
    return current, pending


async def dynamic(kube: Kube, node: Node) -> bool:
    """Whether the node runs dynamic MIG: on 1.35 counters would be dropped, so the agent publishes
    static MIG instead, and says so once (checked here)."""
    if await minor_version(kube) >= 36:
        return True

    async def reported() -> bool:
        return any([e.get("reason") == "DynamicMigUnsupported" async for e in kube.list(
            EVENT, "default", field_selector=f"involvedObject.name={node.name}")])

    await wait_for(reported, timeout=30, what="the agent's DynamicMigUnsupported Node event")
    return False


async def published(kube: Kube, node: Node) -> None:
    async def probe() -> bool:
        found = [s async for s in kube.list(SLICE, field_selector=f"spec.driver={node.driver},spec.nodeName={node.name}")]
        return sum(len(s["spec"].get("devices") or []) for s in found) == 2 * 26  # 25 placements, the whole GPU

    await wait_for(probe, timeout=60, what="every placement and the whole of both GPUs published")


async def ran(kube: Kube, node: Node, namespace: str, name: str) -> str:
    """Pod ``name`` on the node, using claim ``name``, run until it printed :data:`SCRIPT`'s output."""
    pod: Obj = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace}, "spec": {
        "nodeSelector": {"kubernetes.io/hostname": node.name}, "hostNetwork": True,
        "automountServiceAccountToken": False, "enableServiceLinks": False, "terminationGracePeriodSeconds": 1,
        "restartPolicy": "Never",
        "tolerations": [{"key": k, "operator": "Exists", "effect": "NoSchedule"}
                        for k in (TAINT, "node.kubernetes.io/not-ready")],
        "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
        "containers": [{"name": "train", "image": TEST_IMAGE, "imagePullPolicy": "Never",
                        "command": ["sh", "-c", SCRIPT], "resources": {"claims": [{"name": "gpu"}]}}]}}
    await kube.create(pod)
    _, output = await printed_output(kube, node, name, namespace, "run and print")
    print(f"[real-runtime-mig] the container's output:\n{output}")
    return output


async def test_a_pods_claim_gets_a_mig_instance_made_at_prepare_and_destroyed_at_unprepare(
        kube: Kube, namespace: str, mig_node: Node) -> None:
    node = mig_node
    if not await dynamic(kube, node):
        return

    await published(kube, node)
    attr = f'device.attributes["{node.driver}"]'
    await kube.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                       "metadata": {"name": "mig", "namespace": namespace},
                       "spec": {"devices": {"requests": [{"name": "mig", "exactly": {
                           "deviceClassName": node.driver, "selectors": [{"cel": {"expression":
                               f'{attr}.type == "mig" && {attr}.profile == "2g.20gb" && {attr}.parentIndex == 0'}}]}}]}}})
    output = await ran(kube, node, namespace, "mig")
    claim = await kube.get(CLAIM, "mig", namespace)
    assert claim is not None
    (allocated,) = claim["status"]["allocation"]["devices"]["results"]
    start = int(allocated["device"].rpartition("-at")[2])
    assert re.fullmatch(r"gpu-0-mig-2g20gb-at[024]", allocated["device"]), allocated
    gi = 3 + start // 2  # 2-slice placements are GPU instances 3..6 (the slice tree)
    assert mig_instances(node) == [(gi, 0)]

    listed = {line.rsplit(" ", 1)[-1] for line in output.splitlines() if line.startswith("c")}
    caps = {f"nvidia-cap{mig_cap_minor_fallback(0, gi, None)}", f"nvidia-cap{mig_cap_minor_fallback(0, gi, 0)}"}
    assert {p for p in listed if re.fullmatch(r"/dev/nvidia[0-9]+", p)} == {"/dev/nvidia0"}, output
    assert {p for p in listed if p.startswith("nvidia-cap")} == caps, output  # ls of /dev/nvidia-caps/
    visible = next(line for line in output.splitlines() if line.startswith("NVIDIA_VISIBLE_DEVICES="))
    assert re.fullmatch(r"NVIDIA_VISIBLE_DEVICES=MIG-[0-9a-f-]{36}", visible), visible

    await kube.delete(POD, "mig", namespace)

    async def destroyed() -> bool:
        node.runtime.kubelet.assert_running()
        return mig_instances(node) == [] and not node.spec_path(claim["metadata"]["uid"]).exists()

    try:
        await wait_for(destroyed, timeout=90, what="the kubelet to unprepare the claim and the agent to destroy its instance")
    except AssertionError as error:
        raise AssertionError(f"{error}\n{node.failure()}") from None


async def test_a_pods_claim_of_the_whole_gpu_turns_its_mig_mode_off_and_on_again(
        kube: Kube, namespace: str, mig_node: Node) -> None:
    """The whole GPU of a dynamic H100: prepare turns its MIG mode off, the container sees the GPU
    itself (its node, its UUID, no MIG capability), and the pod's end turns MIG mode on again."""
    node = mig_node
    if not await dynamic(kube, node):
        return
    await published(kube, node)
    attr = f'device.attributes["{node.driver}"]'
    await kube.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                       "metadata": {"name": "whole", "namespace": namespace},
                       "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                           "deviceClassName": node.driver, "selectors": [{"cel": {"expression":
                               f'{attr}.type == "gpu" && {attr}.index == 0'}}]}}]}}})
    output = await ran(kube, node, namespace, "whole")
    claim = await kube.get(CLAIM, "whole", namespace)
    assert claim is not None
    (allocated,) = claim["status"]["allocation"]["devices"]["results"]
    assert allocated["device"] == "gpu-0"
    assert mig_mode(node) == (0, 0) and mig_mode(node, 1) == (1, 1) and mig_instances(node) == []
    listed = {line.rsplit(" ", 1)[-1] for line in output.splitlines() if line.startswith("c")}
    assert {p for p in listed if re.fullmatch(r"/dev/nvidia[0-9]+", p)} == {"/dev/nvidia0"}, output
    assert not any(p.startswith("nvidia-cap") for p in listed), output  # no MIG capability: the GPU itself
    visible = next(line for line in output.splitlines() if line.startswith("NVIDIA_VISIBLE_DEVICES="))
    assert visible == "NVIDIA_VISIBLE_DEVICES=GPU-3f1c2a5e-8d4b-5c6e-9a7f-1b2c3d4e5f60", visible

    await kube.delete(POD, "whole", namespace)

    async def back_on() -> bool:
        node.runtime.kubelet.assert_running()
        return mig_mode(node) == (1, 1) and not node.spec_path(claim["metadata"]["uid"]).exists()

    try:
        await wait_for(back_on, timeout=90, what="the kubelet to unprepare the claim and the agent to turn MIG mode on")
    except AssertionError as error:
        raise AssertionError(f"{error}\n{node.failure()}") from None
