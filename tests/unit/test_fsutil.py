"""Atomic file replacement: a fresh temp file renamed over the target."""

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
