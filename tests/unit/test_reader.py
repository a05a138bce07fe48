"""Parallel block reads with fallback between tiers."""

from __future__ import annotations

import threading
from pathlib import Path

from ucm.store.dram import DramBackend
from ucm.store.posix import PosixBackend
from ucm.testing.conformance import make_buffer, make_key, make_payload, views
from ucm.transfer.reader import BlockRead, BlockReader


def test_reads_fall_back_to_other_tiers_and_report_what_no_tier_has(tmp_path: Path) -> None:
    dram, posix = DramBackend(1 << 20), PosixBackend(tmp_path, 1 << 20)
    keys = [make_key(i) for i in range(12)]
    dram.dump(keys[:4], views([make_payload(i, 300) for i in range(4)])).wait()
    posix.dump(keys[4:10], views([make_payload(i, 300) for i in range(4, 10)])).wait()
    buffers = [make_buffer(300) for _ in keys]
    planned = [0] * 6 + [1] * 6  # Blocks 4, 5 are planned from dram but only posix has them.
    reader = BlockReader(threads=3)
    reads = [
        BlockRead(key, tier, payload)
        for key, tier, payload in zip(keys, planned, views(buffers), strict=True)
    ]
    pending = reader.start([dram, posix], reads)
    assert pending.wait() == [True] * 10 + [False] * 2
    assert pending.wait() == [True] * 10 + [False] * 2  # Finished once, answered again.
    assert buffers[:10] == [make_payload(i, 300) for i in range(10)]
    reader.close()


class _RaisingBackend(DramBackend):
    def load(self, keys, payloads):  # type: ignore[no-untyped-def]
        raise OSError("device gone")


def test_a_raising_backend_is_a_miss_not_an_error() -> None:
    good = DramBackend(1 << 20)
    good.dump([make_key(0)], views([make_payload(0, 10)])).wait()
    reader = BlockReader(threads=2)
    buffers = [make_buffer(10), make_buffer(10)]
    reads = [BlockRead(make_key(i), 0, payload) for i, payload in enumerate(views(buffers))]
    assert reader.start([_RaisingBackend(1 << 20), good], reads).wait() == [True, False]
    assert buffers[0] == make_payload(0, 10)
    reader.close()


class _RecordsThreads:
    """Remembers the threads ``load`` ran on."""

    threads: set[str]

    def load(self, keys, payloads):  # type: ignore[no-untyped-def]
        self.threads.add(threading.current_thread().name)
        return super().load(keys, payloads)  # type: ignore[misc]


class _ThreadRecordingDram(_RecordsThreads, DramBackend):
    pass


class _ThreadRecordingPosix(_RecordsThreads, PosixBackend):
    pass


def test_memory_copies_run_in_the_caller_and_disk_reads_on_the_pool(tmp_path: Path) -> None:
    dram, posix = _ThreadRecordingDram(1 << 20), _ThreadRecordingPosix(tmp_path, 1 << 20)
    dram.threads, posix.threads = set(), set()
    keys = [make_key(i) for i in range(8)]
    dram.dump(keys[:4], views([make_payload(i, 100) for i in range(4)])).wait()
    posix.dump(keys[4:], views([make_payload(i, 100) for i in range(4, 8)])).wait()
    buffers = [make_buffer(100) for _ in keys]
    reads = [
        BlockRead(key, 0 if i < 4 else 1, payload)
        for i, (key, payload) in enumerate(zip(keys, views(buffers), strict=True))
    ]
    reader = BlockReader(threads=2)
    assert reader.start([dram, posix], reads).wait() == [True] * 8
    assert buffers == [make_payload(i, 100) for i in range(8)]
    assert dram.threads == {threading.current_thread().name}
    assert posix.threads and all(name.startswith("ucm-reader") for name in posix.threads)
    reader.close()
