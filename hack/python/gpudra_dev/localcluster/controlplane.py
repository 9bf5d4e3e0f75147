"""Start and stop etcd, kube-apiserver, kube-controller-manager and kube-scheduler as local
processes on free loopback ports, the way envtest and kwokctl's binary runtime do."""

from __future__ import annotations

import os
import random
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .pki import CertPair, LocalPKI
from .processes import dying_with_parent
from .scratch import ScratchDir, in_memory_or

HOST = "127.0.0.1"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
# What the tests and the demo need: claims from templates, DaemonSet/Job pods, GC through owners,
# the type checking of ValidatingAdmissionPolicies (status.typeChecking, asserted by test_install).
CONTROLLERS = (
    "namespace-controller",
    "garbage-collector-controller",
    "daemonset-controller",
    "deployment-controller",
    "replicaset-controller",
    "job-controller",
    "resourceclaim-controller",
    "serviceaccount-controller",
    "root-ca-certificate-publisher-controller",
    "validatingadmissionpolicy-status-controller",
)
FIX_HINT = "run `make kube-bin` and export GPUDRA_KUBE_BIN=<the directory it prints last> (`make test` does both)"


class ControlPlaneError(RuntimeError):
    """The control plane could not be found, started or reached; the message says how to fix it."""


def find_binaries() -> Path:
    """The directory holding all control-plane binaries: $GPUDRA_KUBE_BIN, else $KUBEBUILDER_ASSETS."""
    for var in ("GPUDRA_KUBE_BIN", "KUBEBUILDER_ASSETS"):
        value = os.environ.get(var)
        if not value:
            continue
        directory = Path(value)
        missing = [b for b in BINARIES if not os.access(directory / b, os.X_OK)]
        if missing:
            raise ControlPlaneError(f"${var}={value} lacks {', '.join(missing)}: {FIX_HINT}")
        return directory
    raise ControlPlaneError(f"no control-plane binaries configured: {FIX_HINT}")


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: a port the kernel picked would be
    its next choice for someone's outgoing connection too, and a process started later to listen
    on it (on every address) can then find it taken."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(100):
        port = random.randrange(10000, max(low, 10001))
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _stop_group(process: subprocess.Popen[bytes] | None, sig: int, grace: float) -> None:
    """Send ``sig`` to the process group of ``process`` (if it runs), SIGKILL it after ``grace`` seconds."""
    if process is None or process.poll() is not None:
        return
    try:
        os.killpg(process.pid, sig)
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


def _is_ok(answer: str) -> bool:
    """A health endpoint's answer says healthy (etcd answers JSON, the others "ok")."""
    return answer.strip() in ("ok", '{"health":"true","reason":""}') or '"health":"true"' in answer


@dataclass
class Component:
    name: str
    argv: list[str]
    health_url: str
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])


@dataclass
class ControlPlane:
    """One local cluster. ``start()`` returns once every component reports healthy."""

    bin_dir: Path
    workdir: Path
    components: list[Component] = field(default_factory=list)
    # Benchmarks count API requests exactly from the apiserver's audit log (Metadata level, one
    # line per request at ResponseComplete); off by default, tests do not pay for it.
    audit_log: bool = False
    # A bench that writes a DaemonSet's status itself (a fleet's rollout) runs without the
    # DaemonSet controller, which would write it back.
    controllers: tuple[str, ...] = CONTROLLERS
    # e.g. ("DRAConsumableCapacity=true",): given to the API server, the scheduler and the
    # controller manager alike, as a cluster enabling an alpha feature does.
    feature_gates: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.pki_dir = self.workdir / "pki"
        self.kubeconfig = self.workdir / "admin.kubeconfig"
        self.etcd_port, self.etcd_peer_port = free_port(), free_port()
        self.apiserver_port = free_port()
        self.server = f"https://{HOST}:{self.apiserver_port}"
        self.audit_log_path = self.workdir / "logs" / "audit.log"

    # --- configuration -----------------------------------------------------------------------
    def user_kubeconfig(self, path: Path, user: str, *, groups: tuple[str, ...] = ("system:masters",),
                        server: str | None = None) -> Path:
        """A kubeconfig for a user of its own (a client certificate), so the audit log tells its
        requests apart; ``server`` to reach the API server another way (a proxy on loopback)."""
        return self._write_kubeconfig(path, user, self.pki.issue(f"user-{user}", user, organizations=groups),
                                      server=server)

    def _write_kubeconfig(self, path: Path, user: str, client: CertPair, server: str | None = None) -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "gpudra-local", "cluster": {
                "server": server or self.server, "certificate-authority": str(self.pki.ca.cert)}}],
            "users": [{"name": user, "user": {
                "client-certificate": str(client.cert), "client-key": str(client.key)}}],
            "contexts": [{"name": "gpudra-local", "context": {"cluster": "gpudra-local", "user": user}}],
            "current-context": "gpudra-local",
        }
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path

    def _prepare(self) -> None:
        self.pki = LocalPKI(self.pki_dir)
        serving = self.pki.issue("apiserver", "kube-apiserver", server=True,
                                 dns_names=("localhost", "kubernetes", "kubernetes.default",
                                            "kubernetes.default.svc"), ips=(HOST, "10.0.0.1"))
        admin = self.pki.issue("admin", "gpudra-admin", organizations=("system:masters",))
        kcm = self.pki.issue("kcm", "system:kube-controller-manager", organizations=("system:masters",))
        sched = self.pki.issue("scheduler", "system:kube-scheduler", organizations=("system:masters",))
        sa_key = self.pki.service_account_key()
        self._write_kubeconfig(self.kubeconfig, "admin", admin)
        kcm_kubeconfig = self._write_kubeconfig(self.workdir / "kcm.kubeconfig", "kcm", kcm)
        sched_kubeconfig = self._write_kubeconfig(self.workdir / "scheduler.kubeconfig", "scheduler", sched)

        # etcd's data is throwaway: keep it in memory when /dev/shm exists (see .scratch).
        self.etcd_scratch = ScratchDir("gpudra-etcd-", in_memory_or(self.workdir))
        self.etcd_dir = self.etcd_scratch.path / "data"
        bins = self.bin_dir
        kcm_port, sched_port = free_port(), free_port()
        logs = self.workdir / "logs"
        logs.mkdir(exist_ok=True)
        etcd_url = f"http://{HOST}:{self.etcd_port}"
        peer_url = f"http://{HOST}:{self.etcd_peer_port}"
        self.components = [
            Component("etcd", [
                str(bins / "etcd"), "--name=gpudra", f"--data-dir={self.etcd_dir}",
                f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=gpudra={peer_url}", "--unsafe-no-fsync=true", "--log-level=warn",
            ], f"{etcd_url}/health", logs / "etcd.log"),
            Component("kube-apiserver", [
                str(bins / "kube-apiserver"), f"--etcd-servers={etcd_url}",
                f"--bind-address={HOST}", f"--advertise-address={HOST}",
                f"--secure-port={self.apiserver_port}",
                f"--tls-cert-file={serving.cert}", f"--tls-private-key-file={serving.key}",
                f"--client-ca-file={self.pki.ca.cert}",
                "--authorization-mode=Node,RBAC",
                f"--service-account-issuer={self.server}",
                f"--service-account-key-file={sa_key}", f"--service-account-signing-key-file={sa_key}",
                "--service-cluster-ip-range=10.0.0.0/24", "--endpoint-reconciler-type=none",
                "--allow-privileged=true", f"--cert-dir={self.workdir / 'apiserver'}",
                "--v=1", *self._audit_args(), *self._gate_args(),
            ], f"{self.server}/readyz", logs / "kube-apiserver.log"),
            Component("kube-controller-manager", [
                str(bins / "kube-controller-manager"), f"--kubeconfig={kcm_kubeconfig}",
                f"--authentication-kubeconfig={kcm_kubeconfig}",
                f"--authorization-kubeconfig={kcm_kubeconfig}",
                "--leader-elect=false", f"--controllers={','.join(self.controllers)}",
                f"--bind-address={HOST}", f"--secure-port={kcm_port}",
                f"--cert-dir={self.workdir / 'kcm'}", f"--root-ca-file={self.pki.ca.cert}",
                "--use-service-account-credentials=false", "--kube-api-qps=200", "--kube-api-burst=400",
                "--concurrent-gc-syncs=5", "--v=1", *self._gate_args(),
            ], f"https://{HOST}:{kcm_port}/healthz", logs / "kube-controller-manager.log"),
            Component("kube-scheduler", [
                str(bins / "kube-scheduler"), f"--kubeconfig={sched_kubeconfig}",
                f"--authentication-kubeconfig={sched_kubeconfig}",
                f"--authorization-kubeconfig={sched_kubeconfig}",
                "--leader-elect=false", f"--bind-address={HOST}", f"--secure-port={sched_port}",
                f"--cert-dir={self.workdir / 'scheduler'}", "--v=1", *self._gate_args(),
            ], f"https://{HOST}:{sched_port}/healthz", logs / "kube-scheduler.log"),
        ]

    def _gate_args(self) -> list[str]:
        return [f"--feature-gates={','.join(self.feature_gates)}"] if self.feature_gates else []

    def _audit_args(self) -> list[str]:
        if not self.audit_log:
            return []
        policy = self.workdir / "audit-policy.yaml"
        policy.write_text(yaml.safe_dump({"apiVersion": "audit.k8s.io/v1", "kind": "Policy",
                                          "omitStages": ["RequestReceived", "ResponseStarted"],
                                          "rules": [{"level": "Metadata"}]}))
        return [f"--audit-policy-file={policy}", f"--audit-log-path={self.audit_log_path}",
                "--audit-log-mode=blocking", "--audit-log-maxsize=0"]

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self, timeout: float = 120.0) -> None:
        self._prepare()
        deadline = time.monotonic() + timeout
        try:
            for component in self.components:
                self._spawn(component)
                # The apiserver needs etcd; the controllers need the apiserver. Wait in order.
                if component.name in ("etcd", "kube-apiserver"):
                    self._wait_healthy(component, deadline)
            for component in self.components[2:]:
                self._wait_healthy(component, deadline)
        except BaseException:
            self.stop()
            raise

    def _spawn(self, component: Component) -> None:
        log = component.log_path.open("ab")
        component.process = subprocess.Popen(
            dying_with_parent(component.argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # own process group: stop() kills it and its children by PID
        )
        log.close()

    def component(self, name: str) -> Component:
        return next(c for c in self.components if c.name == name)

    def stop_component(self, name: str, sig: int = signal.SIGTERM, grace: float = 30.0) -> None:
        """Stop component ``name`` with ``sig`` (SIGKILL after ``grace`` seconds), keeping what
        :meth:`start_component` needs to start it again in place: its arguments, ports and data
        (etcd's directory stays), as a static pod's restart does. Blocks: call it in a thread."""
        _stop_group(self.component(name).process, sig, grace)

    def start_component(self, name: str) -> int:
        """Start component ``name`` again (after :meth:`stop_component`); its PID. Returns at once:
        :meth:`healthy` says when it serves. Call it from a thread that outlives the component
        (see dying_with_parent), e.g. the main thread."""
        component = self.component(name)
        self._spawn(component)
        assert component.process is not None
        return component.process.pid

    def healthy(self, name: str) -> bool:
        """Whether component ``name`` runs and its health endpoint answers ok (one probe)."""
        component = self.component(name)
        if component.process is None or component.process.poll() is not None:
            return False
        return _is_ok(self._probe(component))

    def _ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.pki.ca.cert))
        admin = self.pki_dir / "admin"
        context.load_cert_chain(f"{admin}.crt", f"{admin}.key")
        return context

    def _probe(self, component: Component) -> str:
        context: ssl.SSLContext | None = None
        if component.health_url.startswith("https://"):
            if component.name == "kube-apiserver":
                context = self._ssl_context()
            else:  # the controller-manager and scheduler serve self-signed certs on loopback
                context = ssl._create_unverified_context()  # noqa: S323 - health probe only
        try:
            with urllib.request.urlopen(component.health_url, timeout=2, context=context) as response:
                return response.read().decode(errors="replace")
        except (urllib.error.URLError, OSError) as error:
            return f"not ready: {error}"

    def _wait_healthy(self, component: Component, deadline: float) -> None:
        last = ""
        while time.monotonic() < deadline:
            assert component.process is not None
            if component.process.poll() is not None:
                raise ControlPlaneError(self._failure(
                    f"{component.name} exited with code {component.process.returncode}"))
            last = self._probe(component)
            if _is_ok(last):
                return
            time.sleep(0.2)  # polling interval of a health endpoint, not synchronisation by delay
        raise ControlPlaneError(self._failure(f"{component.name} not healthy before the deadline: {last}"))

    def _failure(self, headline: str) -> str:
        parts = [headline, f"binaries: {self.bin_dir}"]
        for component in self.components:
            parts.append(f"--- {component.name} log tail ({component.log_path}) ---\n{component.log_tail()}")
        return "\n".join(parts)

    def stop(self, grace: float = 10.0) -> None:
        """Stop every process this object started, newest first, by process group ID."""
        for component in reversed(self.components):
            _stop_group(component.process, signal.SIGTERM, grace)
        if getattr(self, "etcd_scratch", None):
            self.etcd_scratch.remove()

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run the control plane's own kubectl against it (what a user would type)."""
        return subprocess.run(
            [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
            check=check, capture_output=True, text=True, input=input, timeout=timeout,
        )

