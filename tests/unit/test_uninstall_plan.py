"""The pure decisions of an uninstall: whether an agent's config is retired, what it removes from its
node (gpudra_driver.uninstall), which pods stop `gpudra uninstall` and what it says
(gpudra_operator.uninstall_cmd). The shells run against the real API server in
tests/integration/test_uninstall.py."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path
from typing import Any

from gpudra_driver.uninstall import FilePlan, HeardOfConfig, config_retired, decide, plan_files, remove_files
from gpudra_operator.uninstall_cmd import Holder, holders, refusal, selected, still_there

DRIVER = "gpu.gpudra.io"


def claim(namespace: str, name: str, driver: str | None, pods: list[str], **consumer: str) -> dict[str, Any]:
    status: dict[str, Any] = {}
    if driver is not None:
        status["allocation"] = {"devices": {"results": [{"driver": driver, "pool": "n", "device": "gpu-0",
                                                         "request": "gpu"}]}}
    if pods:
        status["reservedFor"] = [{"resource": "pods", "name": p, "uid": f"uid-{p}", **consumer} for p in pods]
    return {"metadata": {"namespace": namespace, "name": name}, "status": status}


def test_a_config_is_retired_when_gone_or_being_deleted() -> None:
    assert config_retired(None)
    assert config_retired({"metadata": {"name": "c", "deletionTimestamp": "2026-01-01T00:00:00Z"}})
    assert not config_retired({"metadata": {"name": "c"}})


def test_holders_are_the_pods_reserving_claims_of_the_drivers() -> None:
    claims = [claim("a", "mine", DRIVER, ["p1", "p2"]), claim("b", "other-driver", "x.example.com", ["q"]),
              claim("c", "allocated-unused", DRIVER, []), claim("d", "pending", None, ["r"]),
              claim("e", "not-a-pod", DRIVER, ["s"], apiGroup="example.com", resource="things")]
    assert holders(claims, {DRIVER}) == [Holder("a/p1", "a/mine", (DRIVER,)), Holder("a/p2", "a/mine", (DRIVER,))]
    assert holders(claims, {"x.example.com"}) == [Holder("b/q", "b/other-driver", ("x.example.com",))]
    assert holders(claims, set()) == []


def test_the_refusal_names_every_pod_and_claim_and_the_way_out() -> None:
    message = refusal([Holder("a/p1", "a/mine", (DRIVER,)), Holder("a/p2", "a/mine", (DRIVER,))])
    assert "2 pod(s)" in message
    assert "pod a/p1 (claim a/mine); pod a/p2 (claim a/mine)" in message
    assert "--force" in message and "uninstall.force=true" in message
    many = refusal([Holder(f"n/p{i}", f"n/c{i}", (DRIVER,)) for i in range(25)], shown=20)
    assert "and 5 more" in many and "n/p19" in many and "n/p20" not in many


def test_configs_are_selected_by_their_agents_namespace() -> None:
    def config(name: str, namespace: str | None) -> dict[str, Any]:
        agent = {"namespace": namespace} if namespace else {}
        return {"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig",
                "metadata": {"name": name, "uid": f"uid-{name}"}, "spec": {"driverName": DRIVER, "agent": agent}}

    configs = [config("default-ns", None), config("ours", "gpudra-system"), config("theirs", "elsewhere")]
    assert [c.name for c in selected(configs, None)] == ["default-ns", "ours", "theirs"]
    assert [c.name for c in selected(configs, "gpudra-system")] == ["default-ns", "ours"]
    assert [c.name for c in selected(configs, "elsewhere")] == ["theirs"]


def test_what_a_timed_out_uninstall_leaves_is_said() -> None:
    text = still_there([{"metadata": {"name": "default", "finalizers": ["gpudra.io/cleanup", "foregroundDeletion"]}}],
                       {DRIVER: [object(), object()]}, 240)
    assert "after 240s" in text
    assert "GpuDraConfig default (finalizers: gpudra.io/cleanup, foregroundDeletion)" in text
    assert f"2 ResourceSlice(s) of driver {DRIVER}" in text


def test_held_claims_or_another_instance_keep_every_file(tmp_path: Path) -> None:
    spec = tmp_path / "cdi" / "k8s.gpu.gpudra.io-claim_u1.json"
    kept = plan_files(held=["ns/claim"], other_instance=None, cdi_specs=[spec], plugin_dir=tmp_path,
                      plugin_files=[tmp_path / "checkpoint.json"], subdirs=[])
    assert kept == FilePlan(kept_claims=("ns/claim",)) and not kept.removes
    other = tmp_path / "dra-other.sock"
    shared = plan_files(held=[], other_instance=other, cdi_specs=[spec], plugin_dir=tmp_path, plugin_files=[],
                        subdirs=[])
    assert shared == FilePlan(other_instance=other) and not shared.removes


def test_an_empty_node_state_is_removed_whole(tmp_path: Path) -> None:
    plugin_dir, cdi = tmp_path / "plugins" / DRIVER, tmp_path / "cdi"
    (plugin_dir / "mps" / "claim" / "pipe").mkdir(parents=True)
    (plugin_dir / "dra-device-metadata").mkdir()
    (plugin_dir / "dra-device-metadata" / "orphan.json").write_text("{}")
    cdi.mkdir()
    ours, theirs = cdi / f"k8s.{DRIVER}-claim_u1.json", cdi / "k8s.other.example.com-claim_u2.json"
    for path in (ours, theirs, plugin_dir / "checkpoint.json", plugin_dir / "serialize.lock"):
        path.write_text("{}")
    stale = plugin_dir / "dra-crashed.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(stale))
    server.close()  # a socket file nobody accepts on
    plan = plan_files(held=[], other_instance=None, cdi_specs=[ours], plugin_dir=plugin_dir,
                      plugin_files=[plugin_dir / "checkpoint.json", plugin_dir / "serialize.lock", stale],
                      subdirs=[plugin_dir / "mps", plugin_dir / "dra-device-metadata"])
    assert plan.removes
    assert remove_files(plan) == []
    assert not plugin_dir.exists() and not ours.exists()
    assert theirs.exists()  # another driver's spec is never ours to remove
    assert remove_files(plan) == []  # again: nothing there, nothing to complain about


def test_a_file_nobody_planned_for_keeps_the_plugin_directory_and_is_named(tmp_path: Path) -> None:
    plugin_dir = tmp_path / "plugin"
    plugin_dir.mkdir()
    (plugin_dir / "someone-elses").write_text("x")
    problems = remove_files(plan_files(held=[], other_instance=None, cdi_specs=[], plugin_dir=plugin_dir,
                                       plugin_files=[], subdirs=[]))
    assert len(problems) == 1 and str(plugin_dir) in problems[0] and "someone-elses" in problems[0]
    assert plugin_dir.is_dir()


def test_the_api_servers_answer_decides_where_it_tells_else_what_the_watch_heard() -> None:
    gone, in_place = (True, "GpuDraConfig c is gone"), (False, "GpuDraConfig c is in place")
    refused = (None, "reading GpuDraConfig c failed (403: forbidden)")
    assert decide(gone, None, "c") == gone
    assert decide(in_place, True, "c") == in_place  # created again since the watch's last word
    assert decide(refused, None, "c") == (False, refused[1])  # no word: everything stays
    assert decide(refused, False, "c") == (False, refused[1])
    assert decide(refused, True, "c") == (True, f"{refused[1]}, and the watch saw GpuDraConfig c deleted")


async def test_what_the_watch_heard_follows_lists_and_events() -> None:
    heard = HeardOfConfig("c")
    assert heard.retired is None  # no word yet
    heard.list_started()
    await heard.list_page([{"metadata": {"name": "c"}}])
    await heard.list_done()
    assert heard.retired is False
    heard.changed({"metadata": {"name": "c", "deletionTimestamp": "2026-12-07T00:00:00Z"}})
    assert heard.retired is True
    heard.changed({"metadata": {"name": "c"}})  # created again
    assert heard.retired is False
    heard.deleted({"metadata": {"name": "c"}})
    assert heard.retired is True
    heard.list_started()  # a relist that finds it gone (deleted while the watch was down)
    heard.changed({"metadata": {"name": "c"}})
    await heard.list_page([])
    await heard.list_done()
    assert heard.retired is True


def test_the_agents_own_volume_is_emptied_and_left_without_a_problem(tmp_path: Path) -> None:
    """The plugin directory is the agent pod's hostPath volume: a mount point in its container,
    which rmdir cannot remove (EBUSY). Emptied, it is no problem; a busy one with files left is."""
    volume = tmp_path / "plugins" / "gpu.example.com"
    volume.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(volume)], check=True, timeout=30)
    try:
        (volume / "checkpoint.json").write_text("{}")
        assert remove_files(FilePlan(files=(volume / "checkpoint.json",), empty_dirs=(volume,))) == []
        assert volume.is_dir() and os.listdir(volume) == []
        (volume / "stray").write_text("")
        [problem] = remove_files(FilePlan(empty_dirs=(volume,)))
        assert problem.startswith(f"{volume}: ")
    finally:
        subprocess.run(["umount", str(volume)], check=True, timeout=30)
