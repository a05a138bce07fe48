"""Eviction policies: which stored block a full tier gives up.

A policy tracks keys only, not data or sizes; its owner inserts the blocks it stores,
reports reads, and asks for a victim whenever it needs room. Every entry carries a
*stamp* (the scheduler's step number; 0 where nothing needs protecting), and
:meth:`EvictionPolicy.evict` can spare every entry stamped at or after a given step,
so the blocks a step reads or writes are never evicted under it. Stamps passed to one
policy must not decrease.

Policies are chosen per tier with the ``eviction`` key: ``lru`` (the default) or
``s3fifo``, which resists scans (one pass over many blocks used once does not flush
the blocks used again and again).
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Sequence
from typing import ClassVar

from ucm.store.base import BlockKey

DEFAULT_POLICY = "lru"


class EvictionPolicy(abc.ABC):
    """Keys held by a tier, in the order the policy would give them up."""

    name: ClassVar[str]
    """The name a tier's ``eviction`` key selects the policy by."""

    @abc.abstractmethod
    def __contains__(self, key: object) -> bool:
        """Return whether the policy holds ``key``."""

    @abc.abstractmethod
    def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Return, per key, whether the policy holds it (the scheduler's lookups: one
        C-level probe per key, no Python call per key)."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Return how many keys the policy holds."""

    @abc.abstractmethod
    def insert(self, key: BlockKey, stamp: int = 0) -> None:
        """Add a block that was just stored (the key must not be held already)."""

    @abc.abstractmethod
    def access(self, key: BlockKey, stamp: int = 0) -> None:
        """Record a read of a held block (ignored for keys not held)."""

    @abc.abstractmethod
    def remove(self, key: BlockKey) -> None:
        """Forget a block that was deleted by other means (ignored for keys not held)."""

    @abc.abstractmethod
    def evict(self, keep_from: int | None = None) -> BlockKey | None:
        """Choose a victim, forget it and return it.

        Args:
            keep_from: Spare every entry stamped at or after this; None spares none.

        Returns:
            The victim's key, or None when every held entry is spared (or none is held).
        """


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self) -> None:
        self._stamps: OrderedDict[BlockKey, int] = OrderedDict()  # Least recent first.

    def __contains__(self, key: object) -> bool:
        return key in self._stamps

    def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Return, per key, whether the policy holds it."""
        return list(map(self._stamps.__contains__, keys))

    def __len__(self) -> int:
        return len(self._stamps)

    def insert(self, key: BlockKey, stamp: int = 0) -> None:
        """Add ``key`` as the most recently used block."""
        self._stamps[key] = stamp
        self._stamps.move_to_end(key)

    def access(self, key: BlockKey, stamp: int = 0) -> None:
        """Make ``key`` the most recently used block."""
        if key in self._stamps:
            self.insert(key, stamp)

    def remove(self, key: BlockKey) -> None:
        """Forget ``key``."""
        self._stamps.pop(key, None)

    def evict(self, keep_from: int | None = None) -> BlockKey | None:
        """Return the least recently used key, unless it (and so every key) is spared."""
        if not self._stamps:
            return None
        key, stamp = next(iter(self._stamps.items()))
        if keep_from is not None and stamp >= keep_from:
            return None  # Stamps only grow, so the oldest entry is the least spared.
        del self._stamps[key]
        return key


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO (Yang et al., SOSP 2023): a small probationary FIFO, a main FIFO, and a
    ghost list of keys recently evicted from the small one.

    New blocks enter the small queue (about a tenth of the entries); those read again
    before they reach its end move to the main queue, the others are evicted and
    remembered as ghosts. A ghost stored again goes straight to the main queue, where
    each read earns a block one more pass (up to three) before it is evicted. So a
    scan of blocks used once passes through the small queue without flushing the
    blocks that are used again and again.
    """

    name = "s3fifo"
    SMALL_FRACTION = 0.1
    MAX_FREQUENCY = 3

    def __init__(self) -> None:
        self._small: OrderedDict[BlockKey, int] = OrderedDict()  # Key -> stamp, oldest first.
        self._main: OrderedDict[BlockKey, int] = OrderedDict()
        self._frequency: dict[BlockKey, int] = {}  # Exactly the keys of both queues.
        self._ghosts: OrderedDict[BlockKey, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._frequency

    def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Return, per key, whether the policy holds it."""
        return list(map(self._frequency.__contains__, keys))

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def insert(self, key: BlockKey, stamp: int = 0) -> None:
        """Add ``key`` to the small queue, or to the main one if it is a ghost."""
        if key in self._ghosts:
            del self._ghosts[key]
            self._main[key] = stamp
        else:
            self._small[key] = stamp
        self._frequency[key] = 0

    def access(self, key: BlockKey, stamp: int = 0) -> None:
        """Count a read of ``key`` (up to three) and stamp it."""
        queue = self._small if key in self._small else self._main
        if key in queue:
            queue[key] = stamp
            self._frequency[key] = min(self._frequency[key] + 1, self.MAX_FREQUENCY)

    def remove(self, key: BlockKey) -> None:
        """Forget ``key`` (it does not become a ghost)."""
        if self._small.pop(key, None) is not None or self._main.pop(key, None) is not None:
            del self._frequency[key]

    def evict(self, keep_from: int | None = None) -> BlockKey | None:
        """Return the next victim of the small or the main queue.

        Spared entries go back to the end of their queue; once a queue has been
        passed through with every entry spared, the other one is used; when both
        have, there is no victim.
        """
        spared = {True: 0, False: 0}  # Entries spared in a row, per queue (small: True).
        while True:
            small_left = spared[True] < len(self._small)
            main_left = spared[False] < len(self._main)
            if not (small_left or main_left):
                return None
            from_small = small_left and (
                not main_left or len(self._small) >= self.SMALL_FRACTION * len(self)
            )
            queue = self._small if from_small else self._main
            key, stamp = queue.popitem(last=False)
            if keep_from is not None and stamp >= keep_from:
                queue[key] = stamp
                spared[from_small] += 1
                continue
            spared = {True: 0, False: 0}
            if self._frequency[key] > 0:
                # Read while on probation: promoted; read since its last pass in the
                # main queue: one more pass.
                self._main[key] = stamp
                self._frequency[key] = 0 if from_small else self._frequency[key] - 1
                continue
            del self._frequency[key]
            if from_small:
                self._ghosts[key] = None
                while len(self._ghosts) > max(len(self._main), 1):
                    self._ghosts.popitem(last=False)
            return key


POLICIES: dict[str, type[EvictionPolicy]] = {
    policy.name: policy for policy in (LRUPolicy, S3FIFOPolicy)
}
"""Policies by the name a tier's ``eviction`` key selects."""


def make_policy(name: str) -> EvictionPolicy:
    """Return a new, empty policy of the given name.

    Raises:
        ValueError: No policy has that name.
    """
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}") from None
