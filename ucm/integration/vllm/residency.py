"""Scheduler-side knowledge of which blocks each tier holds.

The worker half owns the data; the scheduler half decides what goes where. For a
tier that only this engine writes (``dram``), the scheduler keeps an exact mirror of
its contents and decides its evictions, which the worker then carries out. For a
tier shared with other processes (``posix``), the scheduler asks the store's in-memory
view of its keys where it has one, else the store itself.
"""

from __future__ import annotations

import abc
import time
from collections import OrderedDict
from collections.abc import Sequence

from ucm.eviction import EvictionPolicy, LRUPolicy
from ucm.keys import shard_key
from ucm.store.base import Backend, BlockKey

UNCONFIRMED_SECONDS = 10.0
"""How long a block this engine saved to a shared tier is checked in the store itself
while the tier's in-memory view does not show it yet."""

SLOW_LOOKUP_CHUNK = 64
"""Blocks per batch asked of a tier whose lookups cost I/O."""

_MISS = 1 << 30
"""Tier index of a block no tier holds: larger than any real index, so that a real tier
always compares as faster."""


def stored_prefix(keys: Sequence[BlockKey], tiers: Sequence[TierView]) -> list[int]:
    """Find the longest prefix of blocks that the tiers hold.

    In-memory tiers answer for all keys at once; tiers that need I/O are asked only
    about blocks the faster tiers miss, one batch of :data:`SLOW_LOOKUP_CHUNK` blocks
    at a time (one round trip to a remote store), stopping after the first miss.

    Args:
        keys: Keys of consecutive blocks, in prefix order.
        tiers: The tiers, fastest first.

    Returns:
        For each leading stored block, the index of the fastest tier holding it.
    """
    slow = [index for index, tier in enumerate(tiers) if not tier.in_memory]
    if len(tiers) == 1 and not slow:  # The common case, without per-key Python work.
        hits = tiers[0].contains_many(keys)
        return [0] * (hits.index(False) if False in hits else len(hits))
    best = [_MISS] * len(keys)
    for index in reversed(range(len(tiers))):
        if tiers[index].in_memory:
            hits = tiers[index].contains_many(keys)
            best = [index if hit else other for hit, other in zip(hits, best, strict=True)]
    if not slow:
        return best[: best.index(_MISS)] if _MISS in best else best
    found: list[int] = []
    for start in range(0, len(keys), SLOW_LOOKUP_CHUNK):
        chunk = range(start, min(start + SLOW_LOOKUP_CHUNK, len(keys)))
        for index in slow:
            ask = [i for i in chunk if index < best[i]]
            if ask:
                hits = tiers[index].contains_many([keys[i] for i in ask])
                for i, hit in zip(ask, hits, strict=True):
                    if hit:
                        best[i] = index
        for i in chunk:
            if best[i] == _MISS:
                return found
            found.append(best[i])
    return found


class TierView(abc.ABC):
    """What the scheduler knows of one tier."""

    in_memory: bool = False
    """Whether ``contains`` answers from memory (no I/O), so batches of keys are cheap."""
    io_bound: bool = True
    """Whether reading a block from the tier costs I/O (disk, network), not just a copy."""

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

    def discard(self, key: BlockKey) -> None:  # noqa: B027 - optional hook
        """Forget a block whose load failed (the tier's copy is not to be trusted)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the view holds (threads, memory)."""


class MirroredTier(TierView):
    """An exact mirror of a tier that only this engine's workers write.

    The scheduler decides every eviction, by the tier's policy; a block used in the
    current step is never evicted, so a step that needs more room than that leaves
    new blocks out instead.
    """

    in_memory = True
    io_bound = False

    def __init__(self, capacity_blocks: int, policy: EvictionPolicy | None = None) -> None:
        self._capacity = capacity_blocks
        self._policy = policy if policy is not None else LRUPolicy()
        self._evicted: list[BlockKey] = []
        self._full_step = -1  # The last step in which no block could be evicted.

    def contains(self, key: BlockKey) -> bool:
        """Return whether the block is in the tier."""
        return key in self._policy

    def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Return whether each block is in the tier."""
        return self._policy.contains_many(keys)

    def touch(self, key: BlockKey, step: int) -> None:
        """Record a read of the block and pin it for ``step``."""
        self._policy.access(key, step)

    def admit(self, key: BlockKey, step: int) -> bool:
        """Make room for the block by evicting others, if possible."""
        if key in self._policy:
            self._policy.access(key, step)
            return False
        if self._capacity <= 0 or self._full_step == step:
            return False
        while len(self._policy) >= self._capacity:
            victim = self._policy.evict(keep_from=step)
            if victim is None:
                self._full_step = step  # Everything is pinned until the next step.
                return False
            self._evicted.append(victim)
        self._policy.insert(key, step)
        return True

    def take_evictions(self) -> list[BlockKey]:
        """Return the keys evicted since the last call."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def discard(self, key: BlockKey) -> None:
        """Evict a block whose load failed, so that it can be saved again."""
        if key in self._policy:
            self._policy.remove(key)
            self._evicted.append(key)


class SharedTier(TierView):
    """A tier that other processes write too: the scheduler asks the store.

    Where the backend offers an in-memory view of its keys (:meth:`Backend.key_index`),
    lookups cost no I/O. The view lags behind the store by up to one refresh, so the
    blocks this engine saved since are checked in the store itself until the view shows
    them (or for :data:`UNCONFIRMED_SECONDS` at most).
    """

    def __init__(self, backend: Backend, num_shards: int) -> None:
        self._backend = backend
        self._num_shards = num_shards
        self._index = backend.key_index()
        self.in_memory = self._index is not None
        self._unconfirmed: OrderedDict[BlockKey, float] = OrderedDict()  # Key -> deadline.
        self._purged: list[BlockKey] = []

    def contains(self, key: BlockKey) -> bool:
        """Return whether every rank's shard of the block is stored."""
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Return, per block, whether every rank's shard of it is stored."""
        lookup = self._backend.lookup if self._index is None else self._index.contains_many
        if self._num_shards == 1:
            hits = lookup(keys)
        else:
            flat = lookup([shard for key in keys for shard in self._shards(key)])
            hits = [
                all(flat[i : i + self._num_shards]) for i in range(0, len(flat), self._num_shards)
            ]
        if self._index is None:
            return hits
        self._expire_unconfirmed()
        if self._unconfirmed:
            for i, hit in enumerate(hits):
                if not hit and keys[i] in self._unconfirmed:
                    hits[i] = all(self._backend.lookup(self._shards(keys[i])))
        return hits

    def admit(self, key: BlockKey, step: int) -> bool:
        """Write every block: the store keeps itself within its capacity."""
        if self._index is not None:
            self._unconfirmed[key] = time.monotonic() + UNCONFIRMED_SECONDS
            self._unconfirmed.move_to_end(key)
        return True

    def discard(self, key: BlockKey) -> None:
        """Delete a block whose load failed or that was computed on top of one.

        With several ranks, one rank's shard may be bad while the others loaded theirs;
        those ranks cannot know whether the rest of their step was computed on bad
        activations and saved, so, as a precaution, every rank deletes its shard and
        the block is saved anew. (A single rank drops such saves itself, and the store
        removes a bad copy.)
        """
        self._unconfirmed.pop(key, None)
        if self._num_shards > 1:
            self._purged.append(key)

    def take_evictions(self) -> list[BlockKey]:
        """Return the blocks to delete from the store since the last call."""
        purged, self._purged = self._purged, []
        return purged

    def close(self) -> None:
        """Close the in-memory view, if any."""
        if self._index is not None:
            self._index.close()

    def _shards(self, key: BlockKey) -> list[BlockKey]:
        return [shard_key(key, shard, self._num_shards) for shard in range(self._num_shards)]

    def _expire_unconfirmed(self) -> None:
        now = time.monotonic()
        pending = self._unconfirmed
        while pending and next(iter(pending.values())) < now:
            pending.popitem(last=False)
