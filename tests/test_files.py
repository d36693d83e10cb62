"""The one atomic file writer (files.py): readers see the old file or the new one, never a
half-written one, and the new file gets the mode open() would give it (a holder's CVM reads
a dataset under a uid of its own)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from gputravel.files import atomic_write, atomic_write_bytes


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "shard.bin"
    atomic_write_bytes(target, b"old")

    def half(f) -> None:
        f.write(b"half of the new")
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        atomic_write(target, half)
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard.bin"]


def test_a_new_file_gets_the_mode_open_would_give_it(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        atomic_write_bytes(tmp_path / "a", b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o640


def test_writing_over_a_file_replaces_it_whole(tmp_path: Path) -> None:
    target = tmp_path / "deep" / "run.json"
    atomic_write_bytes(target, b"first version, longer")
    atomic_write_bytes(target, b"second")
    assert target.read_bytes() == b"second"
