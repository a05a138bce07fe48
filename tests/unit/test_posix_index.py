"""The in-memory view of a posix store that the scheduler looks blocks up in."""

from __future__ import annotations

import os
import shutil
import time
from contextlib import closing
from pathlib import Path

import pytest

from ucm.config import TierConfig
from ucm.integration.vllm.residency import SharedTier
from ucm.keys import shard_key
from ucm.store.base import BlockKey, KeyIndex
from ucm.store.posix import PosixBackend
from ucm.testing.conformance import make_key, make_payload, views

KEYS = [make_key(i) for i in range(8)]


def store(backend: PosixBackend, *indices: int) -> None:
    payloads = views([make_payload(i, 64) for i in indices])
    assert backend.dump([KEYS[i] for i in indices], payloads).wait() == [True] * len(indices)


def open_index(backend: PosixBackend) -> KeyIndex:
    index = backend.key_index()
    assert index is not None
    return index


def held(index: KeyIndex) -> list[int]:
    return [i for i, hit in enumerate(index.contains_many(KEYS)) if hit]


def test_follows_blocks_written_and_removed_by_other_processes(tmp_path: Path) -> None:
    mine, theirs = PosixBackend(tmp_path, 1 << 20), PosixBackend(tmp_path, 1 << 20)
    store(theirs, 0, 1)
    with closing(open_index(mine)) as index:
        assert held(index) == [0, 1]  # Blocks present when the view opens.
        store(theirs, 2, 3, 4)
        theirs.delete([KEYS[0]])
        assert held(index) == [0, 1]  # No I/O until a refresh...
        index.refresh()
        assert held(index) == [1, 2, 3, 4]  # ...which sees both kinds of change.


def test_refreshes_on_its_own(tmp_path: Path) -> None:
    backend = PosixBackend(tmp_path, 1 << 20, index_refresh_seconds=0.05)
    with closing(open_index(backend)) as index:
        store(PosixBackend(tmp_path, 1 << 20), 5)
        deadline = time.monotonic() + 10
        while held(index) != [5] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert held(index) == [5]


def age_subdirectories(root: Path, seconds: float) -> None:
    for subdir in (root / "v2").iterdir():
        then = time.time_ns() - int(seconds * 1e9)
        os.utime(subdir, ns=(then, then))


def count_listings(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    listed: list[str] = []
    real = os.listdir

    def listdir(path: str | Path) -> list[str]:
        listed.append(str(path))
        return real(path)

    monkeypatch.setattr("ucm.store.posix_index.os.listdir", listdir)
    return listed


def test_lists_only_subdirectories_that_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = PosixBackend(tmp_path, 1 << 20)
    store(backend, 0, 1, 2, 3)
    age_subdirectories(tmp_path, 60)
    with closing(open_index(backend)) as index:
        listed = count_listings(monkeypatch)
        index.refresh()
        assert listed == []  # Nothing changed, nothing listed.
        store(backend, 4)
        index.refresh()
        assert listed == [str(tmp_path / "v2" / KEYS[4].hex()[:3])]
        assert held(index) == [0, 1, 2, 3, 4]


def test_change_in_the_same_timestamp_tick_is_seen(tmp_path: Path) -> None:
    backend = PosixBackend(tmp_path, 1 << 20)
    store(backend, 0)
    subdir = tmp_path / "v2" / KEYS[0].hex()[:3]
    with closing(open_index(backend)) as index:
        stamp = subdir.stat().st_mtime_ns
        twin = BlockKey(bytes.fromhex(KEYS[0].hex()[:3] + "0" * 61))  # Same subdirectory.
        os.link(subdir / f"{KEYS[0].hex()}.blk", subdir / f"{twin.hex()}.blk")
        os.utime(subdir, ns=(stamp, stamp))  # The directory's time did not change.
        index.refresh()
        assert index.contains_many([twin]) == [True]


def test_ignores_other_files_and_survives_the_directory_vanishing(tmp_path: Path) -> None:
    backend = PosixBackend(tmp_path, 1 << 20)
    store(backend, 0)
    subdir = tmp_path / "v2" / KEYS[0].hex()[:3]
    stray = BlockKey(bytes.fromhex("fff" + "1" * 61))  # A block name in the wrong subdir.
    (subdir / f"{stray.hex()}.blk").write_bytes(b"x")
    (subdir / f"{KEYS[1].hex()}.{'0' * 8}.1.abcd.tmp").write_bytes(b"x")
    (subdir / "notes.txt").write_text("x")
    with closing(open_index(backend)) as index:
        assert held(index) == [0]
        assert index.contains_many([stray]) == [False]
        for path in subdir.iterdir():
            path.unlink()
        shutil.rmtree(tmp_path / "v2")
        index.refresh()
        assert held(index) == []


def test_refresh_setting(tmp_path: Path) -> None:
    assert PosixBackend(tmp_path, 100, index_refresh_seconds=0).key_index() is None
    with pytest.raises(ValueError, match="index_refresh_seconds"):
        PosixBackend(tmp_path, 100, index_refresh_seconds=-1)
    tier = TierConfig("posix", 100, {"path": str(tmp_path), "index_refresh_seconds": 0.0})
    assert PosixBackend.from_tier(tier).key_index() is None


class CountingPosix(PosixBackend):
    """A posix backend that counts the keys its ``lookup`` is asked about (I/O)."""

    asked = 0

    def lookup(self, keys):  # type: ignore[no-untyped-def]
        self.asked += len(keys)
        return super().lookup(keys)


def test_shared_tier_looks_up_without_io(tmp_path: Path) -> None:
    store(PosixBackend(tmp_path, 1 << 20), 0, 1, 2)
    backend = CountingPosix(tmp_path, 1 << 20, index_refresh_seconds=3600)
    with closing(SharedTier(backend, num_shards=1)) as tier:
        assert tier.in_memory
        assert tier.contains_many(KEYS[:4]) == [True, True, True, False]
        assert backend.asked == 0
        # A block this engine is saving is checked in the store until the view shows it.
        assert tier.admit(KEYS[3], step=1)
        assert tier.contains_many(KEYS[3:5]) == [False, False]  # Not written yet.
        store(backend, 3)
        assert tier.contains_many(KEYS[3:5]) == [True, False]
        assert backend.asked == 2


def test_shared_tier_without_index_asks_the_store(tmp_path: Path) -> None:
    store(PosixBackend(tmp_path, 1 << 20), 0)
    backend = CountingPosix(tmp_path, 1 << 20, index_refresh_seconds=0)
    tier = SharedTier(backend, num_shards=2)
    assert not tier.in_memory
    assert tier.contains_many(KEYS[:2]) == [False, False]  # Shards of 2 ranks: none stored.
    assert backend.asked == 4


def test_shared_tier_needs_every_rank_shard(tmp_path: Path) -> None:
    writer = PosixBackend(tmp_path, 1 << 20)
    payload = views([make_payload(0, 64)])
    for key, ranks in ((KEYS[0], (0, 1)), (KEYS[1], (0,))):
        for rank in ranks:
            writer.dump([shard_key(key, rank, 2)], payload).wait()
    with closing(SharedTier(PosixBackend(tmp_path, 1 << 20), num_shards=2)) as tier:
        assert tier.contains_many(KEYS[:3]) == [True, False, False]
