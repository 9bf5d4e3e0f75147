"""`gpudra-dev demo`: the whole product on this machine, no cluster and no GPU needed.

A local control plane, three simulated GPU nodes (dgx-h100, dgx-a100-40gb, a100-80gb-mig) each
with its own agent on simulated NVML, the operator, the sample GpuDraConfig, then the seed: a claim
template asking for >= 64Gi of GPU memory and a Job using it. It plays the kubelet for the Job's
pod (prepares its claim through the agent's gRPC socket), shows what a user would check, and keeps
the cluster up until Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpudra_dev import REPO

if TYPE_CHECKING:
    from gpudra_dev.localcluster.gpucluster import LocalGpuCluster

SAMPLES = REPO / "manifests" / "samples"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="run gpudra end to end on a local cluster with simulated GPUs")
    parser.add_argument("--state-dir", type=Path, default=Path(tempfile.gettempdir()) / "gpudra-demo",
                        help="where the cluster's files live while it runs (default: %(default)s)")
    parser.add_argument("--exit", action="store_true", help="stop after the walkthrough instead of waiting for Ctrl-C")
    parser.add_argument("--down", action="store_true", help="stop a running demo (what `make demo-down` does)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from gpudra_dev.localcluster.controlplane import ControlPlaneError, find_binaries

    if args.down:
        return _down(args.state_dir / "demo.pid")
    try:
        bin_dir = find_binaries()
    except ControlPlaneError as error:
        print(f"error: {error}")
        return 2
    pid_file = args.state_dir / "demo.pid"
    args.state_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="run-", dir=args.state_dir))
    try:
        return asyncio.run(_demo(bin_dir, workdir, pid_file, args.exit))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        pid_file.unlink(missing_ok=True)
        print("[demo] stopped; every process and temporary file removed")


def _down(pid_file: Path) -> int:
    import os

    try:
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError):
        print(f"no demo running ({pid_file} not found or stale)")
        return 0
    print(f"stopping the demo (pid {pid}); it removes its processes and files")
    return 0


def step(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def show(title: str, text: str) -> None:
    print(f"\n$ {title}\n{text.rstrip()}\n", flush=True)


async def _demo(bin_dir: Path, workdir: Path, pid_file: Path, exit_after: bool) -> int:
    import os

    from gpudra_dev.localcluster.gpucluster import LocalGpuCluster
    from gpudra_dev.localcluster.seed import run_seed

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    started = time.monotonic()
    async with LocalGpuCluster(bin_dir, workdir, say=step) as cluster:
        pid_file.write_text(str(os.getpid()))
        kubectl = f"kubectl --kubeconfig {cluster.plane.kubeconfig}"
        step("applying manifests/samples/gpudraconfig.yaml")
        await cluster.apply_file(SAMPLES / "gpudraconfig.yaml")
        step("waiting for the operator: DeviceClasses applied, agent DaemonSet rolled out (Ready=True)")
        await cluster.wait_ready("default")
        step("waiting for every node's agent to publish its GPUs")
        await cluster.wait_published()
        show(f"{kubectl} get gdc", cluster.kubectl("get", "gdc"))
        show(f"{kubectl} get deviceclasses", cluster.kubectl("get", "deviceclasses"))
        show(f"{kubectl} get resourceslices -o wide", cluster.kubectl("get", "resourceslices", "-o", "wide"))

        step("applying the seed workload: ResourceClaimTemplate gpu-64gi (memory >= 64Gi) and Job train")
        result = await run_seed(cluster, SAMPLES / "seed-workload.yaml", say=step)
        show(f"{kubectl} get pods -o wide", cluster.kubectl("get", "pods", "-o", "wide"))
        show(f"{kubectl} get resourceclaims -A", cluster.kubectl("get", "resourceclaims", "-A"))
        show(f"{kubectl} get resourceclaim {result.claim_name} -o jsonpath='{{.status.allocation}}'",
             cluster.kubectl("get", "resourceclaim", result.claim_name, "-o", "jsonpath={.status.allocation}"))
        show(f"jq . {result.cdi_spec_path}  # summarised", describe_cdi_spec(json.loads(result.cdi_spec_path.read_text())))
        step(f"the pod runs on {result.node_name} with {result.device} "
             f"({result.memory} of memory, UUID {result.uuid}); the 40 GB A100 node was never a candidate")
        step("a second claim asks for 8 GPUs with >= 64Gi each: the H100 node has 7 left, so the pod stays Pending")
        show(f"gpudra explain pod default/{UNFIT} --kubeconfig {cluster.plane.kubeconfig}",
             await explain_unfit_claim(cluster))
        step(f"walkthrough done in {time.monotonic() - started:.0f}s")
        print(f"\n  export KUBECONFIG={cluster.plane.kubeconfig}\n  kubectl get gdc,deviceclasses,resourceslices\n")
        if exit_after:
            return 0
        step("the cluster stays up; Ctrl-C (or `make demo-down`) stops it")
        await stop.wait()
    return 0


UNFIT = "train-8x64gi"


async def explain_unfit_claim(cluster: LocalGpuCluster) -> str:
    """A claim for 8 GPUs of >= 64Gi and a pod using it; once the scheduler has given up on the
    pod, what `gpudra explain pod` says about it."""
    from gpudra_core.kubeapi import resource_type

    from gpudra_operator.explain import explain_live
    from gpudra_operator.explain.report import as_text
    from gpudra_dev.localcluster.waiting import wait_for

    pods = resource_type("v1", "Pod")
    selector = f'device.capacity["{cluster.driver}"].memory.compareTo(quantity("64Gi")) >= 0'
    await cluster.kube.create({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": UNFIT, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
            "deviceClassName": cluster.driver, "count": 8, "selectors": [{"cel": {"expression": selector}}]}}]}}})
    await cluster.kube.create({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": UNFIT, "namespace": "default"},
        "spec": {"resourceClaims": [{"name": "gpus", "resourceClaimName": UNFIT}],
                 "containers": [{"name": "train", "image": "nvcr.io/nvidia/cuda:12.8.1-base-ubuntu24.04",
                                 "command": ["nvidia-smi", "-L"], "resources": {"claims": [{"name": "gpus"}]}}]}})

    async def unschedulable() -> bool:
        pod = await cluster.kube.get(pods, UNFIT, "default")
        return any(c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"
                   for c in ((pod or {}).get("status") or {}).get("conditions") or [])

    await wait_for(unschedulable, timeout=60, what=f"the scheduler to give up on pod {UNFIT}")
    return as_text(await explain_live(cluster.kube, "pod", "default", UNFIT, cluster.driver))


def describe_cdi_spec(spec: dict[str, Any]) -> str:
    """A claim's CDI spec as a person reads it: each device's nodes, then what every container of
    the claim gets besides (env, control nodes, the driver files mounted, hooks)."""
    def nodes(edits: dict[str, Any]) -> str:
        return ", ".join(n["path"] + (f" (host {n['hostPath']})" if n.get("hostPath") else "")
                         for n in edits.get("deviceNodes") or [])

    lines = [f"kind {spec['kind']}, cdiVersion {spec['cdiVersion']}"]
    lines += [f"device {d['name']}: {nodes(d['containerEdits'])}" for d in spec["devices"]]
    common = spec.get("containerEdits") or {}
    lines.append("every container given the claim also gets:")
    lines.append(f"  env: {', '.join(common.get('env') or []) or 'none'}")
    lines.append(f"  control nodes: {', '.join(n['path'] for n in common.get('deviceNodes') or []) or 'none'}")
    mounts = common.get("mounts") or []
    lines.append(f"  {len(mounts)} read-only mounts of the driver's user space, among them:")
    for key in ("/libcuda.so.", "/libnvidia-ml.so.", "/nvidia-smi", "/gsp_"):
        mount = next((m for m in mounts if key in m["containerPath"]), None)
        if mount is not None:
            lines.append(f"    {mount['containerPath']} <- {mount['hostPath']}")
    hooks = [h["args"][1] for h in common.get("hooks") or [] if len(h.get("args") or []) > 1]
    lines.append(f"  hooks: {', '.join(hooks)}" if hooks else
                 "  hooks: none (no nvidia-cdi-hook on this node: libraries are mounted at their sonames too)")
    return "\n".join(lines)
