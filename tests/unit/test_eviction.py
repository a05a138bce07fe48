"""Eviction policies: invariants under random use, LRU order, S3-FIFO scan resistance,
and their selection in the configuration."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucm.config import ConfigError, parse_config
from ucm.eviction import POLICIES, EvictionPolicy, LRUPolicy, S3FIFOPolicy, make_policy
from ucm.integration.vllm.residency import MirroredTier
from ucm.store.base import BlockKey

KEYS = [BlockKey(bytes([i]) * 32) for i in range(40)]

operations = st.lists(
    st.tuples(
        st.sampled_from(["insert", "access", "remove", "evict", "evict_keep"]),
        st.integers(0, len(KEYS) - 1),
        st.integers(0, 2),  # How far the stamp moves on.
    ),
    max_size=300,
)


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=200, deadline=None)
@given(ops=operations)
def test_policy_holds_exactly_what_was_inserted_and_not_yet_given_up(
    name: str, ops: list[tuple[str, int, int]]
) -> None:
    policy = make_policy(name)
    stamps: dict[BlockKey, int] = {}  # What the policy must hold, with each key's stamp.
    step = 0
    for op, index, advance in ops:
        step += advance
        key = KEYS[index]
        if op == "insert" and key not in stamps:
            policy.insert(key, step)
            stamps[key] = step
        elif op == "access":
            policy.access(key, step)
            if key in stamps:
                stamps[key] = step
        elif op == "remove":
            policy.remove(key)
            stamps.pop(key, None)
        elif op.startswith("evict"):
            keep_from = step if op == "evict_keep" else None
            victim = policy.evict(keep_from)
            if victim is None:  # Only when nothing may be given up.
                assert all(keep_from is not None and s >= keep_from for s in stamps.values())
            else:
                assert victim in stamps
                assert keep_from is None or stamps.pop(victim) < keep_from
                stamps.pop(victim, None)
        assert len(policy) == len(stamps)
        assert all((key in policy) == (key in stamps) for key in KEYS)
        assert policy.contains_many(KEYS) == [key in stamps for key in KEYS]


def test_lru_gives_up_the_least_recently_used_first() -> None:
    policy = LRUPolicy()
    for key in KEYS[:4]:
        policy.insert(key)
    policy.access(KEYS[0])
    assert [policy.evict() for _ in range(5)] == [*KEYS[1:4], KEYS[0], None]


def hot_hits_after_scan(policy: EvictionPolicy, capacity: int) -> int:
    """Use a hot set again and again, scan many blocks used once, then count hot hits."""

    def use(key: BlockKey) -> bool:
        if key in policy:
            policy.access(key)
            return True
        while len(policy) >= capacity:
            policy.evict()
        policy.insert(key)
        return False

    hot = [BlockKey(b"hot" + i.to_bytes(29, "big")) for i in range(capacity // 2)]
    for _ in range(4):
        for key in hot:
            use(key)
    for i in range(capacity * 10):
        use(BlockKey(b"scan" + i.to_bytes(28, "big")))
    return sum(key in policy for key in hot)


def test_s3fifo_keeps_the_hot_set_through_a_scan_that_flushes_lru() -> None:
    assert hot_hits_after_scan(LRUPolicy(), 100) == 0
    assert hot_hits_after_scan(S3FIFOPolicy(), 100) == 50


def test_ghost_stored_again_goes_to_the_main_queue() -> None:
    policy = S3FIFOPolicy()
    for key in KEYS[:10]:
        policy.insert(key)
    assert policy.evict() == KEYS[0]  # Never read: out of the small queue, as a ghost.
    policy.insert(KEYS[0])  # Seen again soon: it was worth keeping.
    victims = [policy.evict() for _ in range(9)]
    assert victims == KEYS[1:10] and KEYS[0] in policy


def test_mirror_with_s3fifo_never_evicts_blocks_used_in_the_current_step() -> None:
    tier = MirroredTier(2, S3FIFOPolicy())
    assert tier.admit(KEYS[0], step=1) and tier.admit(KEYS[1], step=1)
    assert not tier.admit(KEYS[2], step=1)  # Both residents are pinned by step 1.
    tier.touch(KEYS[0], step=2)
    assert tier.admit(KEYS[2], step=2)
    assert tier.take_evictions() == [KEYS[1]]
    assert tier.contains_many(KEYS[:3]) == [True, False, True]


def test_tier_eviction_is_parsed_and_checked() -> None:
    tiers = [{"backend": "dram", "capacity": "1MiB", "eviction": "s3fifo"}]
    assert parse_config({"tiers": tiers}).tiers[0].eviction == "s3fifo"
    assert parse_config({"tiers": [{"backend": "dram", "capacity": 1}]}).tiers[0].eviction == "lru"
    tiers[0]["eviction"] = "arc"
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.eviction: .*'arc'"):
        parse_config({"tiers": tiers})
