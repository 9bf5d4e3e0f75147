"""A real kubelet (the release's own binary, built with the control plane by hack/kube-bin.sh) as a
subprocess, on the fake container runtime of ``fakecri``: its plugin watcher registers the agent's
kubelet plugin, its DRA manager calls NodePrepareResources/NodeUnprepareResources, and its pod
workers pass the CDI device IDs to the runtime, as on a GPU node.

The kubelet runs as root, as on a node, but leaves the host as it found it:

* in a mount namespace of its own (``unshare``), so the bind mount it puts on its root directory
  goes away with it, and with empty tmpfs over ``/var/lib`` and ``/var/log``, where it creates
  directories whatever its root directory (``/var/lib/kubelet/device-plugins``,
  ``/var/log/containers``);
* with the kernel settings it insists on (``vm.overcommit_memory=1``, ``kernel.panic_on_oops=1``
  and four more) shown to it, in that namespace, by files bind-mounted over ``/proc/sys``, and
  ``protectKernelDefaults`` on: it reads them, finds nothing to change, and never writes the
  host's (a test must not make a developer's machine panic on an oops);
* with its flexvolume plugin directory, pod logs and certificates in its root directory, no
  cgroups per QoS class, no node-allocatable enforcement, no eviction, no iptables chains, no
  read-only or healthz port;
* killed with the process that started it (``setpriv --pdeathsig``), so a test run killed
  outright leaves no kubelet behind.

With ``namespace_of`` (a PID), the kubelet joins that process's mount namespace instead (``nsenter``),
set up the same way by whoever started that process: a real container runtime must share it, since
runc has to see the kubelet's mounts (tests/realruntime.py)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import yaml

from gpudra_core.kubeapi import Kube, Obj, resource_type
from gpudra_dev.localcluster.controlplane import free_port
from gpudra_dev.localcluster.processes import dying_with_parent, stop_process
from gpudra_dev.localcluster.waiting import wait_for

NODE = resource_type("v1", "Node")
FIX_HINT = "make kube-bin (builds the kubelet with the control plane; then set GPUDRA_KUBE_BIN as make test does)"
# What the kubelet's setupKernelTunables wants (k8s.io/component-helpers/node/util/sysctl).
KUBELET_SYSCTLS = {"vm/overcommit_memory": 1, "vm/panic_on_oom": 0, "kernel/panic": 10, "kernel/panic_on_oops": 1,
                   "kernel/keys/root_maxkeys": 1000000, "kernel/keys/root_maxbytes": 25000000}


def kubelet_binary(bin_dir: Path) -> Path:
    binary = bin_dir / "kubelet"
    if not os.access(binary, os.X_OK):
        raise AssertionError(f"no kubelet in {bin_dir}: {FIX_HINT}")
    return binary


def isolation_problem() -> str | None:
    """Why the kubelet cannot run here as these tests run it, or None."""
    if os.geteuid() != 0:
        return "the real-kubelet tests run the kubelet as root, as on a node: run `make test` as root (CI does)"
    missing = [tool for tool in ("unshare", "mount", "setpriv") if shutil.which(tool) is None]
    if missing:
        return f"the real-kubelet tests need util-linux's {', '.join(missing)}"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return (f"cannot make a mount namespace for the kubelet (unshare --mount: {probe.stderr.strip()}); "
                "needs CAP_SYS_ADMIN")
    return None


def node_ready(node: Obj | None) -> bool:
    conditions = ((node or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


class RealKubelet:
    def __init__(self, binary: Path, root_dir: Path, *, kubeconfig: Path, node_name: str,
                 runtime_endpoint: str, taint: str, namespace_of: int | None = None) -> None:
        self.binary, self.root_dir, self.node_name = binary, root_dir, node_name
        self.namespace_of = namespace_of  # a process whose mount namespace it joins, or None: its own
        self.kubeconfig, self.runtime_endpoint, self.taint = kubeconfig, runtime_endpoint, taint
        self.log_path = root_dir.parent / f"kubelet-{node_name}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0  # of the running kubelet's API; new on every start

    @property
    def pod_logs_dir(self) -> Path:
        return self.root_dir / "pod-logs"

    def config(self) -> dict[str, object]:
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "address": "127.0.0.1", "port": self.port, "readOnlyPort": 0, "healthzPort": 0,
            "containerRuntimeEndpoint": self.runtime_endpoint,
            "cgroupDriver": "cgroupfs", "cgroupsPerQOS": False, "enforceNodeAllocatable": [],
            "failSwapOn": False, "failCgroupV1": False, "localStorageCapacityIsolation": False,
            "evictionHard": {"memory.available": "0%", "nodefs.available": "0%", "imagefs.available": "0%"},
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "makeIPTablesUtilChains": False, "protectKernelDefaults": True, "resolvConf": "",
            "podLogsDir": str(self.pod_logs_dir), "volumePluginDir": str(self.root_dir / "volume-plugins"),
            # Faster than a node's defaults, so the tests' waits are short: status every 2 s,
            # pod resync every 5 s.
            "nodeStatusUpdateFrequency": "2s", "syncFrequency": "5s",
        }

    def start(self) -> RealKubelet:
        if problem := isolation_problem():
            raise AssertionError(problem)
        self.root_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        config = self.root_dir.parent / f"kubelet-{self.node_name}.yaml"
        config.write_text(yaml.safe_dump(self.config()))
        kubelet = [str(self.binary), f"--config={config}", f"--kubeconfig={self.kubeconfig}",
                   f"--root-dir={self.root_dir}", f"--cert-dir={self.root_dir / 'pki'}",
                   f"--hostname-override={self.node_name}", f"--register-with-taints={self.taint}", "--v=2"]
        if self.namespace_of is None:
            argv = dying_with_parent(["unshare", "--mount", "--propagation", "private", "--",
                                      "sh", "-ec", self._masked_sysctls() + "exec " + shlex.join(kubelet)])
        else:
            argv = dying_with_parent(["nsenter", "-t", str(self.namespace_of), "-m", "--", *kubelet])
        with self.log_path.open("ab") as log:
            # Its own directory as the working directory: a kubelet resolves some paths against it.
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            cwd=self.root_dir)
        return self

    def _masked_sysctls(self) -> str:
        """Shell lines that set up the kubelet's mount namespace (see the module docstring)."""
        masks = self.root_dir.parent / f"sysctl-{self.node_name}"
        masks.mkdir(exist_ok=True)
        lines = ["mount -t tmpfs gpudra-kubelet /var/lib\n", "mount -t tmpfs gpudra-kubelet /var/log\n"]
        for name, value in KUBELET_SYSCTLS.items():
            mask = masks / name.replace("/", ".")
            mask.write_text(f"{value}\n")
            lines.append(f"mount --bind {shlex.quote(str(mask))} /proc/sys/{name}\n")
        return "".join(lines)

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def assert_running(self) -> None:
        assert self.process is not None and self.process.poll() is None, \
            f"the kubelet exited ({self.process and self.process.returncode}):\n{self.log_tail()}"

    async def wait_ready(self, kube: Kube, timeout: float = 90) -> Obj:
        """The Node Ready as reported by the kubelet running now: after a restart, the Node is
        still Ready from the last one until the new one writes its status (its port is new)."""
        async def ready() -> Obj | None:
            self.assert_running()
            node = await kube.get(NODE, self.node_name)
            endpoint = ((node or {}).get("status") or {}).get("daemonEndpoints", {}).get("kubeletEndpoint", {})
            return node if node_ready(node) and endpoint.get("Port") == self.port else None

        return await wait_for(ready, timeout=timeout, what=f"the real kubelet to report Node {self.node_name} Ready")

    def stop(self, timeout: float = 20) -> None:
        if self.process is not None:
            stop_process(self.process, timeout=timeout)
