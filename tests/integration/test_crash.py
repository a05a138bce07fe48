"""Crash safety and concurrency: processes killed (SIGKILL) while saving, and several
processes reading and writing the same keys at once, leave a consistent store.

The writers run ucm's real write-behind path on a real directory; after each kill a
restarted process must find only whole, correct blocks, no leftover temporary files
and usage that matches the disk. ``python -m ucm.testing.crash trials`` runs more.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from ucm.store.posix_files import list_blocks, totals_of
from ucm.testing.crash import CAPACITY, TrialReport, check_after_crash, run_trials

TRIALS = int(os.environ.get("UCM_CRASH_TRIALS", "24"))


@pytest.mark.parametrize("direct_io", [False, True])
def test_writers_killed_at_random_moments_leave_a_consistent_store(
    tmp_path: Path, direct_io: bool
) -> None:
    report = run_trials(tmp_path, TRIALS, seed=1, direct_io=direct_io)
    assert report.trials == TRIALS
    assert report.problems == []
    assert report.tmp_files_left == 0
    assert report.blocks_checked > TRIALS * 10  # The store really filled up and churned.


def test_processes_sharing_a_store_never_read_torn_or_wrong_blocks(tmp_path: Path) -> None:
    """Three writers (same keys, evicting all the time) and two readers, at once."""
    command = [sys.executable, "-m", "ucm.testing.crash"]
    writers = [
        subprocess.Popen([*command, "write", str(tmp_path), str(CAPACITY), str(seed)])
        for seed in range(3)
    ]
    readers = [
        subprocess.Popen([*command, "read", str(tmp_path), "6", str(seed)], stdout=subprocess.PIPE)
        for seed in range(2)
    ]
    counts = [json.loads(reader.communicate(timeout=120)[0]) for reader in readers]
    for writer in writers:
        writer.send_signal(signal.SIGKILL)
        assert writer.wait() == -signal.SIGKILL, "a writer crashed on its own"
    assert all(reader.returncode == 0 for reader in readers)
    assert [count["wrong"] for count in counts] == [0, 0]
    assert all(count["hits"] > 100 for count in counts), counts
    assert all(count["hits"] < count["loads"] for count in counts), counts  # Evictions too.
    # The shared ledger never counts less than the disk holds (it may count more: the
    # killed writers' reservations), and the disk never holds more than the capacity.
    ledger_bytes, ledger_blocks = struct.unpack("<QQ", (tmp_path / "v2" / "usage").read_bytes())
    disk = totals_of(list_blocks(tmp_path / "v2"))
    assert disk.used_bytes <= ledger_bytes <= CAPACITY
    assert disk.blocks <= ledger_blocks
    report = TrialReport()
    check_after_crash(tmp_path, CAPACITY, report)
    assert report.problems == [] and report.tmp_files_left == 0
