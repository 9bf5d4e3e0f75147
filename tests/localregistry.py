"""A container image registry on this machine: CNCF Distribution's ``registry`` (the program behind
the registry:2/3 images; built by hack/registry-bin.sh) serving HTTPS on a free loopback port, with
a certificate for ``localhost`` and 127.0.0.1 from a test CA, storing into a directory of its own.

Clients trust it as they would a registry with a public certificate: podman through
``SSL_CERT_FILE`` (:meth:`LocalRegistry.client_env`), containerd through a ``hosts.toml`` naming
the CA (:meth:`LocalRegistry.containerd_hosts`). Nothing in it is reachable from another machine."""

from __future__ import annotations

import os
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml
from cachedtool import tool_dir

from gpudra_dev.localcluster.controlplane import free_port
from gpudra_dev.localcluster.pki import LocalPKI
from gpudra_dev.localcluster.processes import dying_with_parent, stop_process

REPO = Path(__file__).resolve().parent.parent
FIX = ("make registry (builds CNCF Distribution's registry from the Go module proxy into "
       "~/.cache/gpudra/registry/<version>; then set GPUDRA_REGISTRY_DIR to the directory it prints, as make test does)")


def registry_binary() -> Path:
    """$GPUDRA_REGISTRY_DIR/registry (as make test sets it), else hack/registry-bin.sh's cache."""
    directory, where = tool_dir("GPUDRA_REGISTRY_DIR", "registry-bin.sh", "REGISTRY_VERSION", "registry")
    binary = directory / "registry"
    if not os.access(binary, os.X_OK):
        raise AssertionError(f"{where} has no registry binary: {FIX}")
    return binary


class LocalRegistry:
    def __init__(self, workdir: Path, pki: LocalPKI) -> None:
        self.workdir, self.pki = workdir, pki
        self.binary = registry_binary()
        self.port = free_port()
        self.host = f"localhost:{self.port}"  # what image references name
        self.ca = pki.ca.cert
        self.log_path = workdir / "registry.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30) -> LocalRegistry:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cert = self.pki.issue("registry", "localhost", dns_names=("localhost",), ips=("127.0.0.1",), server=True)
        config = {"version": 0.1, "log": {"level": "warn", "accesslog": {"disabled": True}},
                  "storage": {"filesystem": {"rootdirectory": str(self.workdir / "storage")}},
                  "http": {"addr": f"127.0.0.1:{self.port}", "secret": "gpudra-tests",
                           "tls": {"certificate": str(cert.cert), "key": str(cert.key)}}}
        config_path = self.workdir / "registry.yaml"
        config_path.write_text(yaml.safe_dump(config))
        with self.log_path.open("ab") as log:
            # Distribution 3 exports OpenTelemetry traces to localhost:4318 unless told not to.
            self.process = subprocess.Popen(dying_with_parent([str(self.binary), "serve", str(config_path)]),
                                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env={**os.environ, "OTEL_TRACES_EXPORTER": "none"})
        context = ssl.create_default_context(cafile=str(self.ca))
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"the registry exited ({self.process.returncode}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"https://{self.host}/v2/", context=context, timeout=5) as answer:
                    if answer.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"the registry did not answer on https://{self.host}/v2/ in {timeout} s:\n"
                                     f"{self.log_tail()}")
            time.sleep(0.1)

    def client_env(self) -> dict[str, str]:
        """What makes a Go client (podman, skopeo) trust this registry's certificate."""
        return {"SSL_CERT_FILE": str(self.ca)}

    def containerd_hosts(self) -> dict[str, str]:
        """hosts.toml for containerd's registry ``config_path``: directory name -> content."""
        return {self.host: f'server = "https://{self.host}"\n'
                           f'[host."https://{self.host}"]\n'
                           f'  capabilities = ["pull", "resolve"]\n'
                           f'  ca = "{self.ca}"\n'}

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, timeout=10)
