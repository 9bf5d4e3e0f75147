"""DeviceState: prepare/unprepare on disk, and a crash at every point of them followed by a restart.

A crash is simulated by raising from the fault hook at the named point: every write before it is
in place (synchronous, atomic, in the page cache a killed process cannot lose), nothing after it
happens, as with SIGKILL. The integration
tests do the real SIGKILL against an agent subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from cdispec import load_and_validate
from plugin_fixtures import DRIVER, NODE, claim, devices, driver_files, result

from gpudra_driver.plugin import checkpoint as ckpt
from gpudra_driver.plugin import fsutil
from gpudra_driver.plugin.cdi import CdiDir, metadata_dir
from gpudra_driver.plugin.faults import POINTS, FaultHook
from gpudra_driver.plugin.locking import LOCK_TIMEOUT, LockTimeout, node_lock
from gpudra_driver.plugin.model import ClaimError, ClaimRef
from gpudra_driver.plugin.state import DeviceState

A = "0c1d2e3f-0000-4000-8000-00000000000a"
B = "0c1d2e3f-0000-4000-8000-00000000000b"
REF_A, REF_B = ClaimRef("ns", "a", A), ClaimRef("ns", "b", B)


class Crash(BaseException):
    pass


class CrashAt(FaultHook):
    """Raises :class:`Crash` at its point; ``CrashAt()`` does nothing until armed."""

    def __init__(self, point: str = "") -> None:
        super().__init__(point)

    def arm(self, point: str) -> None:
        """Crash at ``point`` from now on (the state and its parts share this hook)."""
        assert point in POINTS
        self.point = point

    def __call__(self, point: str) -> None:
        if point == self.point:
            raise Crash(point)


def make(tmp_path: Path, fault: FaultHook | None = None, boot: str = "boot-1",
         cls: type[DeviceState] = DeviceState, gpu_control: Any = None,
         lock_timeout: float = LOCK_TIMEOUT) -> DeviceState:
    cdi = CdiDir(tmp_path / "cdi", DRIVER, driver_files(), metadata_root=metadata_dir(tmp_path / "cdi", DRIVER))
    state = cls(tmp_path / "plugin", cdi, driver=DRIVER, node=NODE,
                boot_id=boot, fault=fault if fault is not None else CrashAt(), gpu_control=gpu_control,
                lock_timeout=lock_timeout)
    state.recover()
    state.set_devices(devices())
    return state


def items(*pairs):
    return [(ref, obj) for ref, obj in pairs]


def noting_saves(state: DeviceState, monkeypatch: pytest.MonkeyPatch) -> list[set[str]]:
    """The claims of each checkpoint the state writes from now on, in order."""
    saves: list[set[str]] = []
    real_save = state.checkpoint.save

    def noting_save(checkpoint: ckpt.Checkpoint) -> None:
        saves.append(set(checkpoint.claims))
        real_save(checkpoint)

    monkeypatch.setattr(state.checkpoint, "save", noting_save)
    return saves


def spec_files(tmp_path: Path) -> list[str]:
    """The CDI directory's files (the device metadata directory in it aside)."""
    return sorted(n for n in os.listdir(tmp_path / "cdi") if not (tmp_path / "cdi" / n).is_dir())


async def test_prepare_writes_spec_and_checkpoint_then_unprepare_removes_both(tmp_path: Path) -> None:
    state = make(tmp_path)
    out = await state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-2")]))))
    assert out[A].error is None and [d.device for d in out[A].claim.devices] == ["gpu-2"]
    (name,) = spec_files(tmp_path)
    spec = load_and_validate(tmp_path / "cdi" / name)
    host = driver_files().root.host
    assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidia2", "hostPath": f"{host}/dev/nvidia2"}]
    saved = ckpt.load(state.checkpoint_path, "boot-1")[0]
    assert saved.claims[A].state == ckpt.COMPLETED

    # Idempotent: same answer, spec not rewritten (same inode and mtime).
    before = (tmp_path / "cdi" / name).stat()
    again = await state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-2")]))))
    after = (tmp_path / "cdi" / name).stat()
    assert again[A] == out[A] and (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)

    assert await state.unprepare([REF_A]) == {A: None}
    assert spec_files(tmp_path) == [] and ckpt.load(state.checkpoint_path, "boot-1")[0].claims == {}
    assert await state.unprepare([REF_A]) == {A: None}  # unknown claim: success


async def test_an_unprepare_of_many_claims_lists_each_directory_a_bounded_number_of_times(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unpreparing a node's claims all at once (a drain) costs linear work: each directory is
    listed a fixed number of times per call, not once per claim (as it was: 64 claims took
    64 listings of the metadata directory, each parsing every file name in it)."""
    state = make(tmp_path)
    refs = [ClaimRef("ns", f"c{i}", f"0c1d2e3f-0000-4000-8000-0000000001{i:02x}") for i in range(8)]
    out = await state.prepare(items(*((ref, claim(ref.uid, name=ref.name, results=[result(f"gpu-{i}")]))
                                      for i, ref in enumerate(refs))))
    assert all(r.error is None for r in out.values())
    assert len(os.listdir(metadata_dir(tmp_path / "cdi", DRIVER))) == 8
    listed: list[str] = []
    real_listdir = os.listdir

    def counting_listdir(path: Any = ".") -> list[str]:
        listed.append(os.fspath(path))
        return real_listdir(path)

    monkeypatch.setattr(os, "listdir", counting_listdir)
    assert await state.unprepare(refs) == dict.fromkeys((r.uid for r in refs), None)
    monkeypatch.undo()
    assert spec_files(tmp_path) == [] and os.listdir(metadata_dir(tmp_path / "cdi", DRIVER)) == []
    assert listed.count(os.fspath(metadata_dir(tmp_path / "cdi", DRIVER))) <= 2  # orphans, then the claims'
    assert len(listed) <= 6, listed


async def test_one_bad_claim_never_fails_the_others(tmp_path: Path) -> None:
    state = make(tmp_path)
    out = await state.prepare(items(
        (REF_A, claim(A, name="a", results=[result("gpu-1")])),
        (REF_B, claim(B, name="b", results=[result("gpu-1")])),  # the same GPU: refused
        (ClaimRef("ns", "c", "../x"), claim()),
        (ClaimRef("ns", "d", "0c1d2e3f-0000-4000-8000-00000000000d"), ClaimError("GET failed: 503")),
    ))
    assert out[A].error is None
    assert "gpu-1 is already prepared for claim " + A in (out[B].error or "")
    assert "malformed" in (out["../x"].error or "") and "503" in (out["0c1d2e3f-0000-4000-8000-00000000000d"].error or "")
    assert len(spec_files(tmp_path)) == 1
    assert set(ckpt.load(state.checkpoint_path, "boot-1")[0].claims) == {A}


async def test_the_same_claim_twice_in_one_call_is_prepared_once(tmp_path: Path) -> None:
    state = make(tmp_path)
    obj = claim(A, name="a", results=[result("gpu-1")])
    out = await state.prepare(items((REF_A, obj), (REF_A, obj)))
    assert list(out) == [A] and out[A].error is None


async def test_an_unwritable_cdi_directory_is_a_per_claim_error_and_nothing_is_recorded(tmp_path: Path) -> None:
    state = make(tmp_path)
    os.rmdir(tmp_path / "cdi")
    (tmp_path / "cdi").write_text("a file where the directory should be")
    out = await state.prepare(items((REF_A, claim(A, name="a"))))
    assert "writing its CDI spec" in (out[A].error or "")
    assert ckpt.load(state.checkpoint_path, "boot-1")[0].claims == {}
    assert sorted(os.listdir(tmp_path)) == ["cdi", "plugin"]
    assert sorted(os.listdir(tmp_path / "plugin")) == ["checkpoint.json", "serialize.lock"]
    assert not metadata_dir(tmp_path / "cdi", DRIVER).exists()  # no device metadata file either (it goes in there)


async def test_a_deleted_spec_of_a_prepared_claim_is_written_again(tmp_path: Path) -> None:
    state = make(tmp_path)
    await state.prepare(items((REF_A, claim(A, name="a"))))
    (tmp_path / "cdi" / spec_files(tmp_path)[0]).unlink()
    assert (await state.prepare(items((REF_A, None))))[A].error is None  # answered from the checkpoint
    assert len(spec_files(tmp_path)) == 1


async def test_a_checkpoint_changed_by_another_instance_is_read_again_even_with_the_same_size_and_mtime(
        tmp_path: Path) -> None:
    state = make(tmp_path)
    await state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-0")]))))
    before = state.checkpoint_path.stat()
    elsewhere = make(tmp_path / "elsewhere")
    await elsewhere.prepare(items((REF_B, claim(B, name="b", results=[result("gpu-1")]))))
    only_b = elsewhere.checkpoint_path.read_bytes()
    assert len(only_b) == before.st_size
    # as if another agent instance had written it: B instead of A, in the same inode with the same
    # size and mtime, which no stat-based cache key could tell apart
    with state.checkpoint_path.open("r+b") as f:
        f.write(only_b)
    os.utime(state.checkpoint_path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert state.checkpoint_path.stat().st_ino == before.st_ino
    out = await state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-2")]))))
    assert out[A].error is None and out[A].claim.devices[0].device == "gpu-2"  # prepared anew, not answered again
    assert ckpt.load(state.checkpoint_path, "boot-1")[0].claims.keys() == {A, B}


async def test_a_prepare_writes_specs_then_commits_with_prepare_started_only_for_side_effects_and_never_fsyncs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The durability contract (docs/kubelet-plugin.md): atomic renames, no fsync of file or
    directory on the prepare or unprepare path."""
    state = make(tmp_path)
    writes: list[str] = []
    real_write_atomic = fsutil.write_atomic

    def note(path: Path, data: bytes) -> None:
        if path.name == "checkpoint.json":
            loaded = ckpt.decode(data)
            writes.append("checkpoint " + ",".join(f"{e.claim.ref.name}:{e.state}" for _, e in sorted(loaded.claims.items())))
        else:
            writes.append("spec " + ("a" if A in path.name else "b"))

    def recording_write_atomic(path: Path, data: bytes, *, mode: int = 0o644) -> None:
        note(path, data)
        real_write_atomic(path, data, mode=mode)

    real_write_exchanging = fsutil.write_exchanging

    def recording_write_exchanging(path: Path, data: bytes, scratch: Path, *, mode: int = 0o644) -> None:
        note(path, data)
        real_write_exchanging(path, data, scratch, mode=mode)

    def no_fsync(fd: int) -> None:
        raise AssertionError("fsync on the prepare path")

    from gpudra_driver.plugin import cdi

    monkeypatch.setattr(fsutil, "write_atomic", recording_write_atomic)
    monkeypatch.setattr(fsutil, "write_exchanging", recording_write_exchanging)
    monkeypatch.setattr(cdi, "write_atomic", recording_write_atomic)
    monkeypatch.setattr(os, "fsync", no_fsync)
    monkeypatch.setattr(os, "fdatasync", no_fsync)
    out = await state.prepare(items((REF_A, claim(A, name="a")), (REF_B, claim(B, name="b", results=[result("gpu-1")]))))
    assert out[A].error is None and out[B].error is None
    # plain claims (new, no side effect outside the CDI directory): the specs, then one commit
    assert writes == ["spec a", "spec b", "checkpoint a:PrepareCompleted,b:PrepareCompleted"]
    assert state.prepared_count == 2
    del writes[:]
    await state.prepare(items((REF_A, claim(A, name="a"))))  # answered again: nothing written
    assert writes == []
    assert await state.unprepare([REF_A]) == {A: None}
    assert writes == ["checkpoint b:PrepareCompleted"] and state.cdi.claim_uids() == {B}
    assert state.prepared_count == 1
    del writes[:]
    # a claim with a side effect (time-slicing its GPU) is recorded as PrepareStarted first, so a
    # restart knows what to undo; so is a claim allocated anew over its entry
    state.sharing.gpu_control = RecordingControl()  # type: ignore[assignment]
    assert (await state.prepare(items((REF_A, sliced(A, "a", "gpu-2")))))[A].error is None
    assert writes == ["checkpoint a:PrepareStarted,b:PrepareCompleted", "spec a",
                      "checkpoint a:PrepareCompleted,b:PrepareCompleted"]
    del writes[:]
    assert (await state.prepare(items((REF_B, claim(B, name="b", results=[result("gpu-3")])))))[B].error is None
    assert writes == ["checkpoint a:PrepareCompleted,b:PrepareStarted", "spec b",
                      "checkpoint a:PrepareCompleted,b:PrepareCompleted"]


def commit_fails(patched: pytest.MonkeyPatch, state: DeviceState, uid: str, *, after_writing: bool = False,
                 error: OSError | None = None) -> None:
    """The checkpoint write that records ``uid`` as prepared fails (after taking effect, when
    ``after_writing``: a rename that reports an error)."""
    real_save = state.checkpoint.save

    def save(checkpoint: ckpt.Checkpoint) -> None:
        entry = checkpoint.claims.get(uid)
        if entry is not None and entry.state == ckpt.COMPLETED:
            if after_writing:
                real_save(checkpoint)
            raise error or OSError(5, "Input/output error")
        real_save(checkpoint)

    patched.setattr(state.checkpoint, "save", save)


async def test_a_spec_that_cannot_be_written_drops_its_claim_from_the_commit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = make(tmp_path)
    real_write = state.cdi.write

    def failing_for_b(claim):  # type: ignore[no-untyped-def]
        if claim.uid == B:
            raise OSError(28, "No space left on device")
        return real_write(claim)

    monkeypatch.setattr(state.cdi, "write", failing_for_b)
    out = await state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-0")])),
                              (REF_B, claim(B, name="b", results=[result("gpu-1")]))))
    assert out[A].error is None and "No space left" in (out[B].error or "")
    claims = ckpt.load(state.checkpoint_path, "boot-1")[0].claims
    assert set(claims) == {A} and claims[A].state == ckpt.COMPLETED  # B is not committed
    assert state.cdi.claim_uids() == {A}


@pytest.mark.parametrize("after_writing", [False, True], ids=["not-written", "written-then-error"])
async def test_a_commit_that_fails_is_an_error_and_rolled_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, after_writing: bool) -> None:
    state = make(tmp_path)
    commit_fails(monkeypatch, state, A, after_writing=after_writing)
    out = await state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-0")]))))
    assert "recording the prepared claim failed" in (out[A].error or "")
    assert ckpt.load(state.checkpoint_path, "boot-1")[0].claims == {}  # rolled back to before
    assert state.cdi.claim_uids() == set() and state.prepared_count == 0


async def test_a_failing_prepare_started_write_fails_the_new_claims_and_nothing_stays(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = make(tmp_path)
    await state.prepare(items((REF_B, claim(B, name="b", results=[result("gpu-1")]))))  # before the disk filled up
    real_save = state.checkpoint.save

    def full_disk(checkpoint: ckpt.Checkpoint) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(state.checkpoint, "save", full_disk)
    out = await state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-0")])),
                                    (REF_B, claim(B, name="b", results=[result("gpu-1")]))))
    assert "No space left" in (out[A].error or "")
    assert out[B].error is None and out[B].claim is not None  # already prepared: still answered
    assert set(ckpt.load(state.checkpoint_path, "boot-1")[0].claims) == {B} and state.cdi.claim_uids() == {B}
    monkeypatch.setattr(state.checkpoint, "save", real_save)
    out = await state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-0")]))))
    assert out[A].error is None and state.prepared_count == 2


async def test_a_call_cancelled_while_a_peer_holds_the_node_lock_leaves_no_lock_behind(tmp_path: Path) -> None:
    """The agent shutting down, or the kubelet giving up, while a call waits for a peer instance:
    the calls after it are not blocked by it."""
    import asyncio

    from gpudra_driver.plugin.locking import node_lock
    from gpudra_dev.localcluster.waiting import wait_for

    state = make(tmp_path)
    with node_lock(state.locks.path):  # a peer instance
        waiting = asyncio.ensure_future(state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-0")])))))
        queued = asyncio.ensure_future(state.prepare(items((REF_B, claim(B, name="b", results=[result("gpu-1")])))))

        async def both_wait() -> bool:
            return state.locks.in_turn and not waiting.done() and not queued.done()

        await wait_for(both_wait, timeout=10, what="both calls to wait for the peer")
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not queued.done()  # still behind the peer, not behind the cancelled call
    assert (await asyncio.wait_for(queued, 10))[B].error is None
    assert state.locks.busy_for() == 0 and not state.locks.in_turn
    assert set(ckpt.load(state.checkpoint_path, "boot-1")[0].claims) == {B}


async def test_calls_queued_behind_one_are_done_as_one_batch_even_if_its_taker_is_cancelled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a call waits for a peer, the calls queued behind it are taken together by the next to
    get its turn; cancelling that one (its kubelet call gone) still leaves the others done."""
    import asyncio
    import time

    from gpudra_driver.plugin.locking import node_lock
    from gpudra_dev.localcluster.waiting import wait_for

    state = make(tmp_path)
    C = "0c1d2e3f-0000-4000-8000-00000000000c"
    saves = noting_saves(state, monkeypatch)
    peer = node_lock(state.locks.path)
    peer.__enter__()  # a peer instance holds the node
    try:
        first = asyncio.ensure_future(state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-0")]))),
                                                    deadline=time.monotonic() + 0.5))
        taker = asyncio.ensure_future(state.prepare(items((REF_B, claim(B, name="b", results=[result("gpu-1")])))))
        queued = asyncio.ensure_future(state.prepare(items((ClaimRef("ns", "c", C),
                                                            claim(C, name="c", results=[result("gpu-2")])))))

        async def all_wait() -> bool:
            return state.queue.waiting == 2

        await wait_for(all_wait, timeout=10, what="two calls queued behind the first")
        assert "held by another agent instance" in ((await asyncio.wait_for(first, 10))[A].error or "")

        async def taken() -> bool:
            return not state.queue.waiting  # the taker has both queued calls in its batch

        await wait_for(taken, timeout=10, what="the next call to take the queued ones")
        taker.cancel()
        with pytest.raises(asyncio.CancelledError):
            await taker
    finally:
        peer.__exit__(None, None, None)
    assert (await asyncio.wait_for(queued, 10))[C].error is None
    assert set(ckpt.load(state.checkpoint_path, "boot-1")[0].claims) == {C}
    assert await state.unprepare([ClaimRef("ns", "c", C)]) == {C: None}
    # Behind a running call, two queued calls are one batch: one commit (plain claims: no PrepareStarted).
    del saves[:]
    with node_lock(state.locks.path):
        running = asyncio.ensure_future(state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-0")])))))
        behind = [asyncio.ensure_future(state.prepare(items((ref, claim(ref.uid, name=ref.name, results=[result(g)])))))
                  for ref, g in ((REF_B, "gpu-1"), (ClaimRef("ns", "c", C), "gpu-2"))]
        await wait_for(all_wait, timeout=10, what="two calls queued behind a running one")
    outs = await asyncio.wait_for(asyncio.gather(running, *behind), 10)
    assert [out[uid].error for out, uid in zip(outs, (A, B, C))] == [None, None, None]
    assert saves == [{A}, {A, B, C}]  # A alone, then B and C together


async def test_a_batch_takes_the_calls_still_reading_their_claims_waiting_only_for_those_and_only_so_long(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Group commit with siblings only: a call about to start its batch waits for the calls that
    have arrived and are still reading their claims (their GETs in flight), and they commit
    together; the wait ends at the queue's gather limit even if a read never ends; a call with no
    sibling reading never waits at all."""
    import asyncio
    import time

    state = make(tmp_path)
    saves = noting_saves(state, monkeypatch)
    state.queue.gather_limit = 30.0  # far beyond the test: only B's arrival can end A's wait
    b_read = asyncio.Event()

    async def b_call() -> dict[str, Any]:
        with state.queue.reading_claims():  # as the plugin does around a call's claim GETs
            await b_read.wait()
        return await state.prepare(items((REF_B, claim(B, name="b", results=[result("gpu-1")]))))

    b = asyncio.ensure_future(b_call())
    a = asyncio.ensure_future(state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-0")])))))
    from gpudra_dev.localcluster.waiting import wait_for

    async def a_queued() -> bool:
        return state.queue.waiting == 1  # A has its turn and waits for B (or has gone on alone)

    await wait_for(a_queued, timeout=10, what="A to queue up")
    b_read.set()
    out_a, out_b = await asyncio.wait_for(asyncio.gather(a, b), 10)
    assert out_a[A].error is None and out_b[B].error is None
    assert saves == [{A, B}]  # one commit for both
    assert await state.unprepare([REF_A, REF_B]) == {A: None, B: None}

    # a read that never ends holds a batch up for the gather limit, no longer
    state.queue.gather_limit = 0.3
    del saves[:]
    with state.queue.reading_claims():
        started = time.monotonic()
        out = await asyncio.wait_for(state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-0")])))), 10)
        waited = time.monotonic() - started
    assert out[A].error is None and saves == [{A}]
    assert 0.3 <= waited < 5, waited
    assert await state.unprepare([REF_A]) == {A: None}

    # nobody reading: no wait at all
    state.queue.gather_limit = 30.0
    out = await asyncio.wait_for(state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-0")])))), 10)
    assert out[A].error is None


class ThreadAt(FaultHook):
    """Notes the thread each of its points runs on."""

    def __init__(self) -> None:
        super().__init__("")
        self.threads: dict[str, int] = {}

    def __call__(self, point: str) -> None:
        self.threads[point] = threading.get_ident()


@pytest.mark.parametrize("kind", ["plain", "time-sliced"])
async def test_a_batch_goes_to_a_thread_only_when_it_may_call_into_the_driver(tmp_path: Path, kind: str) -> None:
    """Plain claims are written on the event loop even while other calls are reading theirs (on a
    thread each system call handed the GIL to the loop and back: more CPU per claim under load,
    bench/README.md); a claim whose sharing settings call into the driver, which can block, goes
    to a thread."""
    hook = ThreadAt()
    state = make(tmp_path, fault=hook, gpu_control=RecordingControl())
    state.queue.gather_limit = 0.0  # the sibling below never finishes reading: no wait for it
    obj = claim(A, name="a", results=[result("gpu-2")]) if kind == "plain" else sliced(A, "a", "gpu-2")
    with state.queue.reading_claims():  # another call's GETs in flight
        assert (await state.prepare(items((REF_A, obj))))[A].error is None
    on_loop = hook.threads["after-cdi-write"] == threading.get_ident()
    assert on_loop == (kind == "plain")


@pytest.mark.parametrize("kind", ["plain", "time-sliced"])  # one checkpoint write, or two phases
@pytest.mark.parametrize("point", [p for p in POINTS if not p.startswith("unprepare")  # dynamic MIG's below:
                                   and p not in ("after-mig-instance", "after-mig-mode-off")])  # test_mig_*.py
async def test_a_crash_anywhere_in_prepare_loses_nothing_and_leaves_nothing(tmp_path: Path, point: str,
                                                                            kind: str) -> None:
    control = RecordingControl()
    state = make(tmp_path, gpu_control=control)
    await state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-0")]))))

    def claim_b() -> dict[str, Any]:
        return claim(B, name="b", results=[result("gpu-1")]) if kind == "plain" else sliced(B, "b", "gpu-1")

    state.fault.arm(point)
    if kind == "plain" and point == "after-checkpoint-started":  # one write: no such step to crash in
        assert (await state.prepare(items((REF_B, claim_b()))))[B].error is None
        assert ckpt.load(state.checkpoint_path, "boot-1")[0].claims[B].state == ckpt.COMPLETED
        return
    with pytest.raises(Crash):
        await state.prepare(items((REF_B, claim_b())))
    if kind == "plain" and point == "after-cdi-write":  # the spec is there, nothing names it yet
        assert state.cdi.claim_uids() == {A, B} and set(ckpt.load(state.checkpoint_path, "boot-1")[0].claims) == {A}
    if point == "after-metadata-write":  # B's files are there, its spec is not
        assert (metadata_dir(tmp_path / "cdi", DRIVER) / f"{B}_gpu.json").is_file() and not state.cdi.exists(B)
    restarted = make(tmp_path, gpu_control=control)  # a new agent instance: start-up reconciliation
    # the writers' temp and scratch files are gone too: a crash may have left them half-written
    assert sorted(os.listdir(tmp_path / "plugin")) == ["checkpoint.json", "serialize.lock"]
    claims = ckpt.load(restarted.checkpoint_path, "boot-1")[0].claims
    # device metadata: the files of the claims kept, none of the others, no temp file
    assert sorted(os.listdir(metadata_dir(tmp_path / "cdi", DRIVER))) == sorted(f"{uid}_gpu.json" for uid in claims)
    prepared_b = point == "after-checkpoint-completed"  # B completed before the crash: kept
    assert set(claims) == ({A, B} if prepared_b else {A})
    assert all(e.state == ckpt.COMPLETED for e in claims.values())
    assert restarted.cdi.claim_uids() == set(claims)  # no orphan spec, no missing one
    assert not [n for n in os.listdir(tmp_path / "cdi") if n.startswith(".")]  # no temp files
    if kind == "time-sliced":  # the GPU's setting: kept with a committed claim, undone otherwise
        assert control.applied[-1] == (gpu_uuid("gpu-1"), 0, 3 if prepared_b else 0)
    out = await restarted.prepare(items((REF_B, claim_b())))
    assert out[B].error is None and restarted.cdi.claim_uids() == {A, B}
    for uid in (A, B):
        load_and_validate(restarted.cdi.spec_path(uid))
        assert (metadata_dir(tmp_path / "cdi", DRIVER) / f"{uid}_gpu.json").is_file()


async def test_a_crash_in_unprepare_leaves_no_orphan_after_restart(tmp_path: Path) -> None:
    state = make(tmp_path)
    await state.prepare(items((REF_A, claim(A, name="a"))))
    state.fault.arm("unprepare-after-checkpoint")
    with pytest.raises(Crash):
        await state.unprepare([REF_A])
    assert spec_files(tmp_path)  # the spec outlived the crash...
    restarted = make(tmp_path)
    assert spec_files(tmp_path) == []  # ...and start-up removed it
    assert await restarted.unprepare([REF_A]) == {A: None}


async def test_after_a_reboot_everything_prepared_before_is_dropped(tmp_path: Path) -> None:
    await make(tmp_path).prepare(items((REF_A, claim(A, name="a"))))
    rebooted = make(tmp_path, boot="boot-2")
    assert spec_files(tmp_path) == [] and ckpt.load(rebooted.checkpoint_path, "boot-2")[0].claims == {}
    # the old boot's file is replaced at start, so later calls neither re-read nor warn about it again
    assert json.loads(rebooted.checkpoint_path.read_text())["bootID"] == "boot-2"


async def test_a_claim_allocated_anew_replaces_its_devices_spec_and_entry(tmp_path: Path) -> None:
    state = make(tmp_path)
    await state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-0")]))))
    out = await state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-1")]))))
    assert out[A].error is None and [d.device for d in out[A].claim.devices] == ["gpu-1"]
    (name,) = spec_files(tmp_path)
    spec = load_and_validate(tmp_path / "cdi" / name)
    assert [d["name"] for d in spec["devices"]] == [f"{A}-gpu-1", f"{A}_gpu"]  # and its metadata
    saved = ckpt.load(state.checkpoint_path, "boot-1")[0]
    assert [d.device for d in saved.claims[A].claim.devices] == ["gpu-1"] and saved.claims[A].state == ckpt.COMPLETED
    out = await state.prepare(items((REF_B, claim(B, name="b", results=[result("gpu-0")]))))
    assert out[B].error is None  # gpu-0 is free again


async def test_a_lock_held_by_a_peer_past_the_timeout_is_an_error_for_each_claim(tmp_path: Path) -> None:
    import asyncio

    from gpudra_driver.plugin.locking import node_lock

    state = make(tmp_path, lock_timeout=0.2)
    await state.prepare(items((REF_B, claim(B, name="b", results=[result("gpu-1")]))))
    with node_lock(state.locks.path):  # a peer instance holds it (another open file description)
        out = await asyncio.wait_for(state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-0")])),
                                                         (REF_B, claim(B, name="b", results=[result("gpu-1")])))), 10)
        gone = await asyncio.wait_for(state.unprepare([REF_B]), 10)
    for error in (out[A].error, out[B].error, gone[B]):
        assert error and "held by another agent instance for over 0.2s" in error
    assert REF_A.name in (out[A].error or "") and B in (gone[B] or "")
    # nothing changed; once the peer lets go, both calls work
    assert set(ckpt.load(state.checkpoint_path, "boot-1")[0].claims) == {B}
    out = await state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-0")]))))
    assert out[A].error is None and await state.unprepare([REF_B]) == {B: None}


async def test_a_call_queued_behind_a_stuck_peer_waits_for_the_lock_only_within_its_deadline(tmp_path: Path) -> None:
    import asyncio
    import time

    from gpudra_driver.plugin.locking import node_lock

    state = make(tmp_path, lock_timeout=30.0)  # longer than the test would ever wait
    with node_lock(state.locks.path):
        started = time.monotonic()
        out = await asyncio.wait_for(state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-0")]))),
                                                   deadline=time.monotonic() + 0.3), 10)
        gone = await asyncio.wait_for(state.unprepare([REF_A], deadline=time.monotonic() - 1), 10)  # spent
    assert time.monotonic() - started < 5
    assert "held by another agent instance for over 0.3s" in (out[A].error or "")
    assert "held by another agent instance for over 0.0s" in (gone[A] or "")


async def test_a_claim_allocated_anew_that_fails_leaves_neither_old_nor_new_state(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = make(tmp_path)
    await state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-0")]))))
    real_write = state.cdi.write

    def full_disk(claim):  # type: ignore[no-untyped-def]
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(state.cdi, "write", full_disk)
    out = await state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-1")]))))
    assert "No space left" in (out[A].error or "")
    # the old spec (naming gpu-0) is gone with its entry: a retry whose GET fails cannot answer gpu-0
    assert state.cdi.claim_uids() == set() and A not in ckpt.load(state.checkpoint_path, "boot-1")[0].claims
    monkeypatch.setattr(state.cdi, "write", real_write)

    await state.prepare(items((REF_B, claim(B, name="b", results=[result("gpu-2")]))))
    with monkeypatch.context() as patched:
        commit_fails(patched, state, B)
        out = await state.prepare(items((REF_B, claim(B, name="b", results=[result("gpu-3")]))))
    assert "recording the prepared claim failed" in (out[B].error or "")
    assert state.cdi.claim_uids() == set() and ckpt.load(state.checkpoint_path, "boot-1")[0].claims == {}
    retry = await state.prepare(items((REF_B, ClaimError("API down"))))
    assert "API down" in (retry[B].error or "")  # not answered with the old gpu-2


async def test_a_spec_that_cannot_be_removed_after_a_failed_commit_still_rolls_the_checkpoint_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = make(tmp_path)

    def stuck_remove(uid):  # type: ignore[no-untyped-def]
        raise OSError(16, "Device or resource busy")

    commit_fails(monkeypatch, state, A)
    monkeypatch.setattr(state.cdi, "remove", stuck_remove)
    out = await state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-0")]))))
    assert "recording the prepared claim failed" in (out[A].error or "")
    assert ckpt.load(state.checkpoint_path, "boot-1")[0].claims == {}  # rolled back all the same


def corrupt_copies(state: DeviceState) -> list[str]:
    return [n for n in os.listdir(state.plugin_dir) if n.startswith("checkpoint.json.corrupt-")]


@pytest.mark.parametrize("corruption", ["{not json", "checksum"])
async def test_a_checkpoint_corrupted_while_running_is_recovered_in_place_as_at_start_up(
        tmp_path: Path, corruption: str) -> None:
    """No restart needed: the next call sets the file aside and adopts the specs, as a start does."""
    state = make(tmp_path)
    await state.prepare(items((REF_B, claim(B, name="b", results=[result("gpu-1")]))))
    good = state.checkpoint_path.read_bytes()
    state.checkpoint_path.write_bytes(b"{not json" if corruption == "{not json" else good.replace(b"boot-1", b"boot-x"))
    out = await state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-0")]))))
    assert out[A].error is None and state.cdi.claim_uids() == {A, B}
    assert len(corrupt_copies(state)) == 1
    saved = ckpt.load(state.checkpoint_path, "boot-1")[0]
    assert saved.claims[A].state == ckpt.COMPLETED
    # B's spec kept for its running containers and its GPU held, under the name this agent knew it by
    assert dict(saved.adopted) == {B: ((NODE, "gpu-1"),)} and dict(saved.adopted_names) == {B: ("ns", "b")}
    C = "0c1d2e3f-0000-4000-8000-00000000000c"
    out = await state.prepare(items((ClaimRef("ns", "c", C), claim(C, name="c", results=[result("gpu-1")]))))
    assert "already prepared for claim " + B in (out[C].error or "")
    # corrupted again: an unprepare as the first call recovers too
    state.checkpoint_path.write_text("{torn")
    assert await state.unprepare([REF_B]) == {B: None}
    assert state.cdi.claim_uids() == {A} and len(corrupt_copies(state)) == 2
    saved = ckpt.load(state.checkpoint_path, "boot-1")[0]
    assert dict(saved.adopted) == {A: ((NODE, "gpu-0"),)} and dict(saved.adopted_names) == {A: ("ns", "a")}
    assert await state.unprepare([REF_A]) == {A: None}
    assert spec_files(tmp_path) == [] and ckpt.load(state.checkpoint_path, "boot-1")[0] == ckpt.Checkpoint("boot-1")


async def test_a_claim_adopted_while_running_is_released_by_the_leak_sweep_once_gone(tmp_path: Path) -> None:
    """Adopted claims have no entry: the sweep looks them up by the name the agent knew."""
    from gpudra_driver.plugin.sweep import LeakSweeper

    state = make(tmp_path)
    await state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-0")])),
                              (REF_B, claim(B, name="b", results=[result("gpu-1")]))))
    state.checkpoint_path.write_text("{torn")
    assert await state.unprepare([ClaimRef("ns", "x", "0c1d2e3f-0000-4000-8000-0000000000ff")])  # recovers
    assert set(ckpt.load(state.checkpoint_path, "boot-1")[0].adopted) == {A, B}
    live = {("ns", "a"): claim(A, name="a", results=[result("gpu-0")])}  # B was deleted; no unprepare came

    async def get_claim(namespace: str, name: str) -> dict | None:
        return live.get((namespace, name))

    sweeper = LeakSweeper(prepared=state.held_claims, get_claim=get_claim, unprepare=state.unprepare,
                          driver=DRIVER, node=NODE, rate=1000.0)
    assert await sweeper.sweep_once() == []  # the first look only suspects it
    assert await sweeper.sweep_once() == [B]
    assert state.cdi.claim_uids() == {A} and set(ckpt.load(state.checkpoint_path, "boot-1")[0].adopted) == {A}
    out = await state.prepare(items((ClaimRef("ns", "c", "0c1d2e3f-0000-4000-8000-00000000000c"),
                                     claim("0c1d2e3f-0000-4000-8000-00000000000c", name="c",
                                           results=[result("gpu-1")]))))
    assert all(r.error is None for r in out.values())  # B's GPU is free again


async def test_claims_adopted_at_start_have_no_name_and_are_not_looked_up(tmp_path: Path) -> None:
    state = await adopted_a(tmp_path)
    assert state.held_claims() == []


async def test_a_claim_of_unexpected_shape_is_its_own_error(tmp_path: Path) -> None:
    state = make(tmp_path)
    odd = claim(B, name="b", results=[result("gpu-1")])
    odd["status"]["allocation"]["devices"]["results"] = [["not", "a", "mapping"]]
    out = await state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-0")])), (REF_B, odd)))
    assert out[A].error is None and "results[0]: a list is not an object" in (out[B].error or "")
    assert state.cdi.claim_uids() == {A}


async def test_a_corrupt_checkpoint_is_copied_aside_and_specs_are_kept_until_unprepared(tmp_path: Path) -> None:
    state = make(tmp_path)
    await state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-3")]))))
    kept = spec_files(tmp_path)
    state.checkpoint_path.write_text(json.dumps({"version": 1, "claims": {}, "checksum": "sha256:bad"}))
    make(tmp_path)
    assert spec_files(tmp_path) == kept  # a running container may still need it
    assert any(n.startswith("checkpoint.json.corrupt-") for n in os.listdir(tmp_path / "plugin"))
    later = make(tmp_path)  # and the next start (a rolling update, say) keeps it as well
    assert spec_files(tmp_path) == kept
    # its device stays held: nothing else about the claim survived, but its spec names the GPU
    out = await later.prepare(items((REF_B, claim(B, name="b", results=[result("gpu-3")]))))
    assert "already prepared for claim " + A in (out[B].error or "")
    assert await later.unprepare([REF_A]) == {A: None}
    assert spec_files(tmp_path) == [] and ckpt.load(later.checkpoint_path, "boot-1")[0] == ckpt.Checkpoint("boot-1")
    out = await later.prepare(items((REF_B, claim(B, name="b", results=[result("gpu-3")]))))
    assert out[B].error is None


async def test_kept_specs_of_a_corrupt_checkpoint_go_with_a_reboot(tmp_path: Path) -> None:
    state = make(tmp_path)
    await state.prepare(items((REF_A, claim(A, name="a"))))
    state.checkpoint_path.write_text("{torn")
    make(tmp_path)
    assert spec_files(tmp_path)
    make(tmp_path, boot="boot-2")  # a persistent CDI directory (e.g. /etc/cdi) outlives the boot
    assert spec_files(tmp_path) == []



def test_a_crash_of_the_start_that_adopts_the_specs_finds_them_again(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    asyncio.run(make(tmp_path).prepare(items((REF_A, claim(A, name="a", results=[result("gpu-3")])))))
    kept = spec_files(tmp_path)
    (tmp_path / "plugin" / "checkpoint.json").write_text("{torn")

    def full(self: ckpt.CheckpointFile, checkpoint: ckpt.Checkpoint) -> None:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr(ckpt.CheckpointFile, "save", full)
        with pytest.raises(OSError):
            make(tmp_path)  # the agent exits before recording the adoptions; its pod restarts
    make(tmp_path)  # the corrupt file is still there: adopted now
    make(tmp_path)
    assert spec_files(tmp_path) == kept
    assert len([n for n in os.listdir(tmp_path / "plugin") if n.startswith("checkpoint.json.corrupt-")]) >= 1


async def test_an_adopted_claim_whose_prepare_fails_stays_adopted(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    await make(tmp_path).prepare(items((REF_A, claim(A, name="a", results=[result("gpu-3")]))))
    kept = spec_files(tmp_path)
    (tmp_path / "plugin" / "checkpoint.json").write_text("{torn")
    later = make(tmp_path)

    def full(claim: object) -> None:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr(later.cdi, "write", full)
        out = await later.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-3")]))))
    assert "No space left" in (out[A].error or "")
    assert spec_files(tmp_path) == kept and set(ckpt.load(later.checkpoint_path, "boot-1")[0].adopted) == {A}
    out = await later.prepare(items((REF_B, claim(B, name="b", results=[result("gpu-3")]))))
    assert "already prepared for claim " + A in (out[B].error or "")  # its GPU is still held


async def test_a_cdi_directory_unreadable_for_one_start_forgets_no_adoption(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from gpudra_driver.plugin.cdi import CdiDir

    await make(tmp_path).prepare(items((REF_A, claim(A, name="a", results=[result("gpu-3")]))))
    (tmp_path / "plugin" / "checkpoint.json").write_text("{torn")
    make(tmp_path)

    def eio(self: CdiDir) -> set[str]:
        raise OSError(5, "Input/output error")

    with monkeypatch.context() as patched:
        patched.setattr(CdiDir, "claim_uids", eio)
        make(tmp_path)
    make(tmp_path)
    assert spec_files(tmp_path) and set(ckpt.load(tmp_path / "plugin" / "checkpoint.json", "boot-1")[0].adopted) == {A}

async def test_a_kept_spec_prepared_again_gets_an_entry(tmp_path: Path) -> None:
    state = make(tmp_path)
    await state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-3")]))))
    state.checkpoint_path.write_text("{torn")
    later = make(tmp_path)
    out = await later.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-3")]))))
    assert out[A].error is None
    saved = ckpt.load(later.checkpoint_path, "boot-1")[0]
    assert saved.claims[A].state == ckpt.COMPLETED and not saved.adopted
    load_and_validate(later.cdi.spec_path(A))


def test_a_checkpoint_from_a_newer_agent_stops_the_plugin(tmp_path: Path) -> None:
    state = make(tmp_path)
    doc = json.loads(ckpt.encode(ckpt.Checkpoint("boot-1")))
    doc["version"] = 6
    state.checkpoint_path.write_text(json.dumps(doc))
    with pytest.raises(RuntimeError, match="version 6"):
        make(tmp_path)


async def test_start_up_rewrites_a_spec_that_differs_from_the_checkpoint(tmp_path: Path) -> None:
    state = make(tmp_path)
    await state.prepare(items((REF_A, claim(A, name="a"))))
    path = state.cdi.spec_path(A)
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])  # torn by a power loss, say
    make(tmp_path)
    assert path.read_bytes() == good
    load_and_validate(path)


@pytest.mark.parametrize("point", ["after-checkpoint-started", "after-cdi-write"])
async def test_a_live_peer_rolls_back_what_a_crashed_instance_left_half_done(tmp_path: Path, point: str) -> None:
    """A rolling update: two instances on one node, one SIGKILLed mid-prepare of a claim with a
    side effect. The one still running cleans up at its next call instead of leaving the spec,
    the entry and the GPU's setting until a restart."""
    control = RecordingControl()
    live = make(tmp_path, gpu_control=control)
    crashing = make(tmp_path, fault=CrashAt(point), gpu_control=control)
    with pytest.raises(Crash):
        await crashing.prepare(items((REF_A, sliced(A, "a", "gpu-0"))))
    assert ckpt.load(live.checkpoint_path, "boot-1")[0].half_done == (A,)
    out = await live.prepare(items((REF_B, claim(B, name="b", results=[result("gpu-0")]))))
    assert out[B].error is None  # gpu-0 is no longer held by the dead prepare
    saved = ckpt.load(live.checkpoint_path, "boot-1")[0]
    assert {u: e.state for u, e in saved.claims.items()} == {B: ckpt.COMPLETED}
    assert live.cdi.claim_uids() == {B}
    assert not control.applied or control.applied[-1] == (gpu_uuid("gpu-0"), 0, 0)  # its defaults back


async def test_a_live_peer_serves_beside_what_a_crashed_one_write_prepare_left_and_removes_it(tmp_path: Path) -> None:
    """The same with a plain claim: killed between its spec and its commit, it left only a spec no
    entry names. No container can name it (the kubelet got no answer), the device is free; the
    live instance's next unprepare, under the node lock, removes it."""
    live = make(tmp_path)
    crashing = make(tmp_path, fault=CrashAt("after-cdi-write"))
    with pytest.raises(Crash):
        await crashing.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-0")]))))
    assert ckpt.load(live.checkpoint_path, "boot-1")[0].claims == {} and live.cdi.claim_uids() == {A}
    out = await live.prepare(items((REF_B, claim(B, name="b", results=[result("gpu-0")]))))
    assert out[B].error is None
    C = "0c1d2e3f-0000-4000-8000-00000000000c"
    out = await live.prepare(items((ClaimRef("ns", "c", C), claim(C, name="c", results=[result("gpu-1")]))))
    assert out[C].error is None and live.cdi.claim_uids() == {A, B, C}
    assert await live.unprepare([ClaimRef("ns", "c", C)]) == {C: None}
    assert live.cdi.claim_uids() == {B}  # the orphan went with it
    assert set(ckpt.load(live.checkpoint_path, "boot-1")[0].claims) == {B}


async def test_a_live_peers_unprepare_rolls_back_what_a_crashed_instance_left_half_done(tmp_path: Path) -> None:
    live = make(tmp_path)
    await live.prepare(items((REF_B, claim(B, name="b", results=[result("gpu-1")]))))
    crashing = make(tmp_path, fault=CrashAt("after-cdi-write"))
    with pytest.raises(Crash):
        await crashing.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-0")]))))
    assert live.cdi.claim_uids() == {A, B}
    assert await live.unprepare([REF_B]) == {B: None}
    assert ckpt.load(live.checkpoint_path, "boot-1")[0].claims == {} and spec_files(tmp_path) == []


async def test_the_kubelets_retry_through_the_live_peer_prepares_the_claim_afresh(tmp_path: Path) -> None:
    live = make(tmp_path)
    crashing = make(tmp_path, fault=CrashAt("after-cdi-write"))
    with pytest.raises(Crash):
        await crashing.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-0")]))))
    out = await live.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-0")]))))
    assert out[A].error is None and live.cdi.claim_uids() == {A}
    assert ckpt.load(live.checkpoint_path, "boot-1")[0].claims[A].state == ckpt.COMPLETED
    load_and_validate(live.cdi.spec_path(A))


async def test_a_half_done_spec_that_cannot_be_removed_keeps_its_entry_for_a_later_try(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    control = RecordingControl()
    live = make(tmp_path, gpu_control=control)
    crashing = make(tmp_path, fault=CrashAt("after-cdi-write"), gpu_control=control)
    with pytest.raises(Crash):
        await crashing.prepare(items((REF_A, sliced(A, "a", "gpu-0"))))

    def refuse(uid: str) -> bool:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(live.cdi, "remove", refuse)
    out = await live.prepare(items((REF_B, claim(B, name="b", results=[result("gpu-1")]))))
    assert out[B].error is None
    assert ckpt.load(live.checkpoint_path, "boot-1")[0].half_done == (A,)  # not dropped while its spec stays
    monkeypatch.undo()
    await live.unprepare([REF_B])
    assert ckpt.load(live.checkpoint_path, "boot-1")[0].claims == {} and spec_files(tmp_path) == []



async def adopted_a(tmp_path: Path, device: str = "gpu-3") -> DeviceState:
    """A prepared on ``device``, then its checkpoint corrupted: the next instance adopts its spec."""
    await make(tmp_path).prepare(items((REF_A, claim(A, name="a", results=[result(device)]))))
    (tmp_path / "plugin" / "checkpoint.json").write_text("{torn")
    return make(tmp_path)


def adopted(state: DeviceState) -> dict[str, tuple[tuple[str, str], ...]]:
    return dict(ckpt.load(state.checkpoint_path, "boot-1")[0].adopted)


def unreadable(patched: pytest.MonkeyPatch, path: Path) -> None:
    """Reading ``path`` fails with EIO (a failing disk sector, say)."""
    read = Path.read_bytes

    def failing(self: Path) -> bytes:
        if self == path:
            raise OSError(5, "Input/output error")
        return read(self)

    patched.setattr(Path, "read_bytes", failing)


@pytest.mark.parametrize("point", ["after-checkpoint-started", "after-cdi-write"])
@pytest.mark.parametrize("device", ["gpu-3", "gpu-4"])  # the same GPU, or allocated anew
async def test_a_crash_while_an_adopted_claim_is_prepared_again_keeps_it_adopted(tmp_path: Path, point: str,
                                                                                 device: str) -> None:
    crashing = await adopted_a(tmp_path)
    crashing.fault.arm(point)
    with pytest.raises(Crash):
        await crashing.prepare(items((REF_A, claim(A, name="a", results=[result(device)]))))
    restarted = make(tmp_path)
    on_disk = "gpu-3" if point == "after-checkpoint-started" else device  # what its spec names now
    assert restarted.cdi.claim_uids() == {A} and adopted(restarted) == {A: ((NODE, on_disk),)}
    out = await restarted.prepare(items((REF_B, claim(B, name="b", results=[result(on_disk)]))))
    assert "already prepared for claim " + A in (out[B].error or "")


async def test_a_live_peer_keeps_an_adopted_claim_a_crashed_instance_was_preparing_again(tmp_path: Path) -> None:
    live = await adopted_a(tmp_path)
    crashing = make(tmp_path, fault=CrashAt("after-cdi-write"))
    with pytest.raises(Crash):
        await crashing.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-4")]))))
    out = await live.prepare(items((REF_B, claim(B, name="b", results=[result("gpu-3")]))))
    assert out[B].error is None  # gpu-3 is free: A's spec names gpu-4 now
    assert live.cdi.claim_uids() == {A, B} and adopted(live) == {A: ((NODE, "gpu-4"),)}
    c_uid = "0c1d2e3f-0000-4000-8000-00000000000c"
    out = await live.prepare(items((ClaimRef("ns", "c", c_uid), claim(c_uid, name="c", results=[result("gpu-4")]))))
    assert "already prepared for claim " + A in (out[c_uid].error or "")


async def test_an_adopted_claim_allocated_anew_whose_commit_fails_holds_what_its_spec_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    later = await adopted_a(tmp_path)

    with monkeypatch.context() as patched:
        commit_fails(patched, later, A)
        out = await later.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-4")]))))
    assert "Input/output error" in (out[A].error or "")
    assert later.cdi.claim_uids() == {A} and adopted(later) == {A: ((NODE, "gpu-4"),)}
    out = await later.prepare(items((REF_B, claim(B, name="b", results=[result("gpu-4")]))))
    assert "already prepared for claim " + A in (out[B].error or "")


def test_a_corrupt_checkpoint_with_an_unreadable_cdi_directory_stops_the_start_and_loses_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from gpudra_driver.plugin.cdi import CdiDir

    asyncio.run(make(tmp_path).prepare(items((REF_A, claim(A, name="a", results=[result("gpu-3")])))))
    kept = spec_files(tmp_path)
    (tmp_path / "plugin" / "checkpoint.json").write_text("{torn")

    def eio(self: CdiDir) -> set[str]:
        raise OSError(5, "Input/output error")

    with monkeypatch.context() as patched:
        patched.setattr(CdiDir, "claim_uids", eio)
        with pytest.raises(RuntimeError, match="cannot tell which specs"):
            make(tmp_path)  # the agent exits; its pod restarts
    later = make(tmp_path)
    assert spec_files(tmp_path) == kept and adopted(later) == {A: ((NODE, "gpu-3"),)}


async def test_a_half_done_prepare_of_an_adopted_claim_found_without_a_listing_holds_both_gpus(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpudra_driver.plugin.cdi import CdiDir

    crashing = await adopted_a(tmp_path)  # A's spec names gpu-3
    crashing.fault.arm("after-cdi-write")
    with pytest.raises(Crash):  # allocated anew: its spec now names gpu-4
        await crashing.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-4")]))))

    def eio(self: CdiDir) -> set[str]:
        raise OSError(5, "Input/output error")

    with monkeypatch.context() as patched:
        patched.setattr(CdiDir, "claim_uids", eio)
        restarted = make(tmp_path)  # cannot tell which one the spec names now: holds both
    assert adopted(restarted) == {A: ((NODE, "gpu-3"), (NODE, "gpu-4"))}
    for device in ("gpu-3", "gpu-4"):
        out = await restarted.prepare(items((REF_B, claim(B, name="b", results=[result(device)]))))
        assert "already prepared for claim " + A in (out[B].error or "")
    assert adopted(make(tmp_path)) == {A: ((NODE, "gpu-4"),)}  # read again at the next start


async def test_an_adopted_spec_that_cannot_be_read_keeps_the_devices_recorded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    later = await adopted_a(tmp_path)
    with monkeypatch.context() as patched:
        unreadable(patched, later.cdi.spec_path(A))
        restarted = make(tmp_path)
    assert adopted(restarted) == {A: ((NODE, "gpu-3"),)}
    out = await restarted.prepare(items((REF_B, claim(B, name="b", results=[result("gpu-3")]))))
    assert "already prepared for claim " + A in (out[B].error or "")


@pytest.mark.parametrize("body", ["{}", '{"claims": {}}', '{"version": null}', '{"version": "2"}', '{"version": 0}'])
async def test_a_checkpoint_without_a_valid_version_is_corrupt_not_newer(tmp_path: Path, body: str) -> None:
    await make(tmp_path).prepare(items((REF_A, claim(A, name="a", results=[result("gpu-3")]))))
    (tmp_path / "plugin" / "checkpoint.json").write_text(body)
    assert adopted(make(tmp_path)) == {A: ((NODE, "gpu-3"),)}  # adopted, not "written by a newer agent"


async def test_a_corrupt_checkpoint_with_an_unreadable_spec_stops_the_start_and_loses_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = make(tmp_path)
    await first.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-3")]))))
    (tmp_path / "plugin" / "checkpoint.json").write_text("{torn")
    with monkeypatch.context() as patched:
        unreadable(patched, first.cdi.spec_path(A))
        with pytest.raises(RuntimeError, match="cannot tell which devices"):
            make(tmp_path)  # the agent exits; its pod restarts
    assert adopted(make(tmp_path)) == {A: ((NODE, "gpu-3"),)}


# -- GPU sharing settings (TimeSlicing): applied with the prepare, undone with the last claim ------

class RecordingControl:
    """Stands in for gpucontrol.GpuControl (the NVML and nvidia-smi calls are tested against the
    mock library and binaries in the integration tests): records what would be applied."""

    def __init__(self, fail_for: set[str] | None = None) -> None:
        self.applied: list[tuple[str, int, int]] = []
        self.fail_for = fail_for or set()

    def apply(self, uuid: str, settings) -> None:  # type: ignore[no-untyped-def]
        from gpudra_driver.plugin.sharing.apply import GpuControlError

        if uuid in self.fail_for:
            raise GpuControlError(f"GPU {uuid}: nvidia-smi compute-policy exited 3: Insufficient Permissions")
        self.applied.append((uuid, settings.compute_mode, settings.timeslice))


def sliced(uid: str, name: str, device: str, interval: str = "Long", **extra):  # type: ignore[no-untyped-def]
    obj = claim(uid, name=name, results=[result(device, **extra)])
    obj["status"]["allocation"]["devices"]["config"] = [{
        "source": "FromClaim", "requests": ["gpu"],
        "opaque": {"driver": DRIVER, "parameters": {"apiVersion": "gpudra.io/v1alpha1", "kind": "GpuConfig",
                                                    "sharing": {"strategy": "TimeSlicing",
                                                                "timeSlicing": {"interval": interval}}}}}]
    return obj


def gpu_uuid(name: str) -> str:
    return devices()[name].uuid


async def test_time_slicing_is_set_with_the_prepare_and_reset_with_the_last_claim(tmp_path: Path) -> None:
    control = RecordingControl()
    state = make(tmp_path, gpu_control=control)
    out = await state.prepare(items((REF_A, sliced(A, "a", "gpu-2", shareID="s-a", consumedCapacity={"memory": "10Gi"}))))
    assert out[A].error is None and out[A].claim.devices[0].sharing.timeslice == 3
    assert control.applied == [(gpu_uuid("gpu-2"), 0, 3)]
    saved = ckpt.load(state.checkpoint_path, "boot-1")[0]
    assert saved.claims[A].claim.devices[0].sharing.strategy == "TimeSlicing"  # survives a restart
    # a second share of the same GPU with the same interval: nothing more to set
    out = await state.prepare(items((REF_B, sliced(B, "b", "gpu-2", shareID="s-b", consumedCapacity={"memory": "10Gi"}))))
    assert out[B].error is None and len(control.applied) == 1
    # one with another interval would change the GPU under the first: refused
    C = "0c1d2e3f-0000-4000-8000-00000000000c"
    out = await state.prepare(items((ClaimRef("ns", "c", C), sliced(C, "c", "gpu-2", "Short", shareID="s-c",
                                                                    consumedCapacity={"memory": "10Gi"}))))
    assert "already runs GPU gpu-2 with time slice 3; this claim asks for time slice 1" in (out[C].error or "")
    await state.unprepare([REF_A])
    assert len(control.applied) == 1  # B still time-slices the GPU
    await state.unprepare([REF_B])
    assert control.applied[-1] == (gpu_uuid("gpu-2"), 0, 0)  # the last one gone: defaults back


async def test_a_gpu_that_cannot_be_set_fails_only_its_claim_and_nothing_stays(tmp_path: Path) -> None:
    control = RecordingControl(fail_for={gpu_uuid("gpu-1")})
    state = make(tmp_path, gpu_control=control)
    out = await state.prepare(items((REF_A, sliced(A, "a", "gpu-1")), (REF_B, sliced(B, "b", "gpu-4"))))
    assert "Insufficient Permissions" in (out[A].error or "") and out[B].error is None
    assert set(ckpt.load(state.checkpoint_path, "boot-1")[0].claims) == {B} and state.cdi.claim_uids() == {B}
    assert control.applied == [(gpu_uuid("gpu-4"), 0, 3)]


async def test_time_slicing_a_mig_device_or_mps_without_its_supervisor_is_refused_with_a_reason(tmp_path: Path) -> None:
    from gpudra_driver.plugin.devicenodes import NodeDevice

    control = RecordingControl()
    state = make(tmp_path, gpu_control=control)
    mig = dict(state.devices or {})
    mig["gpu-3"] = NodeDevice("gpu-3", "MIG-0000", ("/dev/nvidia3",), kind="mig")
    state.set_devices(mig)
    out = await state.prepare(items((REF_A, sliced(A, "a", "gpu-3"))))
    assert "is a MIG device: time-slicing applies to full GPUs" in (out[A].error or "")
    bad = sliced(B, "b", "gpu-4")
    bad["status"]["allocation"]["devices"]["config"][0]["opaque"]["parameters"]["sharing"]["timeSlicing"] = {"interval": 7}
    out = await state.prepare(items((REF_B, bad)))
    assert "sharing.timeSlicing.interval" in (out[B].error or "")  # names the field
    mps = sliced(B, "b", "gpu-4")
    mps["status"]["allocation"]["devices"]["config"][0]["opaque"]["parameters"]["sharing"] = {
        "strategy": "MPS", "mps": {"activeThreadPercentage": 50, "perDevice": {"gpu-4": {"pinnedMemoryLimit": "1Gi"}}}}
    out = await state.prepare(items((REF_B, mps)))
    assert "the MPS supervisor is not running on this node" in (out[B].error or "")
    # EXCLUSIVE_PROCESS for the daemon, then DEFAULT again when the daemon could not be had
    assert control.applied[-2:] == [(gpu_uuid("gpu-4"), 3, 0), (gpu_uuid("gpu-4"), 0, 0)]
    assert B not in ckpt.load(state.checkpoint_path, "boot-1")[0].claims


@pytest.mark.parametrize("point", ["after-checkpoint-started", "after-cdi-write"])
async def test_a_crash_after_setting_a_gpu_is_undone_at_the_next_start(tmp_path: Path, point: str) -> None:
    control = RecordingControl()
    state = make(tmp_path, fault=CrashAt(point), gpu_control=control)
    if point == "after-checkpoint-started":
        # the settings come after this point: the crash leaves nothing set, and nothing to undo
        with pytest.raises(Crash):
            await state.prepare(items((REF_A, sliced(A, "a", "gpu-5"))))
        assert control.applied == []
        return
    with pytest.raises(Crash):
        await state.prepare(items((REF_A, sliced(A, "a", "gpu-5"))))
    assert control.applied == [(gpu_uuid("gpu-5"), 0, 3)]
    restarted = DeviceState(tmp_path / "plugin", state.cdi, driver=DRIVER, node=NODE, boot_id="boot-1",
                            gpu_control=control)  # type: ignore[arg-type]
    restarted.recover()
    assert control.applied[-1] == (gpu_uuid("gpu-5"), 0, 0) and restarted.cdi.claim_uids() == set()


async def test_a_crash_between_unprepare_and_the_reset_is_reset_at_the_next_start(tmp_path: Path) -> None:
    control = RecordingControl()
    state = make(tmp_path, gpu_control=control)
    assert (await state.prepare(items((REF_A, sliced(A, "a", "gpu-6")))))[A].error is None
    assert ckpt.load(state.checkpoint_path, "boot-1")[0].touched == {gpu_uuid("gpu-6")}
    state.fault.arm("unprepare-after-checkpoint")
    with pytest.raises(Crash):  # the entry is gone from the file, the GPU not reset yet
        await state.unprepare([REF_A])
    assert control.applied[-1] == (gpu_uuid("gpu-6"), 0, 3)
    restarted = DeviceState(tmp_path / "plugin", state.cdi, driver=DRIVER, node=NODE, boot_id="boot-1",
                            gpu_control=control)  # type: ignore[arg-type]
    restarted.recover()
    assert control.applied[-1] == (gpu_uuid("gpu-6"), 0, 0)
    assert ckpt.load(restarted.checkpoint_path, "boot-1")[0].touched == frozenset()


async def test_a_reset_that_fails_stays_recorded_and_the_next_start_does_it(tmp_path: Path) -> None:
    control = RecordingControl()
    state = make(tmp_path, gpu_control=control)
    both = items((REF_A, sliced(A, "a", "gpu-6")), (REF_B, sliced(B, "b", "gpu-7", "Short")))
    assert {u: r.error for u, r in (await state.prepare(both)).items()} == {A: None, B: None}
    touched = {gpu_uuid("gpu-6"), gpu_uuid("gpu-7")}
    saved = ckpt.load(state.checkpoint_path, "boot-1")[0]
    assert saved.touched == touched and ckpt.decode(ckpt.encode(saved)) == saved
    control.fail_for = {gpu_uuid("gpu-6")}  # the driver refuses the reset
    assert await state.unprepare([REF_A, REF_B]) == {A: None, B: None}  # the pods still go away
    assert ckpt.load(state.checkpoint_path, "boot-1")[0].touched == {gpu_uuid("gpu-6")}  # gpu-7 reset
    control.fail_for = set()
    restarted = DeviceState(tmp_path / "plugin", state.cdi, driver=DRIVER, node=NODE, boot_id="boot-1",
                            gpu_control=control)  # type: ignore[arg-type]
    restarted.recover()
    assert control.applied[-1] == (gpu_uuid("gpu-6"), 0, 0)
    assert ckpt.load(restarted.checkpoint_path, "boot-1")[0].touched == frozenset()


async def test_a_bad_claim_costs_its_neighbours_nothing_in_its_call_and_in_concurrent_calls(tmp_path: Path) -> None:
    """Claims beyond the API's bounds are refused before any lock, each with its own error naming
    the field: the good claims beside them and the calls queued behind them go on in normal time."""
    import asyncio
    import time

    state = make(tmp_path)
    C = "0c1d2e3f-0000-4000-8000-00000000000c"
    D = "0c1d2e3f-0000-4000-8000-00000000000d"
    huge = claim(C, name="c", results=[result("gpu-5", shareID=A, consumedCapacity={"memory": "1e300000"})])
    padded = claim(D, name="d", results=[result("gpu-6")])
    padded["status"]["allocation"]["devices"]["config"] = [
        {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {"x": ["y" * 100] * 1000}}}]
    started = time.perf_counter()
    out, behind = await asyncio.wait_for(asyncio.gather(
        state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-0")])),
                            (ClaimRef("ns", "c", C), huge), (ClaimRef("ns", "d", D), padded))),
        state.prepare(items((REF_B, claim(B, name="b", results=[result("gpu-1")]))))), 10)
    elapsed = time.perf_counter() - started
    assert out[A].error is None and behind[B].error is None
    assert "results[0].consumedCapacity.memory: '1e300000'" in (out[C].error or "")
    assert "config[0].opaque.parameters: over 10240 bytes" in (out[D].error or "")
    assert elapsed < 0.5, f"{elapsed:.2f}s"
    assert state.cdi.claim_uids() == {A, B}


async def test_recovering_a_corrupt_checkpoint_in_place_keeps_the_mps_daemons_of_the_adopted_claims(
        tmp_path: Path) -> None:
    """Claims adopted from a corrupt checkpoint are still held by their pods: the daemon spec of
    one that had an MPS daemon stays (the supervisor keeps it running) until it is unprepared."""
    from gpudra_driver.plugin.sharing.mps.plan import DaemonSpec

    state = make(tmp_path)
    await state.prepare(items((REF_B, claim(B, name="b", results=[result("gpu-1")]))))
    spec = state.plugin_dir / "mps" / B / "daemon.json"  # B's daemon, as the agent wrote it for an MPS claim
    spec.parent.mkdir(parents=True)
    spec.write_bytes(DaemonSpec(B, ("GPU-1",)).encode())
    state.checkpoint_path.write_bytes(b"{not json")
    out = await state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-0")]))))
    assert out[A].error is None and len(corrupt_copies(state)) == 1 and B in state.cdi.claim_uids()
    assert spec.exists(), "the adopted claim's MPS daemon spec was removed: the supervisor would stop it"
    assert await state.unprepare([REF_B]) == {B: None}
    assert not spec.exists()  # unprepared: now it goes


async def test_the_mps_restart_reports_go_on_through_a_corrupt_checkpoint(tmp_path: Path) -> None:
    """The agent's restart-report task outlives a failure to read the prepared claims (a
    checkpoint corrupted under it): the agent recovers in place instead of exiting."""
    import asyncio

    from gpudra_driver.plugin.sharing.mps.plan import STATUS_FILE, DaemonSpec
    from gpudra_driver.plugin.sharing.mps.apply import watch_daemons
    from gpudra_dev.localcluster.waiting import wait_for

    state = make(tmp_path)
    await state.prepare(items((REF_B, claim(B, name="b", results=[result("gpu-1")]))))
    base = state.plugin_dir / "mps" / B
    base.mkdir(parents=True)
    (base / "daemon.json").write_bytes(DaemonSpec(B, ("GPU-1",)).encode())
    restarts = 0

    def restarted() -> None:  # as the supervisor reports a restart of B's daemon
        nonlocal restarts
        restarts += 1
        (base / STATUS_FILE).write_text(json.dumps({"state": "Ready", "restarts": restarts}))

    reported: list[str] = []

    async def report(kind: str, reason: str, message: str) -> None:
        reported.append(message)

    failures: list[Exception] = []

    def claims() -> list[Any]:
        try:
            return list(state.prepared_claims())
        except Exception as error:
            failures.append(error)
            raise

    task = asyncio.create_task(watch_daemons(state.sharing.mps, claims, report, interval=0.01))
    try:
        state.checkpoint_path.write_bytes(b"{not json")  # prepared_claims() now raises

        async def met(seen: list[Any]) -> bool:
            restarted()  # a restart each look: the task reports it, and reads the claims to name it
            return bool(seen)

        await wait_for(lambda: met(failures), timeout=10, what="the task to meet the corrupt checkpoint")
        assert isinstance(failures[0], ckpt.CheckpointError) and not task.done()
        await state.prepare(items((REF_A, claim(A, name="a", results=[result("gpu-0")]))))  # recovered in place
        await wait_for(lambda: met(reported), timeout=10, what="a restart reported after the recovery")
        assert B in reported[-1] and not task.done()
    finally:
        task.cancel()


class BlockAt(FaultHook):
    """Holds the locked step at its point (on the worker thread it runs on) until released."""

    def __init__(self, point: str) -> None:
        super().__init__(point)
        self.reached, self.release = threading.Event(), threading.Event()

    def __call__(self, point: str) -> None:
        if point == self.point:
            self.reached.set()
            assert self.release.wait(10), "never released"


def node_lock_is_free(state: DeviceState) -> bool:
    try:
        with node_lock(state.locks.path, timeout=0.0):  # one try, as a peer instance would
            return True
    except LockTimeout:
        return False


@pytest.mark.parametrize("call", ["prepare", "unprepare"])
async def test_a_call_cancelled_while_its_locked_step_runs_on_a_thread_holds_the_locks_until_that_step_ends(
        tmp_path: Path, call: str) -> None:
    """The kubelet gives up on a call (its 45 s) whose locked step runs on a worker thread (GPU
    sharing settings): the thread cannot be stopped, so the locks stay held until it is done, even
    when the call is cancelled again meanwhile; until then they were given up at once, and a peer
    instance (or this instance's next call) could change the checkpoint and the specs under it."""
    hook = BlockAt("after-cdi-write" if call == "prepare" else "unprepare-after-checkpoint")
    state = make(tmp_path, fault=hook, gpu_control=RecordingControl())
    if call == "unprepare":
        assert (await state.prepare(items((REF_A, sliced(A, "a", "gpu-2")))))[A].error is None
    task = asyncio.ensure_future(state.prepare(items((REF_A, sliced(A, "a", "gpu-2")))) if call == "prepare"
                                 else state.unprepare([REF_A]))
    try:
        assert await asyncio.to_thread(hook.reached.wait, 10)
        for _ in range(2):  # a second cancel (a timeout around the call, a shutdown) changes nothing
            task.cancel()
            for _ in range(3):  # the cancellation delivered: the call no longer waits for its answer
                await asyncio.sleep(0)
            assert not task.done() and not node_lock_is_free(state) and state.locks.in_turn
    finally:
        hook.release.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    assert node_lock_is_free(state) and not state.locks.in_turn
    # the step went to its end: the prepare committed, the unprepare removed the spec too
    claims = ckpt.load(state.checkpoint_path, "boot-1")[0].claims
    if call == "prepare":
        assert claims[A].state == ckpt.COMPLETED and state.cdi.exists(A)
    else:
        assert claims == {} and not state.cdi.exists(A)


async def test_the_calls_batched_with_a_cancelled_one_are_batched_again(tmp_path: Path) -> None:
    """A batch whose leading call is cancelled while on a thread: the calls it carried, not
    answered, queue up again as one batch, and each gets its answer."""
    hook = BlockAt("after-cdi-write")
    state = make(tmp_path, fault=hook, gpu_control=RecordingControl())
    state.queue.gather_limit = 30.0
    c_ref = ClaimRef("ns", "c", "0c1d2e3f-0000-4000-8000-00000000000c")
    with state.queue.reading_claims():  # A waits for B and C to queue up, then takes both
        leader = asyncio.ensure_future(state.prepare(items((REF_A, sliced(A, "a", "gpu-2")))))

        async def a_waits() -> bool:
            return state.queue.waiting == 1

        from gpudra_dev.localcluster.waiting import wait_for
        await wait_for(a_waits, timeout=10, what="A to wait for its batch")
        b = asyncio.ensure_future(state.prepare(items((REF_B, claim(B, name="b", results=[result("gpu-3")])))))
        c = asyncio.ensure_future(state.prepare(items((c_ref, claim(c_ref.uid, name="c", results=[result("gpu-4")])))))

        async def all_queued() -> bool:
            return state.queue.waiting == 3

        await wait_for(all_queued, timeout=10, what="B and C to queue up")
    try:
        assert await asyncio.to_thread(hook.reached.wait, 10)  # A's batch (A, B, C) on the thread
        hook.point = None  # the next batch runs through
        leader.cancel()
    finally:
        hook.release.set()
    batches: list[set[str]] = []
    run_batch = state.queue.prepare_batch

    async def noting_batch(claims, lock_timeout, results):  # type: ignore[no-untyped-def]
        batches.append({ref.uid for ref, _ in claims})
        await run_batch(claims, lock_timeout, results)

    state.queue.prepare_batch = noting_batch
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(leader, 10)
    out_b, out_c = await asyncio.wait_for(asyncio.gather(b, c), 10)
    assert out_b[B].error is None and out_c[c_ref.uid].error is None
    assert batches == [{B, c_ref.uid}]  # together again (answered again: the thread had prepared them)
    claims = ckpt.load(state.checkpoint_path, "boot-1")[0].claims
    assert {A, B, c_ref.uid} <= set(claims) and all(e.state == ckpt.COMPLETED for e in claims.values())
