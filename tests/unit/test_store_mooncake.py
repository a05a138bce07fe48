"""Tests of the ``mooncake`` backend against a real Mooncake Store on loopback (a master
and a memory daemon): conformance, damaged and forged objects, a full pool, and blocks
surviving the engine-side client that wrote them."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest

from ucm.config import ConfigError, parse_config
from ucm.store.base import Backend
from ucm.testing.conformance import (
    BackendConformance,
    make_buffer,
    make_key,
    make_payload,
    views,
)
from ucm.testing.servers import MooncakeStore

_prefixes = itertools.count()


def backend_on(store: MooncakeStore, capacity: int = 1 << 24, **options: object) -> Backend:
    from ucm.store.mooncake import MooncakeBackend

    prefix = f"t{next(_prefixes)}:"
    small = {"staging_bytes": 1 << 20, "staging_buffers": 2, **options}
    return MooncakeBackend(store.master, capacity, key_prefix=prefix, **small)  # type: ignore[arg-type]


class TestMooncakeConformance(BackendConformance):
    exact_usage = False  # The store does not report its use to clients.

    @pytest.fixture(autouse=True)
    def _store(self, mooncake_store: MooncakeStore) -> None:
        self.store = mooncake_store

    def make_backend(self, capacity_bytes: int, tmp_path: Path) -> Backend:
        return backend_on(self.store, capacity_bytes)


def test_blocks_outlive_the_client_that_wrote_them(mooncake_store: MooncakeStore) -> None:
    from ucm.store.mooncake import MooncakeBackend

    writer = MooncakeBackend(mooncake_store.master, 1 << 20, key_prefix="outlive:")
    assert writer.dump([make_key(0)], views([make_payload(0, 5000)])).wait() == [True]
    writer.close()  # Contributed no memory: the daemon holds the block.
    reader = MooncakeBackend(mooncake_store.master, 1 << 20, key_prefix="outlive:")
    buffers = [make_buffer(5000)]
    assert reader.load([make_key(0)], views(buffers)).wait() == [True]
    assert buffers == [make_payload(0, 5000)]
    reader.close()


def test_damaged_and_forged_objects_are_misses(mooncake_store: MooncakeStore) -> None:
    from ucm.store.mooncake import MooncakeBackend

    honest = MooncakeBackend(
        mooncake_store.master, 1 << 20, key_prefix="forge:", secret=b"0123456789abcdef!"
    )
    forger = MooncakeBackend(mooncake_store.master, 1 << 20, key_prefix="forge:")
    assert forger.dump([make_key(0)], views([make_payload(0, 300)])).wait() == [True]
    assert honest.load([make_key(0)], views([make_buffer(300)])).wait() == [False]
    assert honest.corrupt_blocks == 1
    assert honest.lookup([make_key(0)]) == [False]  # Removed, so it can be saved again.
    assert honest.dump([make_key(0)], views([make_payload(0, 300)])).wait() == [True]
    buffers = [make_buffer(300)]
    assert honest.load([make_key(0)], views(buffers)).wait() == [True]
    assert buffers == [make_payload(0, 300)]
    honest.close()
    forger.close()


def test_a_full_pool_evicts_and_blocks_become_misses() -> None:
    size, count = 1 << 20, 48  # 48 MiB into a 32 MB pool.
    with MooncakeStore(memory="32 MB") as store:
        backend = backend_on(store, 1 << 30, staging_bytes=4 << 20)
        keys = [make_key(i) for i in range(count)]
        for i, key in enumerate(keys):
            backend.dump([key], views([make_payload(i, size)])).wait()
        held = backend.lookup(keys)
        assert 0 < sum(held) < count
        buffers = [make_buffer(size) for _ in range(count)]
        loaded = backend.load(keys, views(buffers)).wait()
        assert sum(loaded) > 0
        for i, ok in enumerate(loaded):
            assert buffers[i] == (make_payload(i, size) if ok else make_buffer(size))
        backend.close()


@pytest.mark.timeout(120)
def test_a_store_that_goes_away_costs_misses_not_stalls_and_comes_back() -> None:
    store = MooncakeStore()
    store.start()
    try:
        backend = backend_on(store, retry_seconds=0.5)
        keys = [make_key(0), make_key(1)]
        assert backend.dump(keys, views([make_payload(0, 100), make_payload(1, 100)])).wait()
        store.stop()
        calls = 0
        while backend.lookup(keys) != [False, False] or calls < 20:  # Each at once once down.
            buffers = [make_buffer(100), make_buffer(100)]
            assert backend.load(keys, views(buffers)).wait() == [False, False]
            assert buffers == [make_buffer(100)] * 2
            assert backend.dump([make_key(2)], views([make_payload(2, 100)])).wait() == [False]
            calls += 1
        store.start()  # Empty: the daemon held the blocks.
        while not all(backend.dump(keys, views([make_payload(0, 100)] * 2)).wait()):
            time.sleep(0.1)  # Misses until the background probe sees the master again.
        buffers = [make_buffer(100)]
        assert backend.load(keys[:1], views(buffers)).wait() == [True]
        assert buffers == [make_payload(0, 100)]
        backend.close()
    finally:
        store.close()


def test_config_names_the_missing_master() -> None:
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.master: missing"):
        parse_config({"tiers": [{"backend": "mooncake", "capacity": "1GiB"}]})
