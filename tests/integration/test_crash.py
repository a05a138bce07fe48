"""Crash safety: processes killed (SIGKILL) while saving leave a consistent store.

The writers run ucm's real write-behind path on a real directory; after each kill a
restarted process must find only whole, correct blocks, no leftover temporary files
and usage that matches the disk. ``python -m ucm.testing.crash trials`` runs more.
"""

from __future__ import annotations

import os
from pathlib import Path

from ucm.testing.crash import run_trials

TRIALS = int(os.environ.get("UCM_CRASH_TRIALS", "24"))


def test_writers_killed_at_random_moments_leave_a_consistent_store(tmp_path: Path) -> None:
    report = run_trials(tmp_path, TRIALS, seed=1)
    assert report.trials == TRIALS
    assert report.problems == []
    assert report.tmp_files_left == 0
    assert report.blocks_checked > TRIALS * 10  # The store really filled up and churned.
