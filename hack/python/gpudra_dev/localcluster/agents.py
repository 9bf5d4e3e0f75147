"""Node agents as local subprocesses, one per fake Node: what a DaemonSet pod would run on a real
GPU node, minus the container.

Each agent gets a fake driver root of its own (:mod:`gpudra_dev.localcluster.fakedriverroot`):
the driver's files and real device nodes its CDI specs point at. ``nvml="mock:<profile>"`` runs
the agent as on a GPU node, ``--nvml real`` loading the root's mock ``libnvidia-ml.so.1`` through
the real pynvml; ``nvml="fake:<profile>"`` keeps the Python simulator (fault injection, profiles
edited while the agent runs) for discovery, with the same root for its CDI specs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from gpudra_dev.localcluster.fakedriverroot import make_driver_root, make_pci_sysfs
from gpudra_dev.localcluster.processes import dying_with_parent, stop_process
from gpudra_operator.render import AGENT_PROCESS_ENV

# The agent's memory budget, VmRSS as deployed (docs/agent.md, "Footprint")
AGENT_RSS_BUDGET_MIB = 100


@dataclass
class AgentProcess:
    node_name: str
    log_path: Path
    process: subprocess.Popen[bytes]

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def rss_mib(self) -> float:
        """The process's resident memory (VmRSS) now, in MiB."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError(f"no VmRSS for pid {self.process.pid}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        return stop_process(self.process, sig, timeout)


MOCK_PREFIX = "mock:"


def start_agent(*, kubeconfig: Path, node_name: str, nvml: str, driver: str, workdir: Path,
                extra_args: tuple[str, ...] = (), rescan_interval: float = 60.0,
                cdi_dir: Path | None = None, kubelet_dir: Path | None = None,
                driver_root: Path | None = None, sysfs: Path | None = None,
                env: Mapping[str, str | None] | None = None) -> AgentProcess:
    """Start ``gpudra agent`` for ``node_name``; its kubelet and CDI directories and its driver
    root live in ``workdir`` (elsewhere when given: a real kubelet's root directory, a CDI
    directory shared by agents, a driver root made by the caller). ``env`` changes the process
    environment last (None removes a variable), e.g. to weigh one of the DaemonSet's settings."""
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "agent.log"
    profile = nvml.split(":", 1)[1] if nvml.startswith((MOCK_PREFIX, "fake:")) else None
    if driver_root is None and profile is not None:
        driver_root = make_driver_root(workdir / "driver-root", profile)
    if sysfs is None and profile is not None:  # the node's GPUs on its PCI bus, as on a GPU node
        sysfs = make_pci_sysfs(workdir / "sys", profile)
    agent_nvml = "real" if nvml.startswith(MOCK_PREFIX) else nvml
    argv = [sys.executable, "-m", "gpudra.cli", "agent", "--driver", driver,
            "--node-name", node_name, "--nvml", agent_nvml, "--kubeconfig", str(kubeconfig),
            *(["--driver-root", str(driver_root)] if driver_root is not None else []),
            *(["--sysfs", str(sysfs)] if sysfs is not None else []),
            "--rescan-interval", str(rescan_interval),
            "--kubelet-dir", str(kubelet_dir or workdir / "kubelet"), "--cdi-dir", str(cdi_dir or workdir / "cdi"), *extra_args]
    process_env = {**os.environ, **daemonset_process_env(kubeconfig_ca_file(kubeconfig)), "PYTHONUNBUFFERED": "1"}
    for name, value in (env or {}).items():
        if value is None:
            process_env.pop(name, None)
        else:
            process_env[name] = value
    with log_path.open("ab") as log:
        process = subprocess.Popen(dying_with_parent(argv), stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=process_env)
    return AgentProcess(node_name, log_path, process)


def daemonset_process_env(ca_file: str | None = None) -> dict[str, str]:
    """The DaemonSet's process settings (``render.AGENT_PROCESS_ENV``) for a process of this
    machine: ``ca_file`` (the local cluster's) in place of the ServiceAccount's CA, left out when
    None."""
    env = {k: v for k, v in AGENT_PROCESS_ENV.items() if k != "SSL_CERT_FILE"}
    if ca_file is not None and "SSL_CERT_FILE" in AGENT_PROCESS_ENV:
        env["SSL_CERT_FILE"] = ca_file
    return env


def kubeconfig_ca_file(kubeconfig: Path) -> str | None:
    """The CA file of the kubeconfig's current cluster (None when it embeds the CA or has none)."""
    config = yaml.safe_load(kubeconfig.read_text()) or {}
    contexts = {c["name"]: c.get("context") or {} for c in config.get("contexts") or []}
    clusters = {c["name"]: c.get("cluster") or {} for c in config.get("clusters") or []}
    cluster = clusters.get(contexts.get(config.get("current-context"), {}).get("cluster"), {})
    ca = cluster.get("certificate-authority")
    return str((kubeconfig.parent / ca).resolve()) if ca else None


def start_mps_supervisor(*, plugin_dir: Path, driver_root: Path, workdir: Path,
                         extra_args: tuple[str, ...] = ()) -> AgentProcess:
    """The MPS supervisor of one node (what the gpudra-mps DaemonSet runs), for the agent whose
    kubelet plugin directory is ``plugin_dir``. Its daemons are sessions of their own: they outlive
    it, as they outlive the agent (stop them with mockstate.kill_mps_daemons)."""
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "mps-supervisor.log"
    argv = [sys.executable, "-m", "gpudra.cli", "mps-supervisor", "--plugin-dir", str(plugin_dir),
            "--driver-root", str(driver_root), *extra_args]
    process_env = {**os.environ, **daemonset_process_env()}  # it talks to no API server: no CA to set
    with log_path.open("ab") as log:
        process = subprocess.Popen(dying_with_parent(argv), stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=process_env)
    return AgentProcess("mps-supervisor", log_path, process)
