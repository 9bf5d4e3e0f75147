"""The metrics both components export: names, what moves them, and the /metrics endpoint."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from gpudra_driver import metrics as agent_metrics
from gpudra_operator import metrics as operator_metrics
from gpudra_dev.localcluster.controlplane import free_port
from gpudra_operator.reconcile import Outcome


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class FakeReconciler:
    @operator_metrics.reconciles
    async def _reconcile(self, body, outcome: Outcome | BaseException):
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def body(name: str) -> dict:
    return {"metadata": {"name": name}}


async def test_reconcile_results_counts_and_time() -> None:
    before = {r: value("gpudra_reconcile_total", result=r) for r in operator_metrics.RESULTS}
    errors, timed = value("gpudra_reconcile_errors_total"), value("gpudra_reconcile_time_seconds_count")
    reconciler = FakeReconciler()
    assert (await reconciler._reconcile(body("a"), Outcome())).conflicts == []
    await reconciler._reconcile(body("a"), Outcome(conflicts=["driver taken"]))
    await reconciler._reconcile(body("a"), Outcome(render_errors=["boom"]))
    with pytest.raises(RuntimeError):
        await reconciler._reconcile(body("a"), RuntimeError("API down"))
    with pytest.raises(asyncio.CancelledError):  # shutdown is not a result
        await reconciler._reconcile(body("a"), asyncio.CancelledError())
    after = {r: value("gpudra_reconcile_total", result=r) for r in operator_metrics.RESULTS}
    assert {r: after[r] - before[r] for r in after} == {"success": 1, "degraded": 2, "error": 1}
    assert value("gpudra_reconcile_errors_total") - errors == 1
    assert value("gpudra_reconcile_time_seconds_count") - timed == 4
    assert value("gpudra_last_successful_reconcile_timestamp_seconds", config="a") > 0


def test_agents_gauges_and_forgetting_a_config() -> None:
    operator_metrics.observe_agents("gone", {"desired": 3, "ready": 2})
    assert (value("gpudra_agents_desired", config="gone"), value("gpudra_agents_ready", config="gone")) == (3, 2)
    operator_metrics.forget_config("gone")
    operator_metrics.forget_config("never-seen")  # no error
    assert REGISTRY.get_sample_value("gpudra_agents_desired", {"config": "gone"}) is None


def test_gc_counters() -> None:
    found, deleted = value("gpudra_resourceslices_stale_found_total"), value("gpudra_resourceslices_stale_deleted_total")
    operator_metrics.record_gc_pass(found=3, deleted=2)
    operator_metrics.record_gc_pass(found=0, deleted=0)
    assert value("gpudra_resourceslices_stale_found_total") - found == 3
    assert value("gpudra_resourceslices_stale_deleted_total") - deleted == 2


def test_claim_operations() -> None:
    total, errors = value("gpudra_agent_node_prepare_total"), value("gpudra_agent_node_prepare_errors_total")
    with agent_metrics.PREPARE.track():
        pass
    with agent_metrics.PREPARE.track() as call:
        call.failed()  # an error reported in the gRPC reply, not raised
    with pytest.raises(OSError), agent_metrics.PREPARE.track():
        raise OSError("disk full")
    agent_metrics.PREPARE.record(0.5, ok=True)
    assert value("gpudra_agent_node_prepare_total") - total == 4
    assert value("gpudra_agent_node_prepare_errors_total") - errors == 2
    unprepared = value("gpudra_agent_node_unprepare_total")
    with agent_metrics.UNPREPARE.track():
        pass
    assert value("gpudra_agent_node_unprepare_total") - unprepared == 1
    agent_metrics.set_prepared_claims(7)
    assert value("gpudra_agent_prepared_claims") == 7


def test_publishing() -> None:
    failures = value("gpudra_agent_publish_errors_total")
    agent_metrics.published(devices=8, slices=1)
    agent_metrics.publish_failed()
    assert value("gpudra_agent_published_devices") == 8
    assert value("gpudra_agent_published_resourceslices") == 1
    assert value("gpudra_agent_last_successful_publish_timestamp_seconds") > 0
    assert value("gpudra_agent_publish_errors_total") - failures == 1


async def test_mps_daemons_by_state_and_their_restarts(tmp_path: Path) -> None:
    """The agent's look at the MPS supervisor's status files (real files, as the supervisor writes
    them) sets the daemons' gauge per state and counts each restart once."""
    import json

    from gpudra_driver.plugin.sharing.mps.apply import MpsDaemons, watch_daemons
    from gpudra_driver.plugin.sharing.mps.plan import SPEC_FILE, STATUS_FILE, DaemonSpec
    from gpudra_dev.localcluster.waiting import wait_for

    uids = [f"0c1d2e3f-0000-4000-8000-00000000000{i}" for i in range(3)]

    def daemon(uid: str, status: dict | None) -> None:
        (tmp_path / uid).mkdir(exist_ok=True)
        (tmp_path / uid / SPEC_FILE).write_bytes(DaemonSpec(uid, ("GPU-1",)).encode())
        if status is not None:
            (tmp_path / uid / STATUS_FILE).write_text(json.dumps(status))

    async def gauge_is(ready: int, starting: int, failed: int) -> bool:
        states = {s: value("gpudra_agent_mps_daemons", state=s) for s in ("Ready", "Starting", "Failed")}
        return states == {"Ready": ready, "Starting": starting, "Failed": failed}

    async def restart_posted() -> bool:
        return events == ["MPSDaemonRestarted"]

    async def posted(kind: str, reason: str, message: str) -> None:
        events.append(reason)

    events: list[str] = []
    daemon(uids[0], {"state": "Ready", "restarts": 0})
    daemon(uids[1], {"state": "Failed", "restarts": 0, "message": "no such GPU"})
    daemon(uids[2], None)  # the supervisor has not converged it yet
    restarts = value("gpudra_agent_mps_daemon_restarts_total")
    task = asyncio.create_task(watch_daemons(MpsDaemons(tmp_path), lambda: [], posted, interval=0.01))
    try:
        await wait_for(lambda: gauge_is(1, 1, 1), timeout=10, what="a daemon in each state")
        daemon(uids[0], {"state": "Ready", "restarts": 2})  # restarted twice since the last look
        daemon(uids[2], {"state": "Ready", "restarts": 0})
        (tmp_path / uids[1] / SPEC_FILE).unlink()  # unprepared: the supervisor stops it
        await wait_for(lambda: gauge_is(2, 0, 0), timeout=10, what="two daemons ready, the failed one gone")
        await wait_for(restart_posted, timeout=10, what="the restart's Event")
        assert value("gpudra_agent_mps_daemon_restarts_total") - restarts == 2
    finally:
        task.cancel()


def test_the_endpoint_serves_every_documented_name() -> None:
    port = free_port()
    operator_metrics.serve(port, addr="127.0.0.1")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    documented = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    names = sorted(set(re.findall(r"`(gpudra_[a-z_]+)`", documented)))
    assert len(names) >= 18
    for name in names:
        assert f"# HELP {name} " in text or f"# HELP {name.removesuffix('_total')} " in text or \
            f"# HELP {name.removesuffix('_info')} " in text, name
    assert "process_resident_memory_bytes" in text


def test_the_endpoint_listens_on_ipv4_and_on_ipv6_where_the_kernel_has_it() -> None:
    """Pods of an IPv6-only cluster are scraped over IPv6, of an IPv4 one over IPv4: by default
    the endpoint takes both (dual-stack ``::``), or IPv4 alone on a kernel without IPv6."""
    port = free_port()
    agent_metrics.serve(port)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert b"gpudra_agent_prepared_claims" in response.read()
    if _has_ipv6_loopback():
        with urllib.request.urlopen(f"http://[::1]:{port}/metrics", timeout=5) as response:
            assert b"gpudra_agent_prepared_claims" in response.read()


def test_a_kernel_without_ipv6_gets_the_ipv4_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from gpudra_core import metrics_http

    calls: list[str] = []

    def start(port: int, addr: str) -> None:
        calls.append(addr)
        if addr == "::":
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")

    monkeypatch.setattr(metrics_http, "start_http_server", start)
    agent_metrics.serve(9999)
    assert calls == ["::", "0.0.0.0"]
    calls.clear()
    monkeypatch.setattr(metrics_http, "start_http_server",
                        lambda port, addr: (_ for _ in ()).throw(OSError(errno.EADDRINUSE, "in use")))
    with pytest.raises(OSError, match="in use"):  # any other error is the caller's to see
        agent_metrics.serve(9999)


def _has_ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False
