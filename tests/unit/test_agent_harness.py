"""The local harness starts agents with the DaemonSet's process settings; its CA comes from the
kubeconfig's current cluster."""

from __future__ import annotations

from pathlib import Path

import yaml

from gpudra_dev.localcluster.agents import kubeconfig_ca_file


def kubeconfig(tmp_path: Path, cluster: dict, current: str = "local") -> Path:
    path = tmp_path / "kube" / "config"
    path.parent.mkdir(parents=True)
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": current,
        "clusters": [{"name": "c-local", "cluster": cluster},
                     {"name": "c-other", "cluster": {"server": "https://x", "certificate-authority": "/other.crt"}}],
        "contexts": [{"name": "local", "context": {"cluster": "c-local", "user": "u"}},
                     {"name": "other", "context": {"cluster": "c-other", "user": "u"}}],
        "users": [{"name": "u", "user": {}}]}))
    return path


def test_the_current_clusters_ca_file_relative_to_the_kubeconfig(tmp_path: Path) -> None:
    path = kubeconfig(tmp_path, {"server": "https://127.0.0.1:6443", "certificate-authority": "pki/ca.crt"})
    assert kubeconfig_ca_file(path) == str(tmp_path / "kube" / "pki" / "ca.crt")
    assert kubeconfig_ca_file(kubeconfig(tmp_path / "b", {}, current="other")) == "/other.crt"


def test_an_embedded_ca_gives_no_file(tmp_path: Path) -> None:
    path = kubeconfig(tmp_path, {"server": "https://127.0.0.1:6443", "certificate-authority-data": "LS0t"})
    assert kubeconfig_ca_file(path) is None
