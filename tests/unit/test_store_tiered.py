"""Tests of :class:`~ucm.store.tiered.TieredBackend`: conformance of dram over posix,
promotion of lower-tier hits, write-through and per-tier batching."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from ucm.config import TierConfig
from ucm.store.base import Backend, BlockKey, Segments, Task
from ucm.store.dram import DramBackend
from ucm.store.posix import PosixBackend
from ucm.store.tiered import TieredBackend
from ucm.testing.conformance import (
    BackendConformance,
    make_buffer,
    make_key,
    make_payload,
    views,
)


class TestTieredConformance(BackendConformance):
    exact_usage = False

    def make_backend(self, capacity_bytes: int, tmp_path: Path) -> Backend:
        return TieredBackend(
            [DramBackend(capacity_bytes), PosixBackend(tmp_path / "store", capacity_bytes)]
        )


class CountingDram(DramBackend):
    """A dram backend that records the batches it is called with."""

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.calls: list[tuple[str, int]] = []

    def lookup(self, keys: Sequence[BlockKey]) -> list[bool]:
        self.calls.append(("lookup", len(keys)))
        return super().lookup(keys)

    def load(self, keys: Sequence[BlockKey], payloads: Sequence[Segments]) -> Task:
        self.calls.append(("load", len(keys)))
        return super().load(keys, payloads)

    def dump(self, keys: Sequence[BlockKey], payloads: Sequence[Segments]) -> Task:
        self.calls.append(("dump", len(keys)))
        return super().dump(keys, payloads)


def test_hit_in_posix_only_is_promoted_into_dram(tmp_path: Path) -> None:
    dram, posix = DramBackend(10_000), PosixBackend(tmp_path, 10_000)
    tiered = TieredBackend([dram, posix])
    keys = [make_key(0), make_key(1), make_key(2)]
    posix.dump(keys[:1], views([make_payload(0, 100)])).wait()
    dram.dump(keys[1:2], views([make_payload(1, 100)])).wait()
    assert dram.lookup(keys) == [False, True, False]
    buffers = [make_buffer(100) for _ in keys]
    assert tiered.load(keys, views(buffers)).wait() == [True, True, False]
    assert buffers == [make_payload(0, 100), make_payload(1, 100), make_buffer(100)]
    assert dram.lookup(keys) == [True, True, False]
    assert posix.lookup(keys) == [True, False, False]


def test_dump_writes_through_and_delete_removes_everywhere(tmp_path: Path) -> None:
    dram, posix = DramBackend(10_000), PosixBackend(tmp_path, 10_000)
    tiered = TieredBackend([dram, posix])
    assert tiered.dump([make_key(0)], views([make_payload(0, 100)])).wait() == [True]
    assert dram.lookup([make_key(0)]) == posix.lookup([make_key(0)]) == [True]
    assert tiered.usage().used_bytes == 200
    tiered.delete([make_key(0)])
    assert dram.lookup([make_key(0)]) == posix.lookup([make_key(0)]) == [False]


def test_dump_succeeds_if_any_tier_stores(tmp_path: Path) -> None:
    tiered = TieredBackend([DramBackend(50), PosixBackend(tmp_path, 10_000)])
    assert tiered.dump([make_key(0)], views([make_payload(0, 100)])).wait() == [True]
    buffers = [make_buffer(100)]
    assert tiered.load([make_key(0)], views(buffers)).wait() == [True]
    assert buffers == [make_payload(0, 100)]


def test_each_tier_is_called_once_per_batch() -> None:
    top, bottom = CountingDram(10_000), CountingDram(10_000)
    tiered = TieredBackend([top, bottom])
    keys = [make_key(i) for i in range(4)]
    bottom.dump(keys[:2], views([make_payload(i, 10) for i in range(2)])).wait()
    bottom.calls.clear()
    assert tiered.lookup(keys) == [True, True, False, False]
    assert (
        tiered.load(keys, views([make_buffer(10) for _ in keys])).wait() == [True] * 2 + [False] * 2
    )
    assert tiered.dump(keys, views([make_payload(i, 10) for i in range(4)])).wait() == [True] * 4
    assert top.calls == [("lookup", 4), ("load", 4), ("dump", 2), ("dump", 4)]
    assert bottom.calls == [("lookup", 4), ("load", 4), ("dump", 4)]


def test_lower_tiers_are_asked_only_about_misses() -> None:
    top, bottom = CountingDram(10_000), CountingDram(10_000)
    tiered = TieredBackend([top, bottom])
    tiered.dump([make_key(0)], views([make_payload(0, 10)])).wait()
    top.calls.clear()
    bottom.calls.clear()
    assert tiered.lookup([make_key(0)]) == [True]
    assert tiered.load([make_key(0)], views([make_buffer(10)])).wait() == [True]
    assert bottom.calls == []


def test_capabilities_combine_the_tiers(tmp_path: Path) -> None:
    assert not TieredBackend([DramBackend(10)]).capabilities.persistent
    both = TieredBackend([DramBackend(10), PosixBackend(tmp_path, 10)])
    assert both.capabilities.persistent
    assert both.capabilities.shared
    assert both.usage().capacity_bytes == 20


def test_from_tiers_builds_registered_backends(tmp_path: Path) -> None:
    tiered = TieredBackend.from_tiers(
        [TierConfig("dram", 1000), TierConfig("posix", 2000, {"path": str(tmp_path)})]
    )
    assert [type(tier) for tier in tiered.tiers] == [DramBackend, PosixBackend]
    assert tiered.usage().capacity_bytes == 3000
    single = TieredBackend.from_tier(TierConfig("dram", 1000))
    assert [type(tier) for tier in single.tiers] == [DramBackend]


def test_needs_a_tier() -> None:
    with pytest.raises(ValueError, match="at least one tier"):
        TieredBackend([])


def test_mismatched_batch_is_rejected() -> None:
    with pytest.raises(ValueError, match="payloads"):
        TieredBackend([DramBackend(10)]).dump([make_key(0)], [])
