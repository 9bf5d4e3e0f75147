"""The chart as the release ships it: `make chart-package chart-push` (tests/chartregistry.py) into
a real OCI registry (CNCF Distribution over HTTPS, tests/localregistry.py), then read back the way a
user does (helm pull / show / template oci://...). Needs helm (make helm-bin) and the registry
(make registry); make test passes both. No cluster."""

from __future__ import annotations

import hashlib
import json
import os
import ssl
import subprocess
import tarfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from chartregistry import CHART, PushedChart, chart_yaml_version, helm_binary, push_chart
from localregistry import LocalRegistry

from gpudra_dev.localcluster.controlplane import ControlPlane
from gpudra_dev.localcluster.pki import LocalPKI

REPO = Path(__file__).resolve().parents[2]
KUBE_VERSION = "v1.35.4"
HELM_CHART_LAYER = "application/vnd.cncf.helm.chart.content.v1.tar+gzip"
HELM_CONFIG = "application/vnd.cncf.helm.config.v1+json"


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRegistry]:
    workdir = tmp_path_factory.mktemp("chart-oci")
    registry = LocalRegistry(workdir / "registry", LocalPKI(workdir / "pki")).start()
    try:
        yield registry
    finally:
        registry.stop()


@pytest.fixture(scope="module")
def pushed(registry: LocalRegistry) -> PushedChart:
    return push_chart(registry)


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"{' '.join(map(str, result.args))} failed:\n{result.stdout}{result.stderr}"
    return result.stdout


def objects(rendered: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(rendered) if d]


def registry_get(registry: LocalRegistry, path: str, accept: str) -> bytes:
    request = urllib.request.Request(f"https://{registry.host}/v2/{path}", headers={"Accept": accept})
    with urllib.request.urlopen(request, context=ssl.create_default_context(cafile=str(registry.ca)),
                                timeout=30) as answer:
        return bytes(answer.read())


def test_the_pushed_artifact_is_the_packaged_chart(registry: LocalRegistry, pushed: PushedChart) -> None:
    """In the registry: an OCI manifest with the digest helm push printed, whose chart layer is the
    .tgz make chart-package wrote, byte for byte, with Helm's config media type."""
    assert pushed.version == chart_yaml_version()
    manifest_bytes = registry_get(registry, f"charts/gpudra/manifests/{pushed.version}",
                                  "application/vnd.oci.image.manifest.v1+json")
    assert "sha256:" + hashlib.sha256(manifest_bytes).hexdigest() == pushed.digest
    manifest = json.loads(manifest_bytes)
    assert manifest["config"]["mediaType"] == HELM_CONFIG
    (layer,) = manifest["layers"]
    assert layer["mediaType"] == HELM_CHART_LAYER
    assert layer["digest"] == "sha256:" + pushed.package_sha256
    blob = registry_get(registry, f"charts/gpudra/blobs/{layer['digest']}", "*/*")
    assert blob == pushed.package.read_bytes()


def test_helm_pull_show_and_template_from_the_registry(pushed: PushedChart, tmp_path: Path) -> None:
    """What a user runs against the release's registry gets this chart: every file of
    manifests/helm/gpudra (values.schema.json too), its Chart.yaml and values, the same objects."""
    pulled = pushed.helm("pull", pushed.ref, *pushed.flags, "--destination", str(tmp_path))
    ok(pulled)
    assert f"Digest: {pushed.digest}" in pulled.stderr  # where helm prints it
    tgz = tmp_path / f"gpudra-{pushed.version}.tgz"
    assert hashlib.sha256(tgz.read_bytes()).hexdigest() == pushed.package_sha256
    with tarfile.open(tgz) as archive:
        inside = {m.name.removeprefix("gpudra/"): archive.extractfile(m).read()  # type: ignore[union-attr]
                  for m in archive.getmembers() if m.isfile()}
    files = {str(p.relative_to(CHART)): p.read_bytes() for p in CHART.rglob("*") if p.is_file()}
    assert "values.schema.json" in inside
    assert {name: content for name, content in inside.items() if name != "Chart.yaml"} == \
        {name: content for name, content in files.items() if name != "Chart.yaml"}
    assert yaml.safe_load(inside["Chart.yaml"]) == yaml.safe_load(files["Chart.yaml"])  # helm package rewrites it

    shown = yaml.safe_load(ok(pushed.helm("show", "chart", pushed.ref, *pushed.flags)))
    assert shown == yaml.safe_load((CHART / "Chart.yaml").read_text())
    shown_values = ok(pushed.helm("show", "values", pushed.ref, *pushed.flags))
    assert shown_values.rstrip("\n") == (CHART / "values.yaml").read_text().rstrip("\n")  # helm adds a newline

    remote = ok(pushed.helm("template", "gpudra", pushed.ref, *pushed.flags, "--kube-version", KUBE_VERSION))
    local = ok(pushed.helm("template", "gpudra", str(CHART), "--kube-version", KUBE_VERSION))
    assert objects(remote) == objects(local) and len(objects(remote)) > 20


def test_the_schema_travels_with_the_chart(pushed: PushedChart) -> None:
    """A render from the registry refuses a bad value as the source tree does, naming it."""
    result = pushed.helm("template", "gpudra", pushed.ref, *pushed.flags, "--kube-version", KUBE_VERSION,
                         "--set", "operator.replicas=0")
    assert result.returncode != 0 and "'/operator/replicas'" in result.stderr, result.stdout + result.stderr


@pytest.mark.cluster
def test_helm_install_from_the_registry(pushed: PushedChart, cluster: ControlPlane) -> None:
    """helm install oci://... as a user runs it (--dry-run=client: the shared control plane keeps
    nothing): the values checked against the schema, the release rendered from the pulled chart."""
    # Without the CRD: the session's other tests share one that no release owns, which helm would
    # refuse to adopt.
    install = ["install", "gpudra-oci-check", pushed.ref, *pushed.flags, "--dry-run=client",
               "--kubeconfig", str(cluster.kubeconfig), "--namespace", "default", "--set", "crds.enabled=false"]
    refused = pushed.helm(*install, "--set", "operator.logFormat=xml")
    assert refused.returncode != 0 and "'/operator/logFormat'" in refused.stderr, refused.stdout + refused.stderr
    installed = ok(pushed.helm(*install))
    assert "STATUS: pending-install" in installed
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert f"image: ghcr.io/gpudra/gpudra-operator:{app_version}" in installed


def test_a_second_version_lands_beside_the_first(registry: LocalRegistry, pushed: PushedChart) -> None:
    """push_chart(version=...) as the upgrade tests use it: an older version beside the current one,
    each pulled by its --version; without one, helm takes the highest."""
    older = push_chart(registry, version="0.0.1-test.1", app_version="0.0.1")
    assert older.ref == pushed.ref and older.digest != pushed.digest
    assert yaml.safe_load(ok(older.helm("show", "chart", older.ref, *older.flags)))["appVersion"] == "0.0.1"
    assert yaml.safe_load(ok(pushed.helm("show", "chart", pushed.ref, *pushed.flags)))["version"] == pushed.version
    latest = yaml.safe_load(ok(pushed.helm("show", "chart", pushed.ref, "--ca-file", str(registry.ca))))
    assert latest["version"] == pushed.version


def test_chart_push_wants_an_oci_registry() -> None:
    result = subprocess.run(["make", "--no-print-directory", "-C", str(REPO), "chart-push", "CHART_REGISTRY=ghcr.io/gpudra"],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "GPUDRA_HELM": helm_binary()})
    assert result.returncode != 0
    assert "CHART_REGISTRY must name an OCI registry path" in result.stderr and "ghcr.io/gpudra" in result.stderr
