"""Scheduler-side knowledge of which blocks each tier holds.

The worker half owns the data; the scheduler half decides what goes where. For a
tier that only this engine writes (``dram``), the scheduler keeps an exact mirror of
its contents and decides its evictions, which the worker then carries out. For a
tier shared with other processes (``posix``), the scheduler asks the store itself.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Sequence

from ucm.keys import shard_key
from ucm.store.base import Backend, BlockKey

_MISS = 1 << 30
"""Tier index of a block no tier holds: larger than any real index, so that a real tier
always compares as faster."""


def stored_prefix(keys: Sequence[BlockKey], tiers: Sequence[TierView]) -> list[int]:
    """Find the longest prefix of blocks that the tiers hold.

    In-memory tiers answer for all keys at once; tiers that need I/O are asked only
    about blocks the in-memory tiers miss, in order, stopping at the first miss.

    Args:
        keys: Keys of consecutive blocks, in prefix order.
        tiers: The tiers, fastest first.

    Returns:
        For each leading stored block, the index of the fastest tier holding it.
    """
    best = [_MISS] * len(keys)
    for index in reversed(range(len(tiers))):
        if tiers[index].in_memory:
            hits = tiers[index].contains_many(keys)
            best = [index if hit else other for hit, other in zip(hits, best, strict=True)]
    slow = [index for index, tier in enumerate(tiers) if not tier.in_memory]
    if not slow:
        return best[: best.index(_MISS)] if _MISS in best else best
    found: list[int] = []
    for key, tier in zip(keys, best, strict=True):
        for index in slow:
            if index < tier and tiers[index].contains(key):
                tier = index
                break
        if tier == _MISS:
            break
        found.append(tier)
    return found


class TierView(abc.ABC):
    """What the scheduler knows of one tier."""

    in_memory: bool = False
    """Whether ``contains`` answers from memory (no I/O), so batches of keys are cheap."""

    def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Return ``contains`` for each key."""
        return [self.contains(key) for key in keys]

    @abc.abstractmethod
    def contains(self, key: BlockKey) -> bool:
        """Return whether every shard of the block is stored in the tier."""

    @abc.abstractmethod
    def admit(self, key: BlockKey, step: int) -> bool:
        """Record that the block will be written in ``step``.

        Args:
            key: The block's key.
            step: The current scheduler step.

        Returns:
            Whether the block should be written to this tier.
        """

    def touch(self, key: BlockKey, step: int) -> None:  # noqa: B027 - optional hook
        """Record that the block is read in ``step`` (it must survive this step)."""

    def take_evictions(self) -> list[BlockKey]:
        """Return and forget the keys the worker must delete from this tier."""
        return []


class MirroredTier(TierView):
    """An exact LRU mirror of a tier that only this engine's workers write.

    The scheduler decides every eviction; a block used in the current step is never
    evicted, so a step that needs more room than that leaves new blocks out instead.
    """

    in_memory = True

    def __init__(self, capacity_blocks: int) -> None:
        self._capacity = capacity_blocks
        self._last_used: OrderedDict[BlockKey, int] = OrderedDict()
        self._evicted: list[BlockKey] = []

    def contains(self, key: BlockKey) -> bool:
        """Return whether the block is in the tier."""
        return key in self._last_used

    def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Return whether each block is in the tier."""
        stored = self._last_used
        return [key in stored for key in keys]

    def touch(self, key: BlockKey, step: int) -> None:
        """Mark the block most recently used and pin it for ``step``."""
        if key in self._last_used:
            self._last_used[key] = step
            self._last_used.move_to_end(key)

    def admit(self, key: BlockKey, step: int) -> bool:
        """Make room for the block by evicting least recently used ones, if possible."""
        if key in self._last_used:
            self.touch(key, step)
            return False
        if self._capacity <= 0:
            return False
        while len(self._last_used) >= self._capacity:
            oldest, last_step = next(iter(self._last_used.items()))
            if last_step >= step:
                return False
            del self._last_used[oldest]
            self._evicted.append(oldest)
        self._last_used[key] = step
        return True

    def take_evictions(self) -> list[BlockKey]:
        """Return the keys evicted since the last call."""
        evicted, self._evicted = self._evicted, []
        return evicted


class SharedTier(TierView):
    """A tier that other processes write too: the scheduler asks the store."""

    def __init__(self, backend: Backend, num_shards: int) -> None:
        self._backend = backend
        self._num_shards = num_shards

    def contains(self, key: BlockKey) -> bool:
        """Return whether every rank's shard of the block is stored."""
        shards: Sequence[BlockKey] = [
            shard_key(key, shard, self._num_shards) for shard in range(self._num_shards)
        ]
        return all(self._backend.lookup(shards))

    def admit(self, key: BlockKey, step: int) -> bool:
        """Write every block: the store keeps itself within its capacity."""
        return True
