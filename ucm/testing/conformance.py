"""Conformance tests that every :class:`~ucm.store.base.Backend` must pass.

A backend's test module subclasses :class:`BackendConformance` and says how to build
the backend; pytest then runs every test below against it::

    class TestDramConformance(BackendConformance):
        def make_backend(self, capacity_bytes: int, tmp_path: Path) -> Backend:
            return DramBackend(capacity_bytes)

:func:`make_key`, :func:`make_payload` and :func:`make_buffer` give deterministic
keys and caller-owned buffers for backend-specific tests.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path
from typing import ClassVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from ucm.store.base import Backend, BlockKey

SENTINEL = 0xA5
"""The byte :func:`make_buffer` fills buffers with, to tell untouched memory apart."""


def make_key(index: int) -> BlockKey:
    """Return a deterministic 32-byte key for ``index``."""
    digest = hashlib.blake2b(index.to_bytes(8, "little"), digest_size=32, person=b"ucm-test")
    return BlockKey(digest.digest())


def make_payload(seed: int, size: int) -> bytearray:
    """Return ``size`` deterministic pseudo-random bytes derived from ``seed``."""
    return bytearray(random.Random(seed).randbytes(size))


def make_buffer(size: int) -> bytearray:
    """Return a destination buffer of ``size`` bytes filled with :data:`SENTINEL`."""
    return bytearray([SENTINEL]) * size


def views(buffers: list[bytearray]) -> list[list[memoryview]]:
    """Return each buffer as a one-segment payload."""
    return [[memoryview(buffer)] for buffer in buffers]


class BackendConformance:
    """Behaviour every backend shares; subclasses implement :meth:`make_backend`."""

    exact_usage: ClassVar[bool] = True
    """Whether ``usage()`` counts each block once and one LRU order decides evictions;
    composite backends whose tiers hold copies of a block set this to False."""

    def make_backend(self, capacity_bytes: int, tmp_path: Path) -> Backend:
        """Build an empty backend for one test.

        Args:
            capacity_bytes: The payload bytes the backend may hold.
            tmp_path: An empty directory private to the test.
        """
        raise NotImplementedError

    def test_roundtrip_blocks_of_different_sizes(self, tmp_path: Path) -> None:
        sizes = [1, 511, 4096, 65_537]
        keys = [make_key(i) for i in range(len(sizes))]
        payloads = [make_payload(i, size) for i, size in enumerate(sizes)]
        with closing(self.make_backend(1 << 20, tmp_path)) as backend:
            assert backend.dump(keys, views(payloads)).wait() == [True] * len(keys)
            assert backend.lookup(keys) == [True] * len(keys)
            buffers = [make_buffer(size) for size in sizes]
            assert backend.load(keys, views(buffers)).wait() == [True] * len(keys)
            assert buffers == payloads
            if self.exact_usage:
                assert backend.usage().used_bytes == sum(sizes)
                assert backend.usage().num_blocks == len(sizes)

    def test_payload_given_as_segments(self, tmp_path: Path) -> None:
        payload = make_payload(7, 10_000)
        split_at = [[0, 1, 4000, 4000, 10_000], [0, 9_999, 10_000], [0, 3333, 6666, 10_000]]
        with closing(self.make_backend(1 << 20, tmp_path)) as backend:
            dumped = [memoryview(payload)[a:b] for a, b in itertools.pairwise(split_at[0])]
            assert backend.dump([make_key(0)], [dumped]).wait() == [True]
            for cuts in split_at[1:]:
                target = make_buffer(10_000)
                loaded = [memoryview(target)[a:b] for a, b in itertools.pairwise(cuts)]
                assert backend.load([make_key(0)], [loaded]).wait() == [True]
                assert target == payload
            short = [memoryview(make_buffer(5000)), memoryview(make_buffer(4999))]
            assert backend.load([make_key(0)], [short]).wait() == [False]

    def test_missing_key_is_a_miss_and_leaves_the_buffer_untouched(self, tmp_path: Path) -> None:
        with closing(self.make_backend(1 << 20, tmp_path)) as backend:
            backend.dump([make_key(0)], views([make_payload(0, 64)])).wait()
            assert backend.lookup([make_key(1), make_key(0)]) == [False, True]
            buffers = [make_buffer(64), make_buffer(64)]
            assert backend.load([make_key(1), make_key(0)], views(buffers)).wait() == [False, True]
            assert buffers == [make_buffer(64), make_payload(0, 64)]

    def test_wrong_size_destination_fails(self, tmp_path: Path) -> None:
        with closing(self.make_backend(1 << 20, tmp_path)) as backend:
            backend.dump([make_key(0)], views([make_payload(0, 1000)])).wait()
            buffers = [make_buffer(999), make_buffer(1001)]
            assert backend.load([make_key(0)] * 2, views(buffers)).wait() == [False, False]
            buffers = [make_buffer(1000)]
            assert backend.load([make_key(0)], views(buffers)).wait() == [True]

    def test_lookup_prefix(self, tmp_path: Path) -> None:
        keys = [make_key(i) for i in range(5)]
        with closing(self.make_backend(1 << 20, tmp_path)) as backend:
            stored = [keys[0], keys[1], keys[2], keys[4]]
            backend.dump(stored, views([make_payload(i, 32) for i in range(4)])).wait()
            assert backend.lookup_prefix(keys) == 3
            assert backend.lookup_prefix(keys[:3]) == 3
            assert backend.lookup_prefix(keys[3:]) == 0
            assert backend.lookup_prefix([]) == 0

    def test_delete(self, tmp_path: Path) -> None:
        keys = [make_key(0), make_key(1)]
        with closing(self.make_backend(1 << 20, tmp_path)) as backend:
            backend.dump(keys, views([make_payload(0, 100), make_payload(1, 200)])).wait()
            backend.delete([keys[0], make_key(99)])
            backend.delete([])
            assert backend.lookup(keys) == [False, True]
            assert backend.load([keys[0]], views([make_buffer(100)])).wait() == [False]
            if self.exact_usage:
                assert backend.usage().used_bytes == 200
                assert backend.usage().num_blocks == 1

    def test_key_index_agrees_with_lookup_after_refresh(self, tmp_path: Path) -> None:
        keys = [make_key(i) for i in range(6)]
        with closing(self.make_backend(1 << 20, tmp_path)) as backend:
            index = backend.key_index()
            if index is None:
                pytest.skip("this backend offers no in-memory key index")
            try:
                backend.dump(keys[:4], views([make_payload(i, 50) for i in range(4)])).wait()
                backend.delete([keys[1]])
                index.refresh()
                assert index.contains_many(keys) == backend.lookup(keys)
                assert index.contains_many(keys) == [True, False, True, True, False, False]
            finally:
                index.close()
            assert index.contains_many(keys) == [False] * len(keys)

    def test_redump_keeps_the_block(self, tmp_path: Path) -> None:
        key, payload = make_key(0), make_payload(0, 300)
        with closing(self.make_backend(1 << 20, tmp_path)) as backend:
            assert backend.dump([key], views([payload])).wait() == [True]
            assert backend.dump([key, key], views([payload, payload])).wait() == [True, True]
            buffers = [make_buffer(300)]
            assert backend.load([key], views(buffers)).wait() == [True]
            assert buffers == [payload]
            if self.exact_usage:
                assert backend.usage().used_bytes == 300
                assert backend.usage().num_blocks == 1

    def test_usage_stays_within_capacity(self, tmp_path: Path) -> None:
        size, fits = 1000, 10
        keys = [make_key(i) for i in range(4 * fits)]
        with closing(self.make_backend(fits * size, tmp_path)) as backend:
            if not backend.capabilities.bounded:
                pytest.skip("a server bounds this backend's store, not the backend")
            for i, key in enumerate(keys):
                assert backend.dump([key], views([make_payload(i, size)])).wait() == [True]
                usage = backend.usage()
                assert usage.used_bytes <= usage.capacity_bytes
            assert sum(backend.lookup(keys)) <= fits
            assert backend.lookup(keys[-1:]) == [True]

    def test_eviction_is_least_recently_used(self, tmp_path: Path) -> None:
        size = 1000
        keys = [make_key(i) for i in range(5)]
        with closing(self.make_backend(4 * size, tmp_path)) as backend:
            if not backend.capabilities.bounded:
                pytest.skip("a server bounds this backend's store, not the backend")
            backend.dump(keys[:4], views([make_payload(i, size) for i in range(4)])).wait()
            buffers = [make_buffer(size)]
            assert backend.load([keys[0]], views(buffers)).wait() == [True]
            assert backend.dump([keys[4]], views([make_payload(4, size)])).wait() == [True]
            assert backend.lookup([keys[0], keys[4]]) == [True, True]
            if self.exact_usage:
                assert backend.lookup(keys) == [True, False, True, True, True]
            buffers = [make_buffer(size)]
            assert backend.load([keys[0]], views(buffers)).wait() == [True]
            assert buffers == [make_payload(0, size)]

    def test_block_larger_than_capacity_fails_without_evicting(self, tmp_path: Path) -> None:
        small, big = make_key(0), make_key(1)
        with closing(self.make_backend(1000, tmp_path)) as backend:
            assert backend.dump([small], views([make_payload(0, 500)])).wait() == [True]
            before = backend.usage()
            assert backend.dump([big], views([make_payload(1, 1001)])).wait() == [False]
            assert backend.lookup([small, big]) == [True, False]
            if self.exact_usage:
                assert backend.usage() == before

    def test_concurrent_dumps_and_loads(self, tmp_path: Path) -> None:
        threads, per_thread = 4, 25
        barrier = threading.Barrier(threads)

        def size_of(index: int) -> int:
            return 100 + 37 * index

        def work(backend: Backend, thread: int) -> None:
            barrier.wait()
            for i in range(thread * per_thread, (thread + 1) * per_thread):
                payload = make_payload(i, size_of(i))
                assert backend.dump([make_key(i)], views([payload])).wait() == [True]
                other = (i + per_thread) % (threads * per_thread)
                buffers = [make_buffer(size_of(i)), make_buffer(size_of(other))]
                loaded = backend.load([make_key(i), make_key(other)], views(buffers)).wait()
                assert loaded[0]
                assert buffers[0] == payload
                assert buffers[1] == (
                    make_payload(other, size_of(other))
                    if loaded[1]
                    else make_buffer(size_of(other))
                )

        with closing(self.make_backend(1 << 24, tmp_path)) as backend:
            with ThreadPoolExecutor(threads) as pool:
                for future in [pool.submit(work, backend, t) for t in range(threads)]:
                    future.result()
            total = threads * per_thread
            buffers = [make_buffer(size_of(i)) for i in range(total)]
            keys = [make_key(i) for i in range(total)]
            assert backend.load(keys, views(buffers)).wait() == [True] * total
            assert buffers == [make_payload(i, size_of(i)) for i in range(total)]

    def test_state_machine_agrees_with_a_dict_model(self, tmp_path: Path) -> None:
        sizes = [1, 3, 100, 1000, 4096]
        runs = itertools.count()
        make_backend = self.make_backend
        exact_usage = self.exact_usage
        batches = st.lists(st.integers(0, len(sizes) - 1), max_size=4)

        class Machine(RuleBasedStateMachine):
            def __init__(self) -> None:
                super().__init__()
                run_dir = tmp_path / f"run{next(runs)}"
                run_dir.mkdir()
                self.backend = make_backend(2 * sum(sizes), run_dir)
                self.stored: set[int] = set()

            @rule(batch=batches)
            def dump(self, batch: list[int]) -> None:
                payloads = [make_payload(i, sizes[i]) for i in batch]
                keys = [make_key(i) for i in batch]
                assert self.backend.dump(keys, views(payloads)).wait() == [True] * len(batch)
                self.stored.update(batch)

            @rule(batch=batches)
            def load(self, batch: list[int]) -> None:
                buffers = [make_buffer(sizes[i]) for i in batch]
                results = self.backend.load([make_key(i) for i in batch], views(buffers)).wait()
                assert results == [i in self.stored for i in batch]
                for i, buffer in zip(batch, buffers, strict=True):
                    expected = (
                        make_payload(i, sizes[i]) if i in self.stored else make_buffer(sizes[i])
                    )
                    assert buffer == expected

            @rule(batch=batches)
            def delete(self, batch: list[int]) -> None:
                self.backend.delete([make_key(i) for i in batch])
                self.stored.difference_update(batch)

            @rule(batch=batches)
            def lookup(self, batch: list[int]) -> None:
                keys = [make_key(i) for i in batch]
                expected = [i in self.stored for i in batch]
                assert self.backend.lookup(keys) == expected
                assert self.backend.lookup_prefix(keys) == (expected + [False]).index(False)

            @invariant()
            def usage_matches(self) -> None:
                if exact_usage:
                    usage = self.backend.usage()
                    assert usage.num_blocks == len(self.stored)
                    assert usage.used_bytes == sum(sizes[i] for i in self.stored)

            def teardown(self) -> None:
                self.backend.close()

        run_state_machine_as_test(
            Machine,
            settings=settings(
                max_examples=30,
                stateful_step_count=15,
                deadline=None,
                database=None,
                derandomize=True,
            ),
        )
