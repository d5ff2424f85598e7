"""A builder's lock left by a killed process (`kernels.clear_stale_lock`): torch's extension
builder waits for it with no limit, so a stale one is removed, a fresh one (a build going on) kept."""

from __future__ import annotations

import os
import time
from pathlib import Path

from specwire.engine import kernels


def test_a_lock_older_than_any_build_is_removed_and_a_fresh_one_kept(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    assert not kernels.clear_stale_lock(tmp_path)  # none there
    lock.touch()
    assert not kernels.clear_stale_lock(tmp_path) and lock.exists()  # a build going on
    old = time.time() - kernels.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    assert kernels.clear_stale_lock(tmp_path) and not lock.exists()
