"""The scheduler's view of the tiers: prefix search and the DRAM mirror."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ucm.integration.vllm import residency
from ucm.integration.vllm.residency import MirroredTier, TierView, stored_prefix
from ucm.store.base import BlockKey

KEYS = [BlockKey(bytes([index]) * 32) for index in range(12)]


class SlowTier(TierView):
    """A tier that needs I/O; it records the keys it was asked about, per round trip."""

    def __init__(self, stored: set[BlockKey]) -> None:
        self.stored = stored
        self.asked: list[BlockKey] = []
        self.round_trips = 0

    def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        self.round_trips += 1
        return [self.contains(key) for key in keys]

    def contains(self, key: BlockKey) -> bool:
        self.asked.append(key)
        return key in self.stored

    def admit(self, key: BlockKey, step: int) -> bool:
        return True


def mirror(stored: set[BlockKey]) -> MirroredTier:
    tier = MirroredTier(len(KEYS))
    for key in stored:
        tier.admit(key, step=0)
    return tier


def naive(keys: list[BlockKey], tiers: list[set[BlockKey]]) -> list[int]:
    found = []
    for key in keys:
        holders = [index for index, stored in enumerate(tiers) if key in stored]
        if not holders:
            break
        found.append(holders[0])
    return found


stored_sets = st.sets(st.sampled_from(KEYS))


CHUNK = 4  # Blocks per round trip to a slow tier, small enough to matter for 12 keys.


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(residency, "SLOW_LOOKUP_CHUNK", CHUNK)


@given(st.lists(st.tuples(stored_sets, st.booleans()), min_size=1, max_size=3))
def test_stored_prefix_matches_the_definition(tiers: list[tuple[set[BlockKey], bool]]) -> None:
    views: list[TierView] = [mirror(keys) if fast else SlowTier(keys) for keys, fast in tiers]
    expected = naive(KEYS, [keys for keys, _ in tiers])
    assert stored_prefix(KEYS, views) == expected
    # Slow tiers are asked once per chunk, never beyond the chunk of the first block
    # nobody holds, and only about blocks that no faster tier holds.
    chunks_needed = min(len(expected) // CHUNK + 1, -(-len(KEYS) // CHUNK))
    for index, view in enumerate(views):
        if isinstance(view, SlowTier):
            assert view.round_trips <= chunks_needed
            assert all(KEYS.index(key) < chunks_needed * CHUNK for key in view.asked)
            faster = set().union(*(keys for keys, _ in tiers[:index]))
            assert not faster.intersection(view.asked)


def test_slow_tiers_are_asked_only_about_in_memory_misses() -> None:
    slow = SlowTier(set(KEYS))
    assert stored_prefix(KEYS, [mirror(set(KEYS[:8])), slow]) == [0] * 8 + [1] * 4
    assert slow.asked == KEYS[8:]
    assert slow.round_trips == 1


def test_mirror_never_evicts_blocks_used_in_the_current_step() -> None:
    tier = MirroredTier(2)
    assert tier.admit(KEYS[0], step=1) and tier.admit(KEYS[1], step=1)
    assert not tier.admit(KEYS[2], step=1)  # Both residents are pinned by step 1.
    assert tier.take_evictions() == []
    tier.touch(KEYS[0], step=2)
    assert tier.admit(KEYS[2], step=2)
    assert tier.take_evictions() == [KEYS[1]]
    assert tier.contains_many(KEYS[:3]) == [True, False, True]
