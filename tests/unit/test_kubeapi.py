"""The API client connect() builds: the environment's proxy settings are read once, not on every
request (no Kubernetes API server needed: building a client contacts nothing); every call has a
deadline, against a listener on 127.0.0.1 that accepts and never answers (a black hole); every
connection has TCP keepalive."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import yaml

from gpudra_core import kubeapi
from gpudra_core.kubeapi import Kube, connect, resource_type

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


# --- deadlines and keepalive ------------------------------------------------------------------------

NODE = resource_type("v1", "Node")
SHORT = "connect=0.5,request=0.5,watch=1,watch_silence=0.5"  # seconds: what the tests below wait for


@pytest_asyncio.fixture
async def black_hole() -> AsyncIterator[int]:
    """A TCP listener on 127.0.0.1 that accepts every connection, reads what comes, never answers."""
    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(65536):
            pass
        writer.close()

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


def black_hole_kubeconfig(tmp_path: Path, port: int, scheme: str) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": f"{scheme}://127.0.0.1:{port}", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    return str(path)


async def seconds_to_fail(call: object) -> float:
    """How long ``call`` (an awaitable) took to fail with a timeout; a test failure, not a hang,
    when it would wait on (5 s)."""
    started = time.monotonic()
    with pytest.raises(asyncio.TimeoutError):
        async with asyncio.timeout(5):
            try:
                await call  # type: ignore[misc]
            except asyncio.TimeoutError as error:
                raise error  # the call's own deadline: the outer timeout was not reached
    elapsed = time.monotonic() - started
    assert elapsed < 4.5, "no deadline: the call waited until the test gave up"
    return elapsed


@pytest.mark.parametrize("scheme, deadline", [("http", "request"), ("https", "connect")])
async def test_a_request_to_a_server_that_never_answers_fails_at_its_deadline(
        tmp_path: Path, black_hole: int, monkeypatch: pytest.MonkeyPatch, scheme: str, deadline: str) -> None:
    # http: the request goes out and no answer comes (the request deadline); https: the TLS
    # handshake never completes (the connect deadline, with the request deadline far away).
    monkeypatch.setenv("GPUDRA_API_DEADLINES", SHORT if deadline == "request" else "connect=0.5,request=30")
    api = await connect(black_hole_kubeconfig(tmp_path, black_hole, scheme))
    try:
        elapsed = await seconds_to_fail(Kube(api, "tests").get(NODE, "n"))
    finally:
        await api.close()
    assert 0.4 <= elapsed < 2


async def test_a_watch_that_goes_silent_fails_once_past_its_server_timeout(
        tmp_path: Path, black_hole: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUDRA_API_DEADLINES", SHORT)
    api = await connect(black_hole_kubeconfig(tmp_path, black_hole, "http"))

    async def follow() -> None:
        async for _ in Kube(api, "tests").watch(NODE):
            pass

    try:
        elapsed = await seconds_to_fail(follow())
    finally:
        await api.close()
    assert 1.4 <= elapsed < 3  # timeoutSeconds (1) and the silence allowed past it (0.5)


async def test_every_connection_to_the_api_server_has_tcp_keepalive(
        tmp_path: Path, black_hole: int, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[tuple[int, int, int, int]] = []  # each new socket's options, read before aiohttp closes it
    keepalive_socket = kubeapi.keepalive_socket

    def recording(addr_info: tuple[object, ...]) -> socket.socket:
        sock = keepalive_socket(addr_info)
        made.append((sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                     sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                     sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                     sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)))
        return sock

    monkeypatch.setattr(kubeapi, "keepalive_socket", recording)
    monkeypatch.setenv("GPUDRA_API_DEADLINES", SHORT)
    api = await connect(black_hole_kubeconfig(tmp_path, black_hole, "http"))
    try:
        await seconds_to_fail(Kube(api, "tests").get(NODE, "n"))
    finally:
        await api.close()
    assert made == [(1, kubeapi.KEEPALIVE_IDLE, kubeapi.KEEPALIVE_INTERVAL, kubeapi.KEEPALIVE_PROBES)], \
        "the request's connection was not made by the keepalive socket factory"


def test_the_deadlines_default_to_what_a_healthy_api_server_needs_and_the_environment_shortens_them() -> None:
    from gpudra_core.kubeapi import Deadlines

    default = Deadlines.from_environment("")
    assert (default.connect, default.request, default.watch) == (10, 30, 300)
    assert default.request < 60  # the API server's own --request-timeout: a retry comes before it would give up
    short = Deadlines.from_environment("connect=1, request=2,watch=5")
    assert (short.connect, short.request, short.watch, short.watch_silence) == (1, 2, 5, default.watch_silence)
    with pytest.raises(ValueError, match="unknown deadline 'total'"):
        Deadlines.from_environment("total=3")


@pytest.mark.parametrize("setting, key", [("request=0", "request"), ("request=-1", "request"), ("connect=0", "connect"),
                                          ("watch=0", "watch"), ("watch_silence=-0.5", "watch_silence"),
                                          ("request=inf", "request"), ("connect=nan", "connect"),
                                          ("watch=2.5", "watch"), ("request=soon", "request")])
def test_a_deadline_that_is_no_deadline_is_refused_naming_the_variable_and_the_key(setting: str, key: str) -> None:
    """aiohttp reads a total of 0 as no deadline at all: the setting fails at start, saying where."""
    from gpudra_core.kubeapi import Deadlines

    with pytest.raises(ValueError) as refused:
        Deadlines.from_environment(f"connect=1,{setting}")
    assert str(refused.value).startswith("GPUDRA_API_DEADLINES: ") and key in str(refused.value), str(refused.value)
    with pytest.raises(ValueError, match=key):
        Deadlines(**{key: 0})


def test_times_are_written_as_the_api_server_writes_them() -> None:
    from datetime import datetime, timedelta, timezone

    from gpudra_core.kubeapi import rfc3339

    when = datetime(2026, 12, 6, 1, 2, 3, 456789, timezone(timedelta(hours=2)))
    assert rfc3339(when) == "2026-12-05T23:02:03Z"  # metav1.Time: UTC, whole seconds, truncated
    assert rfc3339(when, microseconds=True) == "2026-12-05T23:02:03.456789Z"  # metav1.MicroTime
    assert rfc3339(when.replace(microsecond=0), microseconds=True) == "2026-12-05T23:02:03.000000Z"
    assert rfc3339(datetime(2026, 1, 1)) == "2026-01-01T00:00:00Z"  # naive: UTC
    assert rfc3339(when.timestamp()) == rfc3339(when.timestamp() + 0.5) == "2026-12-05T23:02:03Z"


async def test_the_operators_kopf_client_has_the_same_deadlines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kopf's own requests and watches (GpuDraConfigs, children) are bounded like ours."""
    import kopf

    from gpudra_operator.handlers import close, configure

    monkeypatch.setenv("KUBECONFIG", kubeconfig(tmp_path))
    settings, memo = kopf.OperatorSettings(), kopf.Memo()
    await configure(settings=settings, memo=memo)
    try:
        assert (settings.networking.connect_timeout, settings.networking.request_timeout) == (10, 30)
        assert (settings.watching.connect_timeout, settings.watching.server_timeout,
                settings.watching.client_timeout) == (10, 300, 330)
        assert settings.watching.inactivity_timeout <= 330
        assert memo.kube.deadlines.request == 30
    finally:
        await close(memo=memo)


async def test_responses_are_decoded_with_the_cyclic_gc_paused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A page of thousands of objects is decoded without the cyclic collector starting every 700
    of them (half the client CPU of a GC pass's listing); it is back on afterwards, also when the
    decoding fails."""
    import gc
    import json

    from kubernetes_asyncio import client

    page = {"kind": "NodeList", "metadata": {}, "items": [{"metadata": {"name": f"n{i}", "labels": {"a": "b"}}}
                                                          for i in range(3000)]}
    body = json.dumps(page).encode()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    seen: list[bool] = []
    library = client.ApiClient.deserialize

    def spy(self: client.ApiClient, response: object, response_type: object) -> object:
        seen.append(gc.isenabled())
        return library(self, response, response_type)

    monkeypatch.setattr(client.ApiClient, "deserialize", spy)
    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    api = await connect(black_hole_kubeconfig(tmp_path, server.sockets[0].getsockname()[1], "http"))
    try:
        assert gc.isenabled()
        assert [n async for n in Kube(api, "tests").list(NODE)] == page["items"]
    finally:
        await api.close()
        server.close()
    assert seen == [False] and gc.isenabled()

    with pytest.raises(RuntimeError), kubeapi.cyclic_gc_paused():
        raise RuntimeError("decoding failed")
    assert gc.isenabled()
    gc.disable()  # a process that turned it off keeps it off
    try:
        with kubeapi.cyclic_gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
