"""Atomic file replacement: fresh temp file and rename (write_atomic), and the standing scratch
file exchanged into place (swap_in), with its fallback where a file system cannot exchange."""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

import pytest

from gpudra_driver.plugin import fsutil
from gpudra_driver.plugin.fsutil import exchange, read_file, swap_in, write_atomic


def test_write_atomic_replaces_and_leaves_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    write_atomic(path, b"one", mode=0o600)
    write_atomic(path, b"two", fsync=False, sync_dir=False)
    assert path.read_bytes() == b"two" and os.listdir(tmp_path) == ["f.json"]


def test_swap_in_reuses_the_scratch_inode_instead_of_creating_one_per_write(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    inodes = set()
    for i, content in enumerate([b"first", b"a much longer second content", b"3rd"]):
        swap_in(path, content, scratch="spare", mode=0o600, durable=i % 2 == 0)
        assert path.read_bytes() == content  # shorter content than the scratch held: truncated
        inodes |= {(tmp_path / name).stat().st_ino for name in os.listdir(tmp_path)}
    # the first write had nothing to exchange with (the scratch became the file); from then on the
    # same two inodes take turns
    assert len(inodes) == 2
    assert (tmp_path / ".checkpoint.json.spare").read_bytes() == b"a much longer second content"
    assert sorted(os.listdir(tmp_path)) == [".checkpoint.json.spare", "checkpoint.json"]
    assert all((tmp_path / n).stat().st_mode & 0o777 == 0o600 for n in os.listdir(tmp_path))


def refusing_renameat2(code: int):  # type: ignore[no-untyped-def]
    def renameat2(*args):  # type: ignore[no-untyped-def]
        ctypes.set_errno(code)
        return -1
    return renameat2


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP])
def test_swap_in_falls_back_to_rename_where_the_file_system_cannot_exchange(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    monkeypatch.setattr(fsutil, "_renameat2", lambda: refusing_renameat2(code))  # e.g. an old overlayfs
    path = tmp_path / "checkpoint.json"
    for content in (b"one", b"two"):
        swap_in(path, content, scratch="spare")
        assert path.read_bytes() == content and os.listdir(tmp_path) == ["checkpoint.json"]


def test_exchange_swaps_names_and_declines_a_missing_target(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("A")
    assert exchange(a, b) is False and a.read_text() == "A"  # nothing to exchange with: unchanged
    b.write_text("B")
    assert exchange(a, b) is True and (a.read_text(), b.read_text()) == ("B", "A")


def test_exchange_reports_other_failures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fsutil, "_renameat2", lambda: refusing_renameat2(errno.EACCES))
    with pytest.raises(PermissionError):
        exchange(tmp_path / "a", tmp_path / "b")
    monkeypatch.undo()
    (tmp_path / "a").write_text("A")
    with pytest.raises(NotADirectoryError):  # a path through a regular file: ENOTDIR, not "cannot exchange"
        exchange(tmp_path / "a", tmp_path / "a" / "b")


def test_read_file_reads_everything_or_says_missing(tmp_path: Path) -> None:
    big = bytes(range(256)) * 1000  # more than one read
    (tmp_path / "f").write_bytes(big)
    assert read_file(tmp_path / "f") == big and read_file(tmp_path / "missing") is None


def test_without_renameat2_swap_in_renames_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fsutil, "_renameat2", lambda: None)  # an old C library
    path = tmp_path / "checkpoint.json"
    for content in (b"one", b"two"):
        swap_in(path, content, scratch="spare")
        assert path.read_bytes() == content and os.listdir(tmp_path) == ["checkpoint.json"]
