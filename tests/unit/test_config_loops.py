"""ConfigLoops: a config's periodic loops follow its watch events (per name and UID), a deleted one
gets its teardown instead, and nothing starts once the operator stops; teardown's pure rules."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, cast

from gpudra_operator.configloops import ConfigLoops, is_deleted
from gpudra_operator.reconcile import Reconciler
from gpudra_operator.slicegc.apply import SliceCollector
from gpudra_operator.teardown import Teardown, driver_still_managed, owned_by
from gpudra_operator.spec import GpuDraConfig


def config(name: str, uid: str, driver: str = "gpu.example.com", **meta: Any) -> dict[str, Any]:
    return {"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuDraConfig",
            "metadata": {"name": name, "uid": uid, "generation": 1, **meta}, "spec": {"driverName": driver}}


class Reconciles:
    def __init__(self) -> None:
        self.bodies: list[Mapping[str, Any]] = []
        self.ran = asyncio.Event()

    async def reconcile(self, body: Mapping[str, Any]) -> None:
        self.bodies.append(body)
        self.ran.set()


class Passes:
    def __init__(self) -> None:
        self.forgotten: list[str] = []
        self.passes: list[Mapping[str, Any]] = []

    def seconds_until_due(self, body: Mapping[str, Any]) -> float:
        return 3600.0

    async def run_pass(self, body: Mapping[str, Any]) -> None:
        self.passes.append(body)

    def forget(self, name: str) -> None:
        self.forgotten.append(name)


class Teardowns:
    def __init__(self) -> None:
        self.started: list[str] = []
        self.closed = False

    def start(self, body: Mapping[str, Any]) -> None:
        self.started.append(body["metadata"]["uid"])

    async def close(self) -> None:
        self.closed = True


def loops(reconciles: Reconciles, passes: Passes, teardowns: Teardowns,
          stopping: asyncio.Event | None = None) -> ConfigLoops:
    return ConfigLoops(cast(Reconciler, reconciles), cast(SliceCollector, passes), cast(Teardown, teardowns),
                       drift_interval=0.01, gc_tick=3600, stopping=stopping or asyncio.Event())


def running(subject: ConfigLoops) -> list[str]:
    return sorted(task.get_name() for _, tasks in subject._loops.values() for task in tasks if not task.done())


async def test_loops_follow_events_and_a_deletion_starts_the_teardown() -> None:
    reconciles, passes, teardowns = Reconciles(), Passes(), Teardowns()
    subject = loops(reconciles, passes, teardowns)
    subject.observe(None, config("a", "uid-1"))  # the initial listing
    subject.observe("MODIFIED", config("a", "uid-1", labels={"new": "body"}))
    assert running(subject) == ["drift a", "gc a"]
    await asyncio.wait_for(reconciles.ran.wait(), timeout=5)
    assert reconciles.bodies[-1]["metadata"]["labels"] == {"new": "body"}  # the newest body

    being_deleted = config("a", "uid-1", deletionTimestamp="2026-12-07T00:00:00Z")
    subject.observe("MODIFIED", being_deleted)
    assert running(subject) == [] and passes.forgotten == ["a"] and teardowns.started == ["uid-1"]
    subject.observe("DELETED", being_deleted)
    assert teardowns.started == ["uid-1", "uid-1"]  # Teardown.start runs each UID once
    await subject.close()
    assert teardowns.closed


async def test_a_config_created_again_under_its_name_gets_new_loops_and_the_old_one_its_teardown() -> None:
    reconciles, passes, teardowns = Reconciles(), Passes(), Teardowns()
    subject = loops(reconciles, passes, teardowns)
    subject.observe("ADDED", config("a", "uid-1"))
    [first, _] = subject._loops["a"][1]
    subject.observe("ADDED", config("a", "uid-2"))  # the DELETED of uid-1 missed (a watch restarted)
    await asyncio.sleep(0)
    assert first.cancelled() and subject._loops["a"][0] == "uid-2" and running(subject) == ["drift a", "gc a"]
    subject.observe("DELETED", config("a", "uid-1"))  # late: the new config's loops stay
    assert running(subject) == ["drift a", "gc a"] and teardowns.started == ["uid-1"]
    await subject.close()
    assert running(subject) == []


async def test_nothing_starts_once_the_operator_stops() -> None:
    reconciles, passes, teardowns = Reconciles(), Passes(), Teardowns()
    stopping = asyncio.Event()
    subject = loops(reconciles, passes, teardowns, stopping)
    subject.observe("ADDED", config("a", "uid-1"))
    stopping.set()
    await asyncio.sleep(0.05)
    assert reconciles.bodies == [] and passes.passes == []  # the drift loop saw the flag before working
    await subject.close()
    subject.observe("ADDED", config("b", "uid-2"))
    subject.observe("DELETED", config("a", "uid-1"))
    assert running(subject) == [] and teardowns.started == []


def test_is_deleted() -> None:
    assert is_deleted("DELETED", config("a", "u"))
    assert is_deleted("MODIFIED", config("a", "u", deletionTimestamp="2026-12-07T00:00:00Z"))
    assert not is_deleted(None, config("a", "u"))


def test_a_driver_is_still_managed_only_by_a_live_config_other_than_the_deleted_one() -> None:
    deleted = GpuDraConfig.from_body(config("a", "uid-1"))
    assert not driver_still_managed([config("a", "uid-1")], deleted)
    assert driver_still_managed([config("a", "uid-2")], deleted)  # created again under its name
    assert driver_still_managed([config("b", "uid-3")], deleted)
    assert not driver_still_managed([config("b", "uid-3", deletionTimestamp="2026-12-07T00:00:00Z")], deleted)
    assert not driver_still_managed([config("b", "uid-3", driver="other.example.com")], deleted)


def test_owned_by_reads_the_owner_uid() -> None:
    child = {"metadata": {"ownerReferences": [{"kind": "GpuDraConfig", "name": "a", "uid": "uid-1"}]}}
    assert owned_by(child, "uid-1") and not owned_by(child, "uid-2") and not owned_by({"metadata": {}}, "uid-1")
