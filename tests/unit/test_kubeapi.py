"""The API client connect() builds: the environment's proxy settings are read once, not on every
request (no Kubernetes API server needed: building a client contacts nothing)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpudra_driver.kubeapi import connect

SERVER = "https://10.96.0.1:6443"


def kubeconfig(tmp_path: Path, **cluster: str) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": SERVER, "insecure-skip-tls-verify": True, **cluster}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    return str(path)


@pytest.fixture(autouse=True)
def no_proxy_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy", "ALL_PROXY",
                 "all_proxy"):
        monkeypatch.delenv(name, raising=False)


async def test_requests_do_not_consult_the_environment(tmp_path: Path) -> None:
    api = await connect(kubeconfig(tmp_path))
    try:
        assert api.rest_client.pool_manager.trust_env is False  # no per-request netrc/proxy lookups
        assert api.rest_client.proxy is None
    finally:
        await api.close()


async def test_the_environment_proxy_is_used_for_the_api_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://user:secret@proxy.example:3128")
    api = await connect(kubeconfig(tmp_path))
    try:
        assert api.rest_client.proxy == "http://proxy.example:3128"
        assert api.rest_client.proxy_headers["Proxy-Authorization"].startswith("Basic ")
    finally:
        await api.close()


async def test_no_proxy_exempts_the_api_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    monkeypatch.setenv("NO_PROXY", "10.96.0.1,.cluster.local")
    api = await connect(kubeconfig(tmp_path))
    try:
        assert api.rest_client.proxy is None
    finally:
        await api.close()


async def test_a_kubeconfig_proxy_url_wins_over_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    api = await connect(kubeconfig(tmp_path, **{"proxy-url": "http://kubeconfig-proxy.example:8080"}))
    try:
        assert api.rest_client.proxy == "http://kubeconfig-proxy.example:8080"
    finally:
        await api.close()


async def test_the_operators_kopf_client_follows_the_same_proxy_settings(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import kopf

    from gpudra_operator.handlers import close, configure

    monkeypatch.setenv("KUBECONFIG", kubeconfig(tmp_path))
    settings, memo = kopf.OperatorSettings(), kopf.Memo()
    await configure(settings=settings, memo=memo)
    try:
        assert settings.networking.trust_env is True
    finally:
        await close(memo=memo)
