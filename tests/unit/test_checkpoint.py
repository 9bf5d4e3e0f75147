"""The checkpoint: transitions, the file format (version, checksum, boot ID), reconciliation."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from plugin_fixtures import DRIVER, NODE, claim, devices, result

from gpudra_driver.plugin import checkpoint as ckpt
from gpudra_driver.plugin.checkpoint import COMPLETED, STARTED, Checkpoint, CheckpointError
from gpudra_driver.plugin.model import ClaimRef, PreparedClaim
from gpudra_driver.plugin.plan import plan_prepare

A = "0c1d2e3f-0000-4000-8000-00000000000a"
B = "0c1d2e3f-0000-4000-8000-00000000000b"


def prepared(uid: str, device: str) -> PreparedClaim:
    return plan_prepare(ClaimRef("ns", uid[-1], uid), claim(uid, name=uid[-1], results=[result(device)]),
                        devices(), Checkpoint("b"), node=NODE, driver=DRIVER).claim


def test_two_phase_transitions_are_pure() -> None:
    empty = Checkpoint("boot")
    started = empty.started(prepared(A, "gpu-0"))
    done = started.completed(A)
    assert empty.claims == {} and started.claims[A].state == STARTED and done.claims[A].state == COMPLETED
    assert done.device_owner(NODE, "gpu-0") == A and done.device_owner(NODE, "gpu-1") is None
    assert done.without(A) == empty and done.without("unknown") == done


def test_round_trip_with_version_checksum_and_boot_id() -> None:
    cp = Checkpoint("boot").started(prepared(A, "gpu-0")).completed(A).started(prepared(B, "gpu-1"))
    data = ckpt.encode(cp)
    doc = json.loads(data)
    assert doc["version"] == 1 and doc["bootID"] == "boot" and doc["checksum"].startswith("sha256:")
    assert doc["claims"][A]["state"] == "PrepareCompleted" and doc["claims"][B]["state"] == "PrepareStarted"
    assert ckpt.decode(data) == cp


def test_the_file_is_the_canonical_json_of_its_body() -> None:
    # encode() assembles the body from per-entry fragments; it must be byte for byte what the
    # reader re-canonicalises, in any insertion order and with a device-less PrepareStarted entry.
    cp = (Checkpoint("boot-\u00e9").started(prepared(B, "gpu-1")).completed(B)
          .started(PreparedClaim(ClaimRef("ns", "a", A), ())))
    data = ckpt.encode(cp)
    doc = json.loads(data)
    body = {k: v for k, v in doc.items() if k != "checksum"}
    assert data == b'{"checksum":' + json.dumps(doc["checksum"]).encode() + b"," + ckpt._canonical(body)[1:] + b"\n"
    assert list(doc["claims"]) == [A, B] and doc["claims"][A] == {"state": STARTED, "namespace": "ns", "name": "a",
                                                                   "devices": []}
    assert ckpt.decode(data) == cp and ckpt.encode(ckpt.decode(data)) == data
    assert cp.completed_count() == 1


def test_state_goes_last_in_an_entry_because_it_sorts_after_every_key_of_a_claim() -> None:
    # Entry.canonical appends "state" to the claim's cached canonical JSON instead of re-encoding
    assert all(key < "state" for key in prepared(A, "gpu-0").to_json())


def test_the_device_owner_index_follows_every_transition() -> None:
    import random

    rng = random.Random(7)
    uids = [f"0c1d2e3f-0000-4000-8000-0000000000{i:02x}" for i in range(12)]
    cp = Checkpoint("b")
    cp.device_owner(NODE, "gpu-0")  # build the index, so transitions carry it over
    for _ in range(300):
        uid, device = rng.choice(uids), f"gpu-{rng.randrange(8)}"
        move = rng.choice(["started", "completed", "without"])
        if move == "started" and cp.device_owner(NODE, device) is None:
            cp = cp.started(prepared(uid, device)) if uid not in cp.claims else cp
        elif move == "completed" and uid in cp.claims:
            cp = cp.completed(uid)
        elif move == "without":
            cp = cp.without(uid)
        truth = {(d.pool, d.device): u for u, e in cp.claims.items() for d in e.claim.devices}
        assert {d: cp.device_owner(NODE, d) for d in (f"gpu-{i}" for i in range(8))} == {
            d: truth.get((NODE, d)) for d in (f"gpu-{i}" for i in range(8))}


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: d["claims"].clear(), "checksum mismatch"),
    (lambda d: d.update(version=6), "version 6"),
    (lambda d: d.update(version=True), r"no valid version \(True\)"),
    (lambda d: d.update(checksum="sha256:00"), "checksum mismatch"),
])
def test_tampered_or_newer_files_are_rejected(mutate, message: str) -> None:
    doc = json.loads(ckpt.encode(Checkpoint("boot").started(prepared(A, "gpu-0"))))
    mutate(doc)
    with pytest.raises(CheckpointError, match=message) as raised:
        ckpt.decode(json.dumps(doc).encode())
    # only a well-formed higher version is a newer agent's (the start stops); the rest is corrupt
    assert isinstance(raised.value, ckpt.NewerCheckpoint) == (doc["version"] == 6)


@pytest.mark.parametrize("data", [b"", b"{", b"[]", b"\xff"])
def test_garbage_is_rejected(data: bytes) -> None:
    with pytest.raises(CheckpointError):
        ckpt.decode(data)


def test_a_checkpoint_from_another_boot_is_void(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    ckpt.CheckpointFile(path, "boot-1").save(Checkpoint("boot-1").started(prepared(A, "gpu-0")).completed(A))
    assert ckpt.load(path, "boot-1")[0].claims.keys() == {A}
    loaded, problem = ckpt.load(path, "boot-2")
    assert loaded == Checkpoint("boot-2") and "from boot boot-1" in (problem or "")
    assert ckpt.load(tmp_path / "missing.json", "boot-2") == (Checkpoint("boot-2"), None)


def test_save_is_atomic_private_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    store = ckpt.CheckpointFile(path, "b")
    done = Checkpoint("b").started(prepared(A, "gpu-0")).completed(A)
    for checkpoint in (Checkpoint("b"), Checkpoint("b").started(prepared(A, "gpu-0")), done):
        store.save(checkpoint)
        assert path.read_bytes() == ckpt.encode(checkpoint)
        # the checkpoint and its scratch file (the previous content; none before the second save)
        assert set(os.listdir(tmp_path)) <= {"checkpoint.json", ".checkpoint.json.scratch-volatile"}
    assert path.stat().st_mode & 0o777 == 0o600 and store.scratch.stat().st_mode & 0o777 == 0o600
    assert ckpt.is_leftover(store.scratch.name, path.name)  # start-up removes it with the temp files
    assert store.prepared_count == 1 and ckpt.CheckpointFile(path, "b").load() == done


def test_a_checkpoint_changed_by_someone_else_is_read_again(tmp_path: Path) -> None:
    """The decoded checkpoint is reused only while the file holds exactly the bytes it came from."""
    path = tmp_path / "checkpoint.json"
    mine, peer = ckpt.CheckpointFile(path, "b"), ckpt.CheckpointFile(path, "b")
    mine.save(Checkpoint("b"))
    assert mine.load() == Checkpoint("b")
    changed = Checkpoint("b").started(prepared(A, "gpu-0")).completed(A)
    peer.save(changed)
    assert mine.load() == changed and mine.prepared_count == 1


def test_start_up_may_delete_only_the_writers_leftovers() -> None:
    leftovers = [".checkpoint.json.tmp-1234", ".checkpoint.json.scratch-durable", ".checkpoint.json.scratch-volatile"]
    kept = ["checkpoint.json", "checkpoint.json.corrupt-1700000000", "serialize.lock", ".checkpoint.json.other"]
    assert [n for n in leftovers + kept if ckpt.is_leftover(n, "checkpoint.json")] == leftovers


def test_reconcile_rolls_back_started_rewrites_missing_and_removes_orphans() -> None:
    done, half = prepared(A, "gpu-0"), prepared(B, "gpu-1")
    cp = Checkpoint("b").started(done).completed(A).started(half)
    orphan = "0c1d2e3f-0000-4000-8000-00000000000c"
    r = ckpt.reconcile(cp, {B, orphan})  # A's spec is missing, B half-written, C unknown
    assert r.checkpoint == Checkpoint("b").started(done).completed(A)
    assert r.rolled_back == (B,) and r.remove_specs == (B, orphan) and r.rewrite_specs == (done,)
    clean = ckpt.reconcile(r.checkpoint, {A})
    assert not clean.changed and clean.checkpoint == r.checkpoint



C = "0c1d2e3f-0000-4000-8000-00000000000c"


def test_the_version_is_the_lowest_whose_readers_keep_everything() -> None:
    plain = Checkpoint("boot").started(prepared(A, "gpu-0")).completed(A)
    assert json.loads(ckpt.encode(plain))["version"] == 1  # what agents before version 2 read and write
    monitored = plan_prepare(ClaimRef("ns", "m", B), claim(B, name="m", results=[result("gpu-0", adminAccess=True)]),
                             devices(), plain, node=NODE, driver=DRIVER).claim
    with_admin = plain.started(monitored).completed(B)
    assert json.loads(ckpt.encode(with_admin))["version"] == 2
    assert ckpt.decode(ckpt.encode(with_admin)) == with_admin
    assert json.loads(ckpt.encode(with_admin.without(B)))["version"] == 1
    assert json.loads(ckpt.encode(plain.adopting({C: [(NODE, "gpu-5")]})))["version"] == 2


def test_adopted_specs_round_trip_hold_their_devices_and_go_with_unprepare() -> None:
    cp = Checkpoint("boot").started(prepared(A, "gpu-0")).completed(A).adopting({C: [(NODE, "gpu-5"), (NODE, "gpu-6")]})
    data = ckpt.encode(cp)
    doc = json.loads(data)
    body = {k: v for k, v in doc.items() if k != "checksum"}
    assert data == b'{"checksum":' + json.dumps(doc["checksum"]).encode() + b"," + ckpt._canonical(body)[1:] + b"\n"
    assert doc["adopted"] == {C: [[NODE, "gpu-5"], [NODE, "gpu-6"]]}
    assert ckpt.decode(data) == cp and ckpt.encode(ckpt.decode(data)) == data
    assert cp.device_owner(NODE, "gpu-6") == C and cp.completed_count() == 1
    assert cp.without(C) == Checkpoint("boot").started(prepared(A, "gpu-0")).completed(A)
    assert cp.without(C).device_owner(NODE, "gpu-6") is None
    # prepared again (the kubelet asked): adopted until the prepare completes, then an entry
    again = cp.started(prepared(C, "gpu-5"))
    assert C in again.adopted and again.device_owner(NODE, "gpu-6") == C
    assert again.rolled_back(C) == cp  # a rollback keeps the adoption
    done = again.completed(C)
    assert C not in done.adopted and done.device_owner(NODE, "gpu-6") is None and done.device_owner(NODE, "gpu-5") == C
    # without adoptions, nothing in the file says so: earlier files stay byte-identical
    assert "adopted" not in json.loads(ckpt.encode(cp.without(C)))


@pytest.mark.parametrize("adopted", [["x"], {C: "gpu-5"}, {C: [["node-a"]]}, {C: [["node-a", 5]]}])
def test_malformed_adoptions_are_rejected(adopted) -> None:
    doc = json.loads(ckpt.encode(Checkpoint("boot")))
    doc["adopted"] = adopted
    body = {k: v for k, v in doc.items() if k != "checksum"}
    doc["checksum"] = "sha256:" + __import__("hashlib").sha256(ckpt._canonical(body)).hexdigest()
    with pytest.raises(CheckpointError, match="adopted"):
        ckpt.decode(json.dumps(doc).encode())


def test_reconcile_keeps_adopted_specs_and_forgets_adoptions_whose_spec_is_gone() -> None:
    cp = Checkpoint("b").adopting({A: [(NODE, "gpu-0")], C: [(NODE, "gpu-2")]})
    r = ckpt.reconcile(cp, {A})  # C's spec was removed by hand
    assert r.remove_specs == () and dict(r.checkpoint.adopted) == {A: ((NODE, "gpu-0"),)}
    # a half-done prepare of an adopted claim is rolled back to the adoption, its spec kept; it may
    # have been rewritten, so both GPUs stay held until start-up reads it again
    r = ckpt.reconcile(cp.started(prepared(A, "gpu-1")), {A, C})
    assert r.rolled_back == (A,) and r.remove_specs == () and not r.checkpoint.claims
    assert dict(r.checkpoint.adopted) == {A: ((NODE, "gpu-0"), (NODE, "gpu-1")), C: ((NODE, "gpu-2"),)}

def test_adopted_claims_names_round_trip_canonically_and_go_with_their_adoption() -> None:
    """The names a running agent knew its adopted claims by: what the leak sweep looks them up by."""
    cp = (Checkpoint("boot").started(prepared(A, "gpu-0")).completed(A)
          .adopting({C: [(NODE, "gpu-5")], B: [(NODE, "gpu-6")]})
          .naming({C: ("ns", "c"), A: ("ns", "a"), "unknown": ("ns", "x")}))
    assert dict(cp.adopted_names) == {C: ("ns", "c")}  # only adopted claims are named
    data = ckpt.encode(cp)
    doc = json.loads(data)
    body = {k: v for k, v in doc.items() if k != "checksum"}
    assert data == b'{"checksum":' + json.dumps(doc["checksum"]).encode() + b"," + ckpt._canonical(body)[1:] + b"\n"
    assert doc["adoptedNames"] == {C: ["ns", "c"]} and ckpt.decode(data) == cp
    assert cp != cp.without(C).adopting({C: [(NODE, "gpu-5")]})  # the same adoption without its name
    assert not cp.without(C).adopted_names and "adoptedNames" not in json.loads(ckpt.encode(cp.without(C)))
    assert cp.rolled_back(C).adopted_names == cp.adopted_names  # a rollback keeps the adoption
    assert not cp.started(prepared(C, "gpu-5")).completed(C).adopted_names  # prepared again: an entry
    assert dict(ckpt.reconcile(cp, {B}).checkpoint.adopted_names) == {}  # its spec gone: forgotten


def test_boot_id_is_read_from_the_kernel() -> None:
    boot_id = ckpt.read_boot_id()
    assert len(boot_id) == 36 and boot_id == ckpt.read_boot_id()


def test_a_read_without_the_lock_that_races_a_save_is_read_again(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A save overwrites the file the checkpoint was before the last save: a reader without the
    node lock that opened it then may read it half-overwritten. The checksum tells; it reads again."""
    from gpudra_driver.plugin import fsutil

    store = ckpt.CheckpointFile(tmp_path / "checkpoint.json", "boot-1")
    saved = ckpt.Checkpoint("boot-1").started(PreparedClaim(ClaimRef("ns", "a", A), ())).completed(A)
    store.save(saved)
    good = (tmp_path / "checkpoint.json").read_bytes()
    reads = iter([good[: len(good) // 2] + b"x" * (len(good) - len(good) // 2), good])
    monkeypatch.setattr(fsutil, "read_file", lambda path: next(reads))
    fresh = ckpt.CheckpointFile(tmp_path / "checkpoint.json", "boot-1")
    assert fresh.load_unlocked() == saved
    monkeypatch.setattr(fsutil, "read_file", lambda path: b"{torn")  # corrupt for good: raises
    with pytest.raises(ckpt.CheckpointError):
        fresh.load_unlocked()
