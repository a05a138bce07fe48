"""The ``dram`` backend: a bounded, in-process pool of CPU memory with LRU eviction.

Each block is one ``bytearray``; blocks live only as long as the process. The pool
never holds more payload bytes than its capacity and evicts the least recently used
blocks (a load or a repeated dump counts as a use) to make room for new ones.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

from ucm.store.base import (
    Backend,
    BlockKey,
    Capabilities,
    CompletedTask,
    Segments,
    Task,
    Usage,
    gather,
    scatter,
    segments_nbytes,
)

if TYPE_CHECKING:
    from typing import Self

    from ucm.config import TierConfig


class DramBackend(Backend):
    """A thread-safe LRU pool of CPU memory holding at most ``capacity_bytes`` of payload."""

    capabilities: ClassVar[Capabilities] = Capabilities(persistent=False, shared=False)
    option_types: ClassVar[Mapping[str, type]] = {}

    def __init__(self, capacity_bytes: int) -> None:
        """Create an empty pool.

        Args:
            capacity_bytes: The most payload bytes the pool holds at once.

        Raises:
            ValueError: ``capacity_bytes`` is negative.
        """
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must not be negative, got {capacity_bytes}")
        self._capacity = capacity_bytes
        self._blocks: OrderedDict[BlockKey, bytearray] = OrderedDict()
        self._used = 0
        # Buffers of evicted or deleted blocks, kept for reuse: writing into memory that
        # was touched before runs at copy speed, fresh pages first fault in one by one.
        self._spare: list[bytearray] = []
        self._spare_bytes = 0
        self._reading: Counter[int] = Counter()  # id() of blocks being copied out -> readers.
        self._lock = threading.Lock()

    @classmethod
    def from_tier(cls, tier: TierConfig) -> Self:
        """Build the pool from its tier configuration (it takes no options).

        Args:
            tier: The tier's settings; only ``tier.capacity`` is used.
        """
        return cls(tier.capacity)

    def lookup(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Report which keys are in the pool, without counting it as a use.

        Args:
            keys: The keys to check.

        Returns:
            One flag per key, True where the key is stored.
        """
        with self._lock:
            return [key in self._blocks for key in keys]

    def load(self, keys: Sequence[BlockKey], payloads: Sequence[Segments]) -> Task:
        """Copy stored payloads straight into the caller's buffers.

        Args:
            keys: The keys to read.
            payloads: Writable segments per key, together exactly the size of its payload.

        Returns:
            A finished task: per key, whether its segments were filled.
        """
        results = []
        for key, segments in zip(keys, payloads, strict=True):
            size = segments_nbytes(segments)
            with self._lock:
                block = self._blocks.get(key)
                if block is None or len(block) != size:
                    results.append(False)
                    continue
                self._blocks.move_to_end(key)
                self._reading[id(block)] += 1  # Not reused for another block meanwhile.
            try:
                scatter(memoryview(block), segments)
            finally:
                with self._lock:
                    self._reading[id(block)] -= 1
                    if not self._reading[id(block)]:
                        del self._reading[id(block)]
            results.append(True)
        return CompletedTask(results)

    def dump(self, keys: Sequence[BlockKey], payloads: Sequence[Segments]) -> Task:
        """Copy payloads into the pool, evicting least recently used blocks to make room.

        Args:
            keys: The keys to write; a key already stored only counts as a use.
            payloads: Segments per key whose concatenation is its payload.

        Returns:
            A finished task: per key, whether it is now stored (False for a payload
            larger than the whole pool, which evicts nothing).
        """
        return CompletedTask(
            [self._dump_one(key, segments) for key, segments in zip(keys, payloads, strict=True)]
        )

    def delete(self, keys: Sequence[BlockKey]) -> None:
        """Remove keys from the pool; keys that are not stored are ignored.

        Args:
            keys: The keys to remove.
        """
        with self._lock:
            for key in keys:
                block = self._blocks.pop(key, None)
                if block is not None:
                    self._used -= len(block)
                    self._keep_spare(block)

    def usage(self) -> Usage:
        """Return the exact payload bytes and number of blocks held."""
        with self._lock:
            return Usage(
                used_bytes=self._used, capacity_bytes=self._capacity, num_blocks=len(self._blocks)
            )

    def close(self) -> None:
        """Drop every block and release the memory."""
        with self._lock:
            self._blocks.clear()
            self._spare.clear()
            self._used = self._spare_bytes = 0

    def _dump_one(self, key: BlockKey, segments: Segments) -> bool:
        size = segments_nbytes(segments)
        if size > self._capacity:
            return False
        if self._touch(key):
            return True
        with self._lock:
            block = self._reuse_or_make_room(size)
            self._used += size  # Reserved now, so concurrent dumps stay within capacity.
        gather(segments, memoryview(block))  # Copied outside the lock; published under it.
        with self._lock:
            if key in self._blocks:  # Another thread stored it meanwhile.
                self._blocks.move_to_end(key)
                self._used -= size
                self._keep_spare(block)
            else:
                self._blocks[key] = block
        return True

    def _keep_spare(self, block: bytearray) -> None:
        """Keep a no longer used buffer for reuse, unless a reader still copies out of it.

        The caller holds the lock.
        """
        if id(block) in self._reading:
            return  # Freed once the reader lets go of it.
        self._spare.append(block)
        self._spare_bytes += len(block)

    def _reuse_or_make_room(self, size: int) -> bytearray:
        """Return a buffer of ``size`` bytes within capacity; the caller holds the lock.

        A spare buffer of that size is reused first; otherwise spare buffers of other
        sizes are dropped and least recently used blocks evicted until there is room.
        """
        for index, spare in enumerate(self._spare):
            if len(spare) == size:
                self._spare_bytes -= size
                return self._spare.pop(index)
        while self._used + self._spare_bytes + size > self._capacity:
            if self._spare:
                self._spare_bytes -= len(self._spare.pop(0))
            elif self._blocks:
                _, evicted = self._blocks.popitem(last=False)
                self._used -= len(evicted)
                if len(evicted) == size and id(evicted) not in self._reading:
                    return evicted
                self._keep_spare(evicted)
            else:
                break
        return bytearray(size)

    def _touch(self, key: BlockKey) -> bool:
        with self._lock:
            if key not in self._blocks:
                return False
            self._blocks.move_to_end(key)
            return True
