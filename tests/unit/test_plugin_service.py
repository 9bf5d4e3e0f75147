"""The plugin's gRPC surface in-process, driven the way the kubelet drives it: registration
handshake, then v1 and v1beta1 calls, over real unix sockets; claims come from a dict instead of
the API server (the integration tests use the real one)."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import grpc
import pytest
from cdispec import load_and_validate
from plugin_fixtures import DRIVER, NODE, claim, fake_root, result

from gpudra_driver.discovery import scan
from gpudra_driver.nvml.fake import FakeNvml, load_profile
from gpudra_driver import metrics
from gpudra_dev.kubelet_client import DraClient, RegistrationRefused, probe_health, register
from gpudra_driver.plugin.model import ClaimRef
from gpudra_driver.plugin.plugin import GetClaim, KubeletPlugin, socket_paths
from gpudra_driver.plugin.sockets import MAX_SOCKET_PATH, SocketAddress
from gpudra_dev.localcluster.waiting import wait_for

A = "0c1d2e3f-0000-4000-8000-00000000000a"
B = "0c1d2e3f-0000-4000-8000-00000000000b"


def make_plugin(root: Path, claims: dict, instance: str = "pod-1", get_claim: GetClaim | None = None,
                **kwargs) -> KubeletPlugin:
    """``get_claim``: an API server of the test's own, in place of ``claims``."""
    async def from_dict(namespace: str, name: str):
        value = claims.get((namespace, name))
        if isinstance(value, Exception):
            raise value
        if isinstance(value, asyncio.Event):  # an API server that never answers
            await value.wait()
        return value

    kwargs.setdefault("driver_root", fake_root())
    return KubeletPlugin(driver=DRIVER, node=NODE, kubelet_dir=root / "kubelet", cdi_dir=root / "cdi",
                         get_claim=get_claim or from_dict, instance=instance, boot_id="boot-1", **kwargs)


@pytest.fixture
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("p")



def spec_names(cdi: Path) -> list[str]:
    """The spec files in the CDI directory (the driver's device metadata directory there aside)."""
    return sorted(n for n in os.listdir(cdi) if not (cdi / n).is_dir())

async def test_registration_then_prepare_and_unprepare_over_v1_and_v1beta1(root: Path) -> None:
    claims = {("ns", "a"): claim(A, name="a", results=[result("gpu-4", request="r/sub")]),
              ("ns", "b"): claim(B, name="b", results=[result("gpu-5")])}
    plugin = make_plugin(root, claims)
    await plugin.start()
    try:
        assert not plugin.registration_socket.exists()  # no registration before discovery
        plugin.set_devices(scan(FakeNvml(load_profile("dgx-h100"))).devices)
        await plugin._register_task  # type: ignore[misc]
        registered = await register(plugin.registration_socket, driver=DRIVER)
        assert (registered.name, registered.version, registered.endpoint) == (DRIVER, "v1", str(plugin.dra_socket))
        assert list(registered.info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
        assert plugin.registration.registered.is_set()
        old_kubelet = await register(plugin.registration_socket, prefer=["v1beta1.DRAPlugin"])
        assert old_kubelet.version == "v1beta1"

        for version, (uid, name, device, request) in (("v1", (A, "a", "gpu-4", "r")),
                                                      ("v1beta1", (B, "b", "gpu-5", "gpu"))):
            async with DraClient(registered.endpoint, version) as client:
                response = await client.prepare([("ns", name, uid)])
                assert dict(response.claims).keys() == {uid}
                out = response.claims[uid]
                assert out.error == ""
                (dev,) = out.devices
                assert (list(dev.request_names), dev.pool_name, dev.device_name, list(dev.cdi_device_ids)) == (
                    [request], NODE, device, [f"k8s.{DRIVER}/claim={uid}-{device}",
                                              f"k8s.{DRIVER}/claim={uid}_{request}"])  # and its metadata
                spec = load_and_validate(root / "cdi" / f"k8s.{DRIVER}-claim_{uid}.json")
                assert [d["name"] for d in spec["devices"]] == [f"{uid}-{device}", f"{uid}_{request}"]
                if version == "v1":
                    assert not dev.HasField("share_id")
                unprepared = await client.unprepare([("ns", name, uid), ("ns", "never", "ffff")])
                assert {k: v.error for k, v in unprepared.claims.items()} == {uid: "", "ffff": ""}
        assert spec_names(root / "cdi") == []
    finally:
        await plugin.stop()
    assert not plugin.dra_socket.exists() and not plugin.registration_socket.exists()


async def test_bad_input_gets_per_claim_errors_and_the_server_keeps_serving(root: Path) -> None:
    claims = {("ns", "good"): claim(A, name="good"), ("ns", "replaced"): claim("1111", name="replaced"),
              ("ns", "pending"): claim(B, name="pending", allocated=False),
              ("ns", "boom"): RuntimeError("connection reset"), ("ns", "hung"): asyncio.Event()}
    plugin = make_plugin(root, claims, claim_get_timeout=0.5)
    await plugin.start()
    plugin.set_devices(scan(FakeNvml(load_profile("dgx-h100"))).devices)
    total, failed = metrics.PREPARE.total._value.get(), metrics.PREPARE.errors._value.get()
    try:
        async with DraClient(plugin.dra_socket, "v1beta1") as client:
            response = await client.prepare([
                ("ns", "good", A), ("ns", "missing", "2222"), ("ns", "replaced", "3333"),
                ("ns", "pending", B), ("ns", "boom", "4444"), ("ns", "../../etc", "5555"), ("ns", "x", ""),
                ("ns", "hung", "6666"),
            ])
            # Metrics count claims, not calls: 8 asked, 7 failed, 1 prepared.
            assert metrics.PREPARE.total._value.get() - total == 8
            assert metrics.PREPARE.errors._value.get() - failed == 7
            assert metrics.PREPARED_CLAIMS._value.get() == 1
            errors = {uid: r.error for uid, r in response.claims.items()}
            assert errors[A] == ""
            assert "not found" in errors["2222"] and "replaced" in errors["3333"]
            assert "not allocated" in errors[B] and "connection reset" in errors["4444"]
            assert "malformed" in errors["5555"] and "uid is required" in errors[""]
            assert "from the API server took over 0.5s" in errors["6666"]
            assert len(response.claims) == 8
            # The server is still there and still exact.
            again = await client.prepare([("ns", "good", A)])
            assert again.claims[A].devices[0].device_name == "gpu-3"
        assert sorted(os.listdir(root)) == ["cdi", "kubelet"]
        assert spec_names(root / "cdi") == [f"k8s.{DRIVER}-claim_{A}.json"]
    finally:
        await plugin.stop()


async def test_only_stale_sockets_are_removed_at_start(root: Path) -> None:
    plugin_dir = root / "kubelet" / "plugins" / DRIVER
    registry = root / "kubelet" / "plugins_registry"
    plugin_dir.mkdir(parents=True)
    registry.mkdir(parents=True)
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(plugin_dir / "dra-dead.sock"))
    dead.close()  # the file stays, nobody listens: what SIGKILL leaves behind
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(registry / f"{DRIVER}-live-reg.sock"))
    live.listen()
    foreign = socket.socket(socket.AF_UNIX)
    foreign.bind(str(registry / "other.example.com-x-reg.sock"))
    foreign.close()
    plugin = make_plugin(root, {})
    await plugin.start()
    try:
        assert not (plugin_dir / "dra-dead.sock").exists()
        assert (registry / f"{DRIVER}-live-reg.sock").exists()  # another live instance (rolling update)
        assert (registry / "other.example.com-x-reg.sock").exists()  # not ours
    finally:
        await plugin.stop()
        live.close()


async def test_a_refused_registration_is_recorded() -> None:
    from gpudra_driver.plugin.gen import pluginregistration_pb2 as pb
    from gpudra_driver.plugin.registration import RegistrationServicer

    servicer = RegistrationServicer(DRIVER, "/x.sock")

    class Context:
        async def abort(self, code, details):
            raise grpc.RpcError(details)

    with pytest.raises(grpc.RpcError):
        await servicer.NotifyRegistrationStatus(pb.RegistrationStatus(plugin_registered=False, error="no"), Context())
    assert servicer.error == "no" and not servicer.registered.is_set()


def test_long_socket_paths_are_hashed_to_fit(tmp_path: Path) -> None:
    deep = Path("/k") / ("d" * 20)
    dra, reg = socket_paths(deep, "a-rather-long-driver-name.example.com", "0c1d2e3f-0000-4000-8000-00000000000a")
    assert len(os.fsencode(dra)) <= MAX_SOCKET_PATH and len(os.fsencode(reg)) <= MAX_SOCKET_PATH
    assert reg.name.startswith("gpudra-") and reg.name.endswith("-reg.sock")
    with pytest.raises(ValueError, match="too long"):
        SocketAddress(tmp_path / ("s" * 100))


async def test_a_kubelet_dir_too_deep_for_socket_addresses_still_works(root: Path) -> None:
    deep = root / ("d" * 60) / ("e" * 60)
    plugin = make_plugin(deep, {("ns", "a"): claim(A, name="a")}, instance=A)
    assert len(os.fsencode(plugin.dra_socket)) > MAX_SOCKET_PATH
    await plugin.start()
    plugin.set_devices(scan(FakeNvml(load_profile("dgx-h100"))).devices)
    try:
        await plugin._register_task  # type: ignore[misc]
        assert plugin.dra_socket.is_socket() and plugin.registration_socket.is_socket()
        registered = await register(plugin.registration_socket)
        async with DraClient(registered.endpoint) as client:
            assert (await client.prepare([("ns", "a", A)])).claims[A].error == ""
    finally:
        await plugin.stop()
    assert not plugin.dra_socket.exists()


async def test_a_shared_device_is_answered_with_its_share_id_over_v1_only(root: Path) -> None:
    """Consumable capacity: the kubelet's v1 Device.share_id (field 5) carries the allocation's
    shareID; v1beta1 has no such field, and its answer is otherwise the same."""
    claims = {("ns", name): claim(uid, name=name, results=[result("gpu-2", shareID=f"share-{name}",
                                                                  consumedCapacity={"memory": "8Gi"})])
              for uid, name in ((A, "a"), (B, "b"))}
    plugin = make_plugin(root, claims)
    await plugin.start()
    try:
        plugin.set_devices(scan(FakeNvml(load_profile("dgx-h100"))).devices)
        for version, uid, name in (("v1", A, "a"), ("v1beta1", B, "b")):
            async with DraClient(plugin.dra_socket, version) as client:
                (dev,) = (await client.prepare([("ns", name, uid)])).claims[uid].devices
                assert dev.device_name == "gpu-2"
                if version == "v1":
                    assert dev.share_id == "share-a"
                else:
                    assert "share_id" not in type(dev).DESCRIPTOR.fields_by_name
        assert plugin.state.checkpoint.load().completed_count() == 2  # both shares of gpu-2 held
    finally:
        await plugin.stop()


async def test_kubelet_refuses_a_plugin_without_common_versions(root: Path) -> None:
    plugin = make_plugin(root, {}, api_versions=("v1",))
    await plugin.start()
    plugin.set_devices([])
    try:
        await plugin._register_task  # type: ignore[misc]
        with pytest.raises(RegistrationRefused, match="none of services supported"):
            await register(plugin.registration_socket, prefer=["v1beta1.DRAPlugin"])
        assert plugin.registration.error and "none of services" in plugin.registration.error
    finally:
        await plugin.stop()


async def test_each_claim_is_read_as_its_get_returns_while_the_others_are_in_flight(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call of two claims whose second GET answers only once the first claim has been read:
    the first is read while the second is in flight (not after both), and both are prepared."""
    a_read = asyncio.Event()
    bodies = {"a": claim(A, name="a", results=[result("gpu-4")]), "b": claim(B, name="b", results=[result("gpu-5")])}

    async def get_claim(namespace: str, name: str):  # type: ignore[no-untyped-def]
        if name == "b":
            await a_read.wait()
        return bodies[name]

    # read only after both GETs, B's would time out waiting
    plugin = make_plugin(root, {}, get_claim=get_claim, claim_get_timeout=2)
    read = plugin.state.read

    def reading(ref, fetched):  # type: ignore[no-untyped-def]
        if ref.uid == A:
            a_read.set()
        return read(ref, fetched)

    monkeypatch.setattr(plugin.state, "read", reading)
    await plugin.start()
    plugin.set_devices(scan(FakeNvml(load_profile("dgx-h100"))).devices)
    try:
        async with asyncio.timeout(10):
            results = await plugin.prepare([ClaimRef("ns", "a", A), ClaimRef("ns", "b", B)])
        assert {uid: r.error for uid, r in results.items()} == {A: None, B: None}
        assert sorted(d.device for r in results.values() for d in r.claim.devices) == ["gpu-4", "gpu-5"]
    finally:
        await plugin.stop()


async def test_concurrent_calls_each_change_the_state_alone_and_all_land(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight pods starting at once: their claim GETs overlap, their state changes never do, and
    every claim ends up in the checkpoint with its own spec."""
    import asyncio

    from contextlib import asynccontextmanager

    from gpudra_driver.plugin import calllocks
    from gpudra_driver.plugin import checkpoint as ckpt

    uids = [f"0c1d2e3f-0000-4000-8000-00000000001{i}" for i in range(8)]
    claims = {("ns", f"c{i}"): claim(uid, name=f"c{i}", results=[result(f"gpu-{i}")]) for i, uid in enumerate(uids)}
    plugin = make_plugin(root, claims)
    await plugin.start()
    plugin.set_devices(scan(FakeNvml(load_profile("dgx-h100"))).devices)
    inside, most_inside = 0, 0
    real_node_lock = calllocks.node_lock_async

    @asynccontextmanager
    async def counting(*args):  # type: ignore[no-untyped-def]
        """The node lock, counting its holders: a call changes the node's state only inside it."""
        nonlocal inside, most_inside
        async with real_node_lock(*args):
            inside += 1
            most_inside = max(most_inside, inside)
            try:
                yield
            finally:
                inside -= 1

    monkeypatch.setattr(calllocks, "node_lock_async", counting)
    try:
        async with DraClient(plugin.dra_socket) as client:
            responses = await asyncio.gather(*(client.prepare([("ns", f"c{i}", uid)]) for i, uid in enumerate(uids)))
        assert all(r.claims[uid].error == "" for r, uid in zip(responses, uids))
        assert [r.claims[uid].devices[0].device_name for r, uid in zip(responses, uids)] == [f"gpu-{i}" for i in range(8)]
        assert most_inside == 1
        assert ckpt.load(plugin.state.checkpoint_path, "boot-1")[0].completed_count() == 8
        assert len(spec_names(root / "cdi")) == 8
    finally:
        await plugin.stop()


async def test_watch_raises_when_the_registration_socket_cannot_be_served(
        root: Path, caplog: pytest.LogCaptureFixture) -> None:
    import shutil

    plugin = make_plugin(root, {})
    await plugin.start()
    try:
        watching = asyncio.ensure_future(plugin.watch())
        done, _ = await asyncio.wait({watching}, timeout=0.2)  # a watch that returned early would be done
        assert not done  # waiting for discovery, then serving
        shutil.rmtree(plugin.registry_dir)
        plugin.registry_dir.write_text("not a directory")  # nothing can listen in there
        plugin.set_devices(scan(FakeNvml(load_profile("dgx-h100"))).devices)
        with pytest.raises(OSError, match="cannot listen on unix socket"):
            await asyncio.wait_for(watching, 10)
        assert any("registration socket could not be served" in r.getMessage() for r in caplog.records)
    finally:
        await plugin.stop()


async def test_liveness_follows_the_sockets_the_kubelet_dials(root: Path) -> None:
    from grpc_health.v1 import health_pb2

    from gpudra_driver.plugin import liveness as health
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    plugin = make_plugin(root, {})
    await plugin.start()
    server, port = await health.serve(0, plugin)
    try:
        # Waiting for discovery (NVML may be down for long): alive, so never restarted for it.
        assert not plugin.registration_served
        assert await probe_health(port) == serving and await probe_health(port, "") == serving
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await probe_health(port, "readiness")
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

        plugin.set_devices(scan(FakeNvml(load_profile("dgx-h100"))).devices)
        await plugin._register_task  # type: ignore[misc]
        assert plugin.registration_served and await probe_health(port) == serving

        # Its registration socket removed from under it (the kubelet deregisters the plugin): a
        # restart is the way back, though the server behind the old file still runs.
        plugin.registration_socket.unlink()
        assert await probe_health(port) == not_serving
        problem = await health.liveness_problem(plugin) or ""
        assert "registration socket" in problem and "is gone" in problem
        # a file there again, but nothing of ours behind it: the dial itself fails
        deaf = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            deaf.bind(str(plugin.registration_socket))
            problem = await health.liveness_problem(plugin) or ""
            assert "registration socket" in problem and "does not answer" in problem
        finally:
            deaf.close()
    finally:
        await server.stop(0)
        await plugin.stop()


async def test_liveness_fails_when_the_dra_socket_is_gone_or_deaf(root: Path) -> None:
    from gpudra_driver.plugin import liveness as health
    plugin = make_plugin(root, {})
    await plugin.start()
    # the kubelet's own connection, open all along: it outlives the file, a new dial does not
    kubelet = DraClient(plugin.dra_socket)
    try:
        assert await health.liveness_problem(plugin) is None
        await kubelet.prepare([])
        plugin.dra_socket.unlink()
        assert "is gone" in (await health.liveness_problem(plugin) or "")
        # a socket file nobody accepts on (bound, never listening): the kubelet's dial is refused
        deaf = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            deaf.bind(str(plugin.dra_socket))
            problem = await health.liveness_problem(plugin, timeout=5)
            assert problem is not None and "does not answer" in problem
            await kubelet.prepare([])  # still connected to the server behind the old file
        finally:
            deaf.close()
    finally:
        await kubelet.close()
        await plugin.stop()


async def test_liveness_does_not_wait_for_the_node_lock(root: Path) -> None:
    """A peer instance holding the node lock (a long prepare in a rolling update) must not get this
    one restarted: the check's empty prepare takes no round and no lock."""
    from gpudra_driver.plugin import liveness as health
    from gpudra_driver.plugin.locking import LOCK_FILE, node_lock

    plugin = make_plugin(root, {})
    await plugin.start()
    try:
        with node_lock(root / "kubelet" / "plugins" / DRIVER / LOCK_FILE, timeout=1):
            assert await health.liveness_problem(plugin, timeout=2) is None
    finally:
        await plugin.stop()


async def test_liveness_fails_when_a_socket_accepts_but_never_answers(root: Path) -> None:
    """A server that takes connections and says nothing (a wedged peer behind the file): the
    check gives up after its timeout instead of hanging the probe."""
    from gpudra_driver.plugin import liveness as health
    plugin = make_plugin(root, {})
    await plugin.start()
    try:
        plugin.dra_socket.unlink()
        silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            silent.bind(str(plugin.dra_socket))
            silent.listen()  # the kernel completes connections; nobody reads or writes
            problem = await asyncio.wait_for(health.liveness_problem(plugin, timeout=0.5), 10)
            assert problem is not None and "does not answer" in problem and "Deadline" in problem
        finally:
            silent.close()
    finally:
        await plugin.stop()


async def test_liveness_fails_when_a_call_is_stuck_under_the_node_lock(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call that has held the node lock longer than any call may (a hung disk): the sockets still
    answer the check's empty call, but no prepare would ever be answered again."""
    from gpudra_driver.plugin import liveness as health
    plugin = make_plugin(root, {})
    await plugin.start()
    try:
        assert plugin.busy_for() == 0 and await health.liveness_problem(plugin) is None
        monkeypatch.setattr(plugin.state.locks, "busy_since", time.monotonic() - health.CALL_STUCK_AFTER - 5)
        problem = await health.liveness_problem(plugin)
        assert problem is not None and "is not done" in problem
    finally:
        monkeypatch.undo()
        await plugin.stop()


async def test_concurrent_checks_share_one_and_a_failure_is_logged_once(
        root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The health port is open to the pod network: a burst of checks costs one check, and a
    failing one does not flood the log."""
    from grpc_health.v1 import health_pb2

    from gpudra_driver.plugin import liveness as health
    calls = 0
    release = asyncio.Event()

    async def slow_problem(plugin: object, timeout: float = 1.0) -> str | None:
        nonlocal calls
        calls += 1
        await release.wait()
        return "the DRA socket is gone"

    monkeypatch.setattr(health, "liveness_problem", slow_problem)
    plugin = make_plugin(root, {})
    server, port = await health.serve(0, plugin)
    servicer = health.LivenessServicer(plugin)
    request = health_pb2.HealthCheckRequest(service="liveness")
    try:
        # Three calls scheduled together all reach the shared check before it starts (asyncio
        # runs ready tasks in order): once it has started, all three are waiting on it.
        checks = [asyncio.ensure_future(servicer.Check(request, None)) for _ in range(3)]

        async def started() -> bool:
            return calls == 1

        await wait_for(started, timeout=10, what="the shared check to start")
        assert not any(c.done() for c in checks)
        release.set()
        assert [r.status for r in await asyncio.gather(*checks)] == [health_pb2.HealthCheckResponse.NOT_SERVING] * 3
        assert calls == 1
        # over the wire, after it: a check of its own, the same reason (not logged again)
        assert await probe_health(port) == health_pb2.HealthCheckResponse.NOT_SERVING and calls == 2
        assert await servicer.Check(request, None) and calls == 3
        failures = [r for r in caplog.records if "liveness check failed" in r.getMessage()]
        assert len(failures) == 2  # the same reason three times in each servicer: logged once by each
    finally:
        await server.stop(0)

