"""`contracts.files`: `write_atomic`, the one atomic writer (exact mode whatever the umask, the owner
set before the rename, and no temp file left behind), and `exclusive_lock`, the one lock file."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from umbra.contracts.files import exclusive_lock, write_atomic


def test_mode_is_exact_and_no_temp_is_left(tmp_path: Path) -> None:
    target = tmp_path / "f"
    target.write_text("old")
    os.chmod(target, 0o644)
    old = os.umask(0o077)
    try:
        write_atomic(target, "new", 0o640)
    finally:
        os.umask(old)
    assert target.read_text() == "new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_owner_is_set_before_the_file_appears(tmp_path: Path) -> None:
    target = tmp_path / "token"
    write_atomic(target, b"t", 0o400, owner=(4242, 4343))
    info = target.stat()
    assert (info.st_uid, info.st_gid) == (4242, 4343)
    assert stat.S_IMODE(info.st_mode) == 0o400 and target.read_bytes() == b"t"


def test_exclusive_lock_is_held_by_one_holder_and_a_prune_skips_a_held_one(tmp_path: Path) -> None:
    lock = tmp_path / "cache" / "key.lock"  # the directory is made
    with exclusive_lock(lock) as held:
        assert held
        # flock is per open file: a second open, even in this process, is another holder.
        with exclusive_lock(lock, wait=False) as second:
            assert not second
    with exclusive_lock(lock, wait=False) as after:
        assert after
