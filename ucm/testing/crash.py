"""Fault injection: kill processes that are saving blocks, then check the store.

``python -m ucm.testing.crash write ROOT CAPACITY SEED`` saves blocks to a ``posix``
store through ucm's write-behind path (the one vLLM's worker uses) until it is killed.
``python -m ucm.testing.crash read ROOT SECONDS SEED`` loads random keys meanwhile and
prints how many loads hit and how many returned other bytes than were written.
``python -m ucm.testing.crash trials ROOT --trials N`` runs N rounds of "start a
writer, SIGKILL it at a random moment, restart, check" and prints the figures; the
test suite runs a few dozen rounds, this command as many as one wants (a stress run).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ucm.store.blockfile import TRAILER_BYTES
from ucm.store.posix import PosixBackend
from ucm.store.posix_fsck import fsck
from ucm.testing.conformance import make_key, make_payload
from ucm.transfer.writer import BackgroundWriter

KEYS = 400
"""How many distinct keys writers use (so that keys are written again and evicted)."""
CAPACITY = 24 << 20
"""Store capacity of every writer (smaller than the bytes of all keys together)."""
READY = "writing"
"""What a writer prints once it has started writing."""


def payload_of(index: int) -> bytearray:
    """Return the payload every writer stores under key ``index`` (16 KiB to 512 KiB)."""
    return make_payload(index, (1 + index % 32) << 14)


def write_until_killed(root: Path, capacity: int, seed: int, direct_io: bool = False) -> None:
    """Save batches of blocks (and delete some) for ever, four writes in flight."""
    backend = PosixBackend(root, capacity, index_refresh_seconds=0, direct_io=direct_io)
    writer = BackgroundWriter(max_pending_bytes=8 << 20, threads=4)
    rng = random.Random(seed)
    print(READY, flush=True)
    while True:
        indices = sorted(set(rng.choices(range(KEYS), k=8)))
        payloads = [[memoryview(payload_of(index))] for index in indices]
        writer.submit(backend, [make_key(i) for i in indices], payloads, lambda: None)
        if rng.random() < 0.1:
            backend.delete([make_key(rng.randrange(KEYS))])


def read_for(root: Path, seconds: float, seed: int) -> dict[str, int]:
    """Load random keys for ``seconds`` and compare every hit with what was written.

    Returns:
        Counts of ``loads``, ``hits`` and ``wrong`` (hits whose bytes differ).
    """
    backend = PosixBackend(root, CAPACITY, index_refresh_seconds=0)
    rng = random.Random(seed)
    counts = {"loads": 0, "hits": 0, "wrong": 0}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        indices = sorted(set(rng.choices(range(KEYS), k=8)))
        buffers = [bytearray(len(payload_of(index))) for index in indices]
        views = [[memoryview(buffer)] for buffer in buffers]
        loaded = backend.load([make_key(index) for index in indices], views).wait()
        for index, buffer, hit in zip(indices, buffers, loaded, strict=True):
            counts["loads"] += 1
            counts["hits"] += hit
            counts["wrong"] += hit and buffer != payload_of(index)
    return counts


@dataclass
class TrialReport:
    """What the trials found, summed over trials."""

    trials: int = 0
    blocks_checked: int = 0
    """Block files read back and compared with what was written."""
    tmp_files_left: int = 0
    """Temporary files of killed writers still present after the restart (must be 0)."""
    problems: list[str] = field(default_factory=list)
    """Everything that was wrong (must be empty)."""


def check_after_crash(root: Path, capacity: int, report: TrialReport) -> None:
    """Restart on the store and check it: whole blocks only, right bytes, right usage,
    capacity kept (the writers are gone, so the restarted process recounts the ledger).

    Adds what it finds to ``report``.
    """
    backend = PosixBackend(root, capacity, index_refresh_seconds=0)  # The restart.
    report.tmp_files_left += len(list(root.rglob("*.tmp")))
    found = fsck(root)
    problems = [f"damaged block {path}" for path in found.damaged]
    problems += [f"stale temporary file {path}" for path in found.stale_tmp]
    stored = sorted(root.rglob("*.blk"))
    indices = {make_key(index).hex(): index for index in range(KEYS)}
    on_disk = 0
    for path in stored:
        index = indices.get(path.stem)
        if index is None:
            problems.append(f"unknown block {path}")
            continue
        expected = payload_of(index)
        data = path.read_bytes()
        if data[:-TRAILER_BYTES] != expected:
            problems.append(f"block {index} holds other bytes than were written")
        buffer = bytearray(len(expected))
        if backend.load([make_key(index)], [[memoryview(buffer)]]).wait() != [True]:
            problems.append(f"block {index} is listed but does not load")
        elif buffer != expected:
            problems.append(f"block {index} loads other bytes than were written")
        on_disk += len(expected)
    usage = backend.usage()
    if (usage.used_bytes, usage.num_blocks) != (on_disk, len(stored)):
        problems.append(f"usage {usage} after restart, but {len(stored)} blocks, {on_disk} B")
    if usage.used_bytes > capacity:
        problems.append(f"{usage.used_bytes} bytes stored, capacity {capacity}")
    backend.close()
    report.blocks_checked += len(stored)
    report.problems += problems


def run_trials(
    root: Path, trials: int, seed: int = 0, max_delay: float = 0.4, direct_io: bool = False
) -> TrialReport:
    """Kill writers at random moments and check the store after each kill.

    Args:
        root: The store directory (kept across trials, so damage would accumulate).
        trials: How many writers to kill.
        seed: Seed of the kill times and of the writers' choices.
        max_delay: Longest time a writer runs before it is killed, in seconds.
        direct_io: The writers write with ``O_DIRECT`` (the checks read buffered).
    """
    rng = random.Random(seed)
    report = TrialReport()
    for trial in range(trials):
        command = [sys.executable, "-m", "ucm.testing.crash", "write", str(root), str(CAPACITY)]
        command += ["--direct-io"] if direct_io else []
        writer = subprocess.Popen([*command, str(seed * 1000 + trial)], stdout=subprocess.PIPE)
        assert writer.stdout is not None
        if writer.stdout.readline().decode().strip() != READY:
            raise RuntimeError(f"writer {trial} did not start (exit {writer.wait()})")
        time.sleep(rng.uniform(0.0, max_delay))
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        writer.stdout.close()
        check_after_crash(root, CAPACITY, report)
        report.trials += 1
    return report


def main(argv: list[str] | None = None) -> int:
    """Run a writer (``write``) or a series of kill-and-check trials (``trials``)."""
    parser = argparse.ArgumentParser(prog="python -m ucm.testing.crash", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    write = commands.add_parser("write")
    write.add_argument("root", type=Path)
    write.add_argument("capacity", type=int)
    write.add_argument("seed", type=int)
    write.add_argument("--direct-io", action="store_true", help="write with O_DIRECT")
    read = commands.add_parser("read")
    read.add_argument("root", type=Path)
    read.add_argument("seconds", type=float)
    read.add_argument("seed", type=int)
    trials = commands.add_parser("trials")
    trials.add_argument("root", type=Path)
    trials.add_argument("--trials", type=int, default=100)
    trials.add_argument("--seed", type=int, default=0)
    trials.add_argument("--direct-io", action="store_true", help="writers use O_DIRECT")
    args = parser.parse_args(argv)
    if args.command == "write":
        write_until_killed(args.root, args.capacity, args.seed, args.direct_io)
        return 0
    if args.command == "read":
        print(json.dumps(read_for(args.root, args.seconds, args.seed)))
        return 0
    report = run_trials(args.root, args.trials, args.seed, direct_io=args.direct_io)
    print(
        f"{report.trials} writers killed, {report.blocks_checked} blocks checked, "
        f"{report.tmp_files_left} temporary files left, {len(report.problems)} problems"
    )
    for problem in report.problems:
        print(problem)
    return 1 if report.problems or report.tmp_files_left else 0


if __name__ == "__main__":
    sys.exit(main())
