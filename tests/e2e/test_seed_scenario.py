"""The seed scenario end to end, headless, on the same path as `make demo`: simulated GPU nodes
with their agents, the operator, the sample GpuDraConfig, the seed's claim template and Job from
manifests/samples unchanged, the real scheduler's allocation, the claim prepared through the agent's
kubelet plugin socket into a CDI spec valid against the official CDI schema, then unprepared."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import yaml
from cdispec import validate_claim_spec
from nodestate import checkpoint_states

from gpudra_core.kubeapi import Obj, resource_type
from gpudra_dev.kubelet_client import DraClient, register
from gpudra_dev.localcluster.controlplane import find_binaries
from gpudra_dev.localcluster.gpucluster import DEMO_NODES, LocalGpuCluster
from gpudra_dev.localcluster.seed import published_device, run_seed
from gpudra_dev.localcluster.waiting import wait_for
from gpudra_driver.plugin.cdi import metadata_dir

SAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "samples"
POD = resource_type("v1", "Pod")
GiB = 1024**3
UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def to_bytes(quantity: str) -> int:
    suffix = quantity[-2:]
    return int(quantity[:-2]) * UNITS[suffix] if suffix in UNITS else int(quantity)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def gpu_cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalGpuCluster]:
    async with LocalGpuCluster(find_binaries(), tmp_path_factory.mktemp("seed"),
                               say=lambda m: print(f"[e2e] {m}")) as cluster:
        await cluster.apply_file(SAMPLES / "gpudraconfig.yaml")
        await cluster.wait_ready("default")
        await cluster.wait_published()
        yield cluster


async def test_seed_job_lands_on_a_64gi_gpu_is_prepared_and_unprepared(gpu_cluster: LocalGpuCluster) -> None:
    result = await run_seed(gpu_cluster, SAMPLES / "seed-workload.yaml", say=lambda m: print(f"[e2e] {m}"))
    # run_seed returns right after NodePrepareResources (and the pod start): the spec, validated now.
    uid, node, driver = result.claim["metadata"]["uid"], result.node_name, gpu_cluster.driver
    spec = validate_claim_spec(gpu_cluster.cdi_dir(node), uid, result.cdi_device_ids)
    # Like a kubelet, the pod starts only after its claim was prepared.
    assert result.pod["status"]["phase"] == "Pending"
    running = await gpu_cluster.kube.get(POD, result.pod["metadata"]["name"], "default")
    assert running["status"]["phase"] == "Running"
    assert result.node_name == "gpu-h100-0"  # the only node whose GPUs have >= 64Gi
    assert next(n.profile for n in DEMO_NODES if n.name == node) == "dgx-h100"
    assert result.node_name != "gpu-a100-40g-0"
    assert to_bytes(result.memory) >= 64 * GiB
    (allocated,) = result.claim["status"]["allocation"]["devices"]["results"]
    assert (allocated["driver"], allocated["pool"], allocated["device"]) == (
        "gpu.gpudra.io", "gpu-h100-0", result.device)

    # The spec names that GPU's own device node and UUID, and nothing of another GPU.
    minor = (await published_device(gpu_cluster, node, result.device))["attributes"]["minor"]["int"]
    assert spec["kind"] == "k8s.gpu.gpudra.io/claim"
    # the GPU's own, and its request's device metadata mount (docs/kubelet-plugin.md#device-metadata)
    assert result.cdi_device_ids == [f"k8s.gpu.gpudra.io/claim={uid}-{result.device}",
                                     f"k8s.gpu.gpudra.io/claim={uid}_gpu"]
    root = gpu_cluster.agent_workdir(node) / "driver-root"  # the agent's fake driver root (mock NVML)
    assert spec["devices"][0] == {"name": f"{uid}-{result.device}", "containerEdits": {"deviceNodes": [
        {"path": f"/dev/nvidia{minor}", "hostPath": f"{root}/dev/nvidia{minor}"}]}}
    assert [d["name"] for d in spec["devices"][1:]] == [f"{uid}_gpu"]
    assert result.uuid.startswith("GPU-")
    assert spec["containerEdits"]["env"] == [f"NVIDIA_VISIBLE_DEVICES={result.uuid}",
                                             "NVIDIA_CTK_LIBCUDA_DIR=/usr/lib/x86_64-linux-gnu"]
    # CUDA user space from the driver root: what the published driverVersion names, nothing else
    version = (await published_device(gpu_cluster, node, result.device))["attributes"]["driverVersion"]["version"]
    mounts = {m["containerPath"]: m["hostPath"] for m in spec["containerEdits"]["mounts"]}
    for library in ("libcuda.so", "libnvidia-ml.so"):
        path = f"/usr/lib/x86_64-linux-gnu/{library}.{version}"
        assert mounts[path] == f"{root}{path}"
    assert mounts["/usr/bin/nvidia-smi"] == f"{root}/usr/bin/nvidia-smi"
    kubelet_dir = gpu_cluster.agent_workdir(node) / "kubelet"
    assert checkpoint_states(kubelet_dir, driver) == {uid: "PrepareCompleted"}
    # What the README tells users to run shows the same allocation.
    described = gpu_cluster.kubectl("get", "resourceclaim", result.claim_name, "-o",
                                    "jsonpath={.status.allocation.devices.results[0].device}")
    assert described.strip() == result.device

    # NodeUnprepareResources, as the kubelet calls it once the pod is gone: spec and checkpoint entry go.
    registered = await register(gpu_cluster.registration_socket(node), driver=driver)
    async with DraClient(registered.endpoint, registered.version) as kubelet:
        unprepared = await kubelet.unprepare([("default", result.claim_name, uid)])
    assert unprepared.claims[uid].error == ""
    cdi = gpu_cluster.cdi_dir(node)  # nothing left but the (now empty) directory of device metadata files
    assert not result.cdi_spec_path.exists() and [p.name for p in cdi.iterdir()] == [metadata_dir(cdi, driver).name]
    assert not list(metadata_dir(cdi, driver).iterdir())
    assert checkpoint_states(kubelet_dir, driver) == {}


async def test_too_big_a_request_stays_pending_and_the_troubleshooting_shows_why(
        gpu_cluster: LocalGpuCluster, tmp_path: Path) -> None:
    docs = list(yaml.safe_load_all((SAMPLES / "seed-workload.yaml").read_text()))
    template, job = docs
    template["metadata"]["name"] = "gpu-1ti"
    selector = template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"][0]["cel"]
    selector["expression"] = selector["expression"].replace('quantity("64Gi")', 'quantity("1Ti")')
    job["metadata"]["name"] = "too-big"
    job["spec"]["template"]["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] = "gpu-1ti"
    manifest = tmp_path / "too-big.yaml"
    manifest.write_text(yaml.safe_dump_all([template, job]))
    await gpu_cluster.apply_file(manifest)

    async def unschedulable() -> Obj | None:
        pods = [p async for p in gpu_cluster.kube.list(POD, "default", label_selector="job-name=too-big")]
        for pod in pods:
            for condition in (pod.get("status") or {}).get("conditions") or []:
                if condition["type"] == "PodScheduled" and condition.get("reason") == "Unschedulable":
                    return pod
        return None

    pod = await wait_for(unschedulable, timeout=60, what="the too-big pod to be reported Unschedulable")
    name = pod["metadata"]["name"]
    assert not pod["spec"].get("nodeName")
    # The README's troubleshooting steps, in order: `gpudra explain` first, which says why at once.
    explained = subprocess.run(
        [sys.executable, "-m", "gpudra.cli", "explain", "pod", f"default/{name}",
         "--kubeconfig", str(gpu_cluster.plane.kubeconfig)], capture_output=True, text=True, timeout=60, check=False)
    assert explained.returncode == 0, explained.stderr
    conclusion = explained.stdout.splitlines()[-1]
    assert conclusion.startswith("no node can satisfy request gpu: 19 devices match the class, 0 pass request gpu #0 "
                                 '`device.capacity["gpu.gpudra.io"].memory.compareTo(quantity("1Ti")) >= 0`'), conclusion
    assert "(largest: 81559Mi on gpu-h100-0/gpu-" in conclusion, conclusion
    assert "Pending" in gpu_cluster.kubectl("get", "pod", name)
    described = gpu_cluster.kubectl("describe", "pod", name)
    assert "FailedScheduling" in described and "cannot allocate all claims" in described, described
    claims = gpu_cluster.kubectl("get", "resourceclaims", "-n", "default")
    assert "pending" in claims, claims
    assert "gpu.gpudra.io" in gpu_cluster.kubectl("get", "deviceclass", "gpu.gpudra.io")
    capacities = gpu_cluster.kubectl("get", "resourceslices", "-o",
                                     "jsonpath={range .items[*].spec.devices[*]}{.capacity.memory.value}{\"\\n\"}{end}")
    largest = max(to_bytes(q) for q in capacities.split())
    assert largest < 1024 * GiB  # no published device is big enough: that is why
