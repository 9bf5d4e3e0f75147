"""The Helm chart as a release ships it: packaged and pushed by the release's own make targets
(``make chart-package chart-push``, hack/chart.sh) to the test registry (tests/localregistry.py), and
helm pointed at it the way a user is (``helm install gpudra oci://<registry>/charts/gpudra --version V``).

    from chartregistry import push_chart
    chart = push_chart(registry)                       # or push_chart(registry, version="0.0.9")
    chart.helm("install", "gpudra", chart.ref, *chart.flags, "--kube-version", ...)   # or:
    subprocess.run([helm_binary(), "install", "gpudra", chart.ref, *chart.flags], env={**os.environ, **chart.env})

``flags`` hold ``--version`` and the registry's CA (``--ca-file``); ``env`` holds helm's homes (its
registry config and cache) in the registry's work directory, so that nothing lands in ~."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from cachedtool import REPO, cached_dir
from localregistry import LocalRegistry

CHART = REPO / "manifests" / "helm" / "gpudra"
FIX = ("make helm-bin (builds helm from the Go module proxy into ~/.cache/gpudra/helm/<version>; "
       "or set GPUDRA_HELM to a helm binary, as make test does)")


def helm_binary() -> str:
    """$GPUDRA_HELM (as make test sets it), else hack/helm-bin.sh's cache of its pinned version."""
    given = os.environ.get("GPUDRA_HELM")
    if given:
        if not os.access(given, os.X_OK):
            raise AssertionError(f"$GPUDRA_HELM={given} is not an executable: {FIX}")
        return given
    binary = cached_dir("helm-bin.sh", "HELM_VERSION", "helm") / "helm"
    if not os.access(binary, os.X_OK):
        raise AssertionError(f"$GPUDRA_HELM is unset and the cache has no {binary}: {FIX}")
    return str(binary)


def helm_homes(directory: Path) -> dict[str, str]:
    """Helm's config, cache and data homes (the registry config, pulled charts) in ``directory``."""
    homes = {"HELM_CONFIG_HOME": directory / "config", "HELM_CACHE_HOME": directory / "cache",
             "HELM_DATA_HOME": directory / "data"}
    for path in homes.values():
        path.mkdir(parents=True, exist_ok=True)
    return {name: str(path) for name, path in homes.items()}


@dataclass(frozen=True)
class PushedChart:
    ref: str  # oci://localhost:<port>/charts/gpudra: what helm install/pull/show/template take
    version: str  # the chart's version in the registry (the tag)
    digest: str  # sha256:...: the OCI manifest's digest, as helm push printed it
    package: Path  # the .tgz that was pushed
    flags: tuple[str, ...]  # --version <version> --ca-file <the registry's CA>
    env: dict[str, str] = field(default_factory=dict)  # helm's homes; add to os.environ

    @property
    def package_sha256(self) -> str:
        return hashlib.sha256(self.package.read_bytes()).hexdigest()

    def helm(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """helm <args> with this chart's env (not checked: look at returncode)."""
        return subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **self.env})


def push_chart(registry: LocalRegistry, version: str | None = None, *, app_version: str | None = None,
               path: str = "charts") -> PushedChart:
    """``make chart-push`` of the chart at ``version`` (default: Chart.yaml's; appVersion Chart.yaml's
    unless ``app_version``) to ``oci://<registry>/<path>``; the chart is then at ``<that>/gpudra``.
    Fails with helm's output if packaging or pushing fails."""
    version = version or chart_yaml_version()
    workdir = registry.workdir / "chart" / version
    env = helm_homes(workdir / "helm")
    ca_flags = ("--ca-file", str(registry.ca))
    command = ["make", "--no-print-directory", "-C", str(REPO), "chart-push",
               f"CHART_VERSION={version}", f"CHART_OUT={workdir / 'package'}",
               f"CHART_REGISTRY=oci://{registry.host}/{path}", f"CHART_PUSH_FLAGS={' '.join(ca_flags)}",
               *([f"CHART_APP_VERSION={app_version}"] if app_version else [])]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600,
                            env={**os.environ, **env, "GPUDRA_HELM": helm_binary()})
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{' '.join(command)} failed ({result.returncode}):\n{output}"
    digest = re.search(r"^Digest: (sha256:[0-9a-f]{64})$", output, re.MULTILINE)
    assert digest, f"helm push printed no digest:\n{output}"
    return PushedChart(ref=f"oci://{registry.host}/{path}/gpudra", version=version, digest=digest.group(1),
                       package=workdir / "package" / f"gpudra-{version}.tgz",
                       flags=("--version", version, *ca_flags), env=env)


def chart_yaml_version() -> str:
    match = re.search(r"^version: *(\S+)$", (CHART / "Chart.yaml").read_text(), re.MULTILINE)
    assert match, f"{CHART / 'Chart.yaml'} has no version"
    return match.group(1)
