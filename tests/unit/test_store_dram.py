"""Tests of the ``dram`` backend: conformance plus pool-specific behaviour."""

from __future__ import annotations

from pathlib import Path

import pytest

from ucm.config import TierConfig
from ucm.store.base import Backend
from ucm.store.dram import DramBackend
from ucm.testing.conformance import BackendConformance, make_key, make_payload, views


class TestDramConformance(BackendConformance):
    def make_backend(self, capacity_bytes: int, tmp_path: Path) -> Backend:
        return DramBackend(capacity_bytes)


def test_capabilities() -> None:
    assert not DramBackend.capabilities.persistent
    assert not DramBackend.capabilities.shared
    assert DramBackend.option_types == {}


def test_from_tier_uses_capacity() -> None:
    backend = DramBackend.from_tier(TierConfig(backend="dram", capacity=1234))
    assert backend.usage().capacity_bytes == 1234


def test_negative_capacity_is_rejected() -> None:
    with pytest.raises(ValueError, match="capacity"):
        DramBackend(-1)


def test_dump_copies_the_payload() -> None:
    backend = DramBackend(1000)
    payload = make_payload(0, 10)
    backend.dump([make_key(0)], views([payload])).wait()
    payload[:] = bytes(10)
    loaded = bytearray(10)
    assert backend.load([make_key(0)], [[memoryview(loaded)]]).wait() == [True]
    assert loaded == make_payload(0, 10)


def test_load_accepts_a_non_byte_view() -> None:
    backend = DramBackend(1000)
    backend.dump([make_key(0)], views([make_payload(0, 16)])).wait()
    destination = bytearray(16)
    words = memoryview(destination).cast("I")
    assert backend.load([make_key(0)], [[words]]).wait() == [True]
    assert destination == make_payload(0, 16)


def test_repeated_dump_counts_as_a_use() -> None:
    backend = DramBackend(300)
    keys = [make_key(i) for i in range(4)]
    backend.dump(keys[:3], views([make_payload(i, 100) for i in range(3)])).wait()
    backend.dump(keys[:1], views([make_payload(0, 100)])).wait()
    backend.dump(keys[3:], views([make_payload(3, 100)])).wait()
    assert backend.lookup(keys) == [True, False, True, True]


def test_eviction_frees_exactly_enough() -> None:
    backend = DramBackend(1000)
    keys = [make_key(i) for i in range(3)]
    backend.dump(keys, views([make_payload(0, 400), make_payload(1, 400), make_payload(2, 600)]))
    assert backend.lookup(keys) == [False, True, True]
    assert backend.usage().used_bytes == 1000


def test_close_drops_everything() -> None:
    backend = DramBackend(1000)
    backend.dump([make_key(0)], views([make_payload(0, 10)])).wait()
    backend.close()
    assert backend.usage().used_bytes == 0
    assert backend.lookup([make_key(0)]) == [False]
