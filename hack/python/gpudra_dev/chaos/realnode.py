"""The chaos run's real node: containerd (CDI on) running containers with runc, and the release's
own kubelet on containerd's CRI socket, as tests/realruntime.py's ``RealRuntimeNode`` sets them up
for the real-runtime tests (one private mount namespace, nothing left on the host; that module
says how). This wraps it for the run: the pods' container and script, which show what CDI injected,
and the kubelet's restart in place (same root directory, checkpoint and plugin registry).

``RealRuntimeNode`` lives with the tests (tests/realruntime.py, tests/realkubelet.py): the chaos
run imports it from there rather than having a second way to start a kubelet and containerd, so
``tests/`` must be on the import path, as pytest and ``make chaos`` (PYTHONPATH) put it."""

from __future__ import annotations

import importlib
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from gpudra_core.kubeapi import Kube, Obj
from gpudra_dev.localcluster.processes import stop_process

TAINT = "gpudra.io/chaos-real-node"
# What a container of the workload prints, once: what CDI gave it (the GPU UUIDs in
# NVIDIA_VISIBLE_DEVICES, the GPU device nodes), then STARTED; it then sleeps until SIGTERM (the
# trap ends it at once, so a deletion does not wait out the grace period).
STARTED = "gpudra-chaos-started"
SCRIPT = ('echo "visible=${NVIDIA_VISIBLE_DEVICES:-}"; for d in /dev/nvidia*; do echo "device=$d"; done; '
          f"echo {STARTED}; trap 'exit 0' TERM; sleep 3600 & wait")
CONTAINER = "cuda"
GPU_NODE = re.compile(r"/dev/nvidia([0-9]+)")


def _tests_module(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        tests = Path(__file__).resolve().parents[4] / "tests"
        raise AssertionError(f"the chaos run's real node is tests/{name}.py's: put {tests} on PYTHONPATH "
                             "(make chaos does; pytest does for the tests)") from error


def pod_tolerations() -> list[Obj]:
    """What lets a workload pod run on the real node: its own taint, and the not-ready taint the
    kubelet registers its Node with (the node lifecycle controller that lifts it is off here)."""
    return [{"key": key, "operator": "Exists", "effect": "NoSchedule"}
            for key in (TAINT, "node.kubernetes.io/not-ready")]


def container_spec() -> Obj:
    """The workload's container: the tests' static busybox image (imported, never pulled), SCRIPT."""
    image = _tests_module("realruntime").TEST_IMAGE
    return {"name": CONTAINER, "image": image, "imagePullPolicy": "Never", "command": ["sh", "-c", SCRIPT],
            "resources": {"claims": [{"name": "gpu"}]}}


@dataclass(frozen=True)
class Injected:
    """What a container saw of its GPUs: NVIDIA_VISIBLE_DEVICES' UUIDs, the minors of /dev/nvidiaN."""
    uuids: frozenset[str]
    minors: frozenset[int]


def parse_output(output: str) -> Injected | None:
    """SCRIPT's report in a container's output; None until it has printed all of it."""
    lines = output.splitlines()
    if STARTED not in lines:
        return None
    visible = next((line.split("=", 1)[1] for line in lines if line.startswith("visible=")), "")
    minors = {int(m.group(1)) for line in lines if line.startswith("device=")
              if (m := GPU_NODE.fullmatch(line.split("=", 1)[1]))}
    return Injected(frozenset(u for u in visible.split(",") if u), frozenset(minors))


class RealNode:
    """containerd + runc + the real kubelet for Node ``name``, working in ``workdir``: the kubelet's
    root directory is ``workdir/kubelet``, containerd's CDI directory ``cdi_dir``."""

    def __init__(self, workdir: Path, *, bin_dir: Path, kubeconfig: Path, name: str, cdi_dir: Path) -> None:
        realruntime, realkubelet = _tests_module("realruntime"), _tests_module("realkubelet")
        self.runtime: Any = realruntime.RealRuntimeNode(
            workdir, kubelet_binary=realkubelet.kubelet_binary(bin_dir), kubeconfig=kubeconfig, node_name=name,
            cdi_dir=cdi_dir, taint=f"{TAINT}=:NoSchedule")
        self._read_cri_log = realruntime.read_cri_log

    @property
    def kubelet_dir(self) -> Path:
        path: Path = self.runtime.kubelet.root_dir
        return path

    def start(self) -> None:
        """containerd and the kubelet (from the calling thread: they die with it, see dying_with_parent)."""
        self.runtime.start()

    async def wait_ready(self, kube: Kube, timeout: float = 120) -> None:
        """The Node Ready, as the kubelet running now reports it."""
        try:
            await self.runtime.kubelet.wait_ready(kube, timeout=timeout)
        except AssertionError as error:
            raise AssertionError(f"{error}\n{self.describe()}") from None

    def stop_kubelet(self, sig: str) -> int:
        """The kubelet stopped by ``sig`` (SIGTERM: SIGKILLed after 20 s); its exit status."""
        process = self.runtime.kubelet.process
        assert process is not None and process.poll() is None, f"the kubelet is not running:\n{self.kubelet_log()}"
        return stop_process(process, getattr(signal, sig), timeout=20)

    def start_kubelet(self) -> None:
        """The kubelet again, on the same root directory (its checkpoints, plugin registry, pods'
        directories), config and containerd (from the calling thread, as :meth:`start`)."""
        self.runtime.kubelet.start()

    def assert_kubelet_running(self) -> None:
        self.runtime.kubelet.assert_running()

    def container_output(self, pod: Obj) -> str:
        """What the pod's container printed (the log the runtime writes in the kubelet's pod log directory)."""
        meta = pod["metadata"]
        directory = self.runtime.kubelet.pod_logs_dir / f"{meta['namespace']}_{meta['name']}_{meta['uid']}"
        text: str = self._read_cri_log(directory / CONTAINER / "0.log")
        return text

    def kubelet_log(self, lines: int = 30) -> str:
        text: str = self.runtime.kubelet.log_tail(lines)
        return text

    def describe(self) -> str:
        text: str = self.runtime.describe()
        return f"{text}\nkubelet log:\n{self.kubelet_log(40)}"

    def stop(self) -> list[str]:
        """Tear the node down (the kubelet, every sandbox, containerd, the namespace); what went
        wrong and what it left on the host (processes, mounts, cgroups)."""
        problems: list[str] = self.runtime.stop()
        leftovers: list[str] = self.runtime.leftovers()
        return [*problems, *leftovers]
