"""Parallel reads of a step's blocks from the tiers, with fallback between tiers.

The worker starts a step's reads before the forward pass and waits for them only
when the first layer needs its KV, so reading overlaps whatever runs in between.
Reads from disk and remote tiers run on a bounded thread pool: each tier's share of
the step is split into one batch per thread, so they proceed in parallel. Reads from
in-memory tiers are memory copies and run at once in the calling thread. A block
that its planned tier cannot serve is then tried in every other tier, in tier order;
only blocks no tier can serve are reported as failed.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ucm.store.base import Backend, BlockKey, Segments

logger = logging.getLogger(f"vllm.{__name__}")  # Under vLLM's logger tree when it runs.


@dataclass(frozen=True)
class BlockRead:
    """One block to read."""

    key: BlockKey
    """The key to read (already the rank's shard key)."""
    tier: int
    """Index of the tier to read first."""
    payload: Segments
    """Where the block goes: writable segments that together hold exactly one block."""


class PendingReads:
    """A step's reads in flight; :meth:`wait` finishes them."""

    def __init__(
        self,
        tiers: Sequence[Backend],
        reads: Sequence[BlockRead],
        batches: list[tuple[list[int], Future[list[bool]]]],
    ) -> None:
        self._tiers = tiers
        self._reads = reads
        self._batches = batches
        self._results: list[bool] | None = None

    def done(self) -> bool:
        """Return whether every first attempt has finished (:meth:`wait` may still retry)."""
        return all(future.done() for _, future in self._batches)

    def wait(self) -> list[bool]:
        """Block until every read finished; retry failed blocks in the other tiers.

        Returns:
            Per read, in order, whether some tier filled its payload. A second call
            returns the same results at once.
        """
        if self._results is None:
            ok = [False] * len(self._reads)
            for indices, future in self._batches:
                for index, done in zip(indices, future.result(), strict=True):
                    ok[index] = done
            for tier, backend in enumerate(self._tiers):
                retry = [i for i, done in enumerate(ok) if not done and self._reads[i].tier != tier]
                if retry:
                    for index, done in zip(retry, _read(backend, self._reads, retry), strict=True):
                        ok[index] = done
            self._results = ok
        return list(self._results)


class BlockReader:
    """Runs block reads on a bounded pool of threads."""

    def __init__(self, threads: int) -> None:
        """Start the pool.

        Args:
            threads: The most reads that run at once.
        """
        self._threads = threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ucm-reader")

    def start(self, tiers: Sequence[Backend], reads: Sequence[BlockRead]) -> PendingReads:
        """Start reading blocks, each from its planned tier; return at once.

        Args:
            tiers: The tiers, indexed by :attr:`BlockRead.tier`.
            reads: The blocks to read; their payloads must stay untouched until
                :meth:`PendingReads.wait` returns.

        Returns:
            The reads in flight.
        """
        by_tier: dict[int, list[int]] = defaultdict(list)
        for index, read in enumerate(reads):
            by_tier[read.tier].append(index)
        batches = []
        for tier, indices in by_tier.items():
            if tiers[tier].capabilities.medium == "memory":
                # A memory copy gains nothing from other threads: handing it over only
                # adds the wait for them to get a core (vLLM's compute threads spin).
                done: Future[list[bool]] = Future()
                done.set_result(_read(tiers[tier], reads, indices))
                batches.append((indices, done))
                continue
            size = -(-len(indices) // self._threads)
            for start in range(0, len(indices), size):
                batch = indices[start : start + size]
                batches.append((batch, self._pool.submit(_read, tiers[tier], reads, batch)))
        return PendingReads(tiers, reads, batches)

    def close(self) -> None:
        """Finish running reads and stop the threads."""
        self._pool.shutdown(wait=True)


def _read(backend: Backend, reads: Sequence[BlockRead], indices: list[int]) -> list[bool]:
    """Read the blocks ``indices`` of ``reads`` from one backend; per block, whether it was.

    A backend that raises (against its contract) fails the whole batch.
    """
    keys = [reads[i].key for i in indices]
    try:
        return backend.load(keys, [reads[i].payload for i in indices]).wait()
    except Exception:  # noqa: BLE001 - fault barrier: a failed read is a miss
        logger.exception("ucm: reading %d blocks from %r failed", len(keys), backend)
        return [False] * len(keys)
