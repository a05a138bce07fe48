"""Tiered storage: several backends stacked from the fastest (first) to the slowest (last).

A block may live in any tier. Reads try the tiers in order and copy a block found
in a slower tier into the faster ones above it; writes go through to every tier.
Each operation calls each tier once with the whole batch it concerns.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from ucm.store.base import Backend, BlockKey, Capabilities, CompletedTask, Segments, Task, Usage
from ucm.store.registry import backend_class

if TYPE_CHECKING:
    from typing import Self

    from ucm.config import TierConfig


class TieredBackend(Backend):
    """Backends composed top (fastest) to bottom, with write-through and promotion on read."""

    def __init__(self, tiers: Sequence[Backend]) -> None:
        """Stack backends.

        Args:
            tiers: The tiers, fastest first.

        Raises:
            ValueError: ``tiers`` is empty.
        """
        if not tiers:
            raise ValueError("TieredBackend needs at least one tier")
        self._tiers = tuple(tiers)
        # The capabilities depend on the tiers, so they are per instance here.
        self.capabilities = Capabilities(  # type: ignore[misc]
            persistent=any(tier.capabilities.persistent for tier in self._tiers),
            shared=any(tier.capabilities.shared for tier in self._tiers),
            supports_delete=any(tier.capabilities.supports_delete for tier in self._tiers),
            bounded=all(tier.capabilities.bounded for tier in self._tiers),
            lossy=any(tier.capabilities.lossy for tier in self._tiers),
            medium=self._tiers[-1].capabilities.medium,
        )

    @classmethod
    def from_tier(cls, tier: TierConfig) -> Self:
        """Build a one-tier stack from a tier configuration.

        Args:
            tier: The tier's settings; its ``backend`` names the backend to build.
        """
        return cls.from_tiers([tier])

    @classmethod
    def from_tiers(cls, tiers: Iterable[TierConfig]) -> Self:
        """Build the stack from tier configurations, fastest first.

        Args:
            tiers: The tiers' settings, in order; each ``backend`` names a registered backend.
        """
        return cls([backend_class(tier.backend).from_tier(tier) for tier in tiers])

    @property
    def tiers(self) -> tuple[Backend, ...]:
        """The stacked backends, fastest first."""
        return self._tiers

    def lookup(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Report which keys are stored in any tier.

        Args:
            keys: The keys to check; each tier is asked only about keys the tiers
                above it lack.

        Returns:
            One flag per key, True where some tier stores the key.
        """
        results = [False] * len(keys)
        pending = list(range(len(keys)))
        for tier in self._tiers:
            if not pending:
                break
            hits = tier.lookup([keys[i] for i in pending])
            for i, hit in zip(pending, hits, strict=True):
                results[i] = hit
            pending = [i for i, hit in zip(pending, hits, strict=True) if not hit]
        return results

    def load(self, keys: Sequence[BlockKey], payloads: Sequence[Segments]) -> Task:
        """Fill payloads from the fastest tier holding each key, promoting lower-tier hits.

        A block found in a lower tier is also dumped into every tier above it.

        Args:
            keys: The keys to read.
            payloads: Writable segments per key, together exactly the size of its payload.

        Returns:
            A finished task: per key, whether some tier filled its buffer.

        Raises:
            ValueError: ``keys`` and ``payloads`` differ in length.
        """
        if len(keys) != len(payloads):
            raise ValueError(f"got {len(keys)} keys but {len(payloads)} payloads")
        results = [False] * len(keys)
        pending = list(range(len(keys)))
        for level, tier in enumerate(self._tiers):
            if not pending:
                break
            hits = tier.load([keys[i] for i in pending], [payloads[i] for i in pending]).wait()
            found = [i for i, hit in zip(pending, hits, strict=True) if hit]
            for i in found:
                results[i] = True
            if found and level > 0:
                self._dump_to(
                    self._tiers[:level], [keys[i] for i in found], [payloads[i] for i in found]
                )
            pending = [i for i, hit in zip(pending, hits, strict=True) if not hit]
        return CompletedTask(results)

    def dump(self, keys: Sequence[BlockKey], payloads: Sequence[Segments]) -> Task:
        """Write payloads through to every tier.

        Args:
            keys: The keys to write.
            payloads: Segments per key whose concatenation is its payload.

        Returns:
            A finished task: per key, whether at least one tier stored it.

        Raises:
            ValueError: ``keys`` and ``payloads`` differ in length.
        """
        return CompletedTask(self._dump_to(self._tiers, keys, payloads))

    def delete(self, keys: Sequence[BlockKey]) -> None:
        """Remove keys from every tier; keys that are not stored are ignored.

        Args:
            keys: The keys to remove.
        """
        for tier in self._tiers:
            tier.delete(keys)

    def usage(self) -> Usage:
        """Return the tiers' usage summed (a block held by two tiers counts twice)."""
        usages = [tier.usage() for tier in self._tiers]
        return Usage(
            used_bytes=sum(usage.used_bytes for usage in usages),
            capacity_bytes=sum(usage.capacity_bytes for usage in usages),
            num_blocks=sum(usage.num_blocks for usage in usages),
        )

    def close(self) -> None:
        """Close every tier."""
        for tier in self._tiers:
            tier.close()

    @staticmethod
    def _dump_to(
        tiers: Sequence[Backend], keys: Sequence[BlockKey], payloads: Sequence[Segments]
    ) -> list[bool]:
        """Dump a batch into several tiers at once; per key, whether any tier stored it."""
        if len(keys) != len(payloads):
            raise ValueError(f"got {len(keys)} keys but {len(payloads)} payloads")
        tasks = [tier.dump(keys, payloads) for tier in tiers]
        stored = [False] * len(keys)
        for task in tasks:
            stored = [old or new for old, new in zip(stored, task.wait(), strict=True)]
        return stored
