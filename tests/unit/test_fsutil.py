"""Atomic file replacement: a fresh temp file renamed over the target, or a scratch file exchanged with it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpudra_driver.plugin import fsutil
from gpudra_driver.plugin.fsutil import read_file, write_atomic


def test_write_atomic_replaces_and_leaves_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    write_atomic(path, b"one", mode=0o600)
    inode = path.stat().st_ino
    write_atomic(path, b"two", mode=0o600)
    assert path.read_bytes() == b"two" and os.listdir(tmp_path) == ["f.json"]
    assert path.stat().st_ino != inode  # a new file renamed over the old, never written in place
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_failed_write_leaves_the_old_file_whole_and_no_temp_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "f.json"
    write_atomic(path, b"old")

    def full_disk(fd: int, data: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fsutil.os, "write", full_disk)
    with pytest.raises(OSError, match="No space"):
        write_atomic(path, b"new content")
    monkeypatch.undo()
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["f.json"]


def test_read_file_reads_everything_or_says_missing(tmp_path: Path) -> None:
    big = bytes(range(256)) * 1000  # more than one read
    (tmp_path / "f").write_bytes(big)
    assert read_file(tmp_path / "f") == big and read_file(tmp_path / "missing") is None


def test_write_exchanging_swaps_a_scratch_file_in_and_keeps_the_previous_content_there(tmp_path: Path) -> None:
    path, scratch = tmp_path / "f.json", tmp_path / ".f.json.scratch"
    fsutil.write_exchanging(path, b"first, the longer one", scratch, mode=0o600)  # no file yet: a rename
    assert path.read_bytes() == b"first, the longer one" and not scratch.exists()
    fsutil.write_exchanging(path, b"second", scratch, mode=0o600)
    assert path.read_bytes() == b"second"  # shorter: the scratch was cut to its length, not to zero
    assert scratch.read_bytes() == b"first, the longer one"
    inodes = {path.stat().st_ino, scratch.stat().st_ino}
    fsutil.write_exchanging(path, b"third", scratch, mode=0o600)
    assert path.read_bytes() == b"third" and scratch.read_bytes() == b"second"
    assert {path.stat().st_ino, scratch.stat().st_ino} == inodes  # two files, no inode per write
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_write_that_fails_into_the_scratch_file_leaves_the_target_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, scratch = tmp_path / "f.json", tmp_path / ".f.json.scratch"
    fsutil.write_exchanging(path, b"old", scratch)
    fsutil.write_exchanging(path, b"older", scratch)

    def torn(fd: int, data: object, offset: int) -> int:
        os.write(fd, b"ha")  # part of it written, then the disk fills up (or the agent is killed)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwrite", torn)
    with pytest.raises(OSError, match="No space left"):
        fsutil.write_exchanging(path, b"new content", scratch)
    assert path.read_bytes() == b"older"  # only the scratch file is half-written


def test_write_exchanging_falls_back_to_a_rename_where_the_file_system_cannot_exchange(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, scratch = tmp_path / "f.json", tmp_path / ".f.json.scratch"
    fsutil.write_exchanging(path, b"one", scratch)
    monkeypatch.setattr(fsutil, "exchange", lambda a, b: False)
    fsutil.write_exchanging(path, b"two", scratch)
    assert path.read_bytes() == b"two" and not scratch.exists()


def test_exchange_swaps_two_names_atomically_and_names_a_missing_one(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"A")
    b.write_bytes(b"B")
    assert fsutil.exchange(a, b)  # this machine's ext4/tmpfs and glibc have renameat2
    assert (a.read_bytes(), b.read_bytes()) == (b"B", b"A")
    with pytest.raises(FileNotFoundError):
        fsutil.exchange(a, tmp_path / "missing")
