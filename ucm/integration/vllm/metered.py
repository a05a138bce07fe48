"""A backend wrapper that records each transfer in the connector's statistics.

The worker wraps every tier it opens in a :class:`MeteredBackend`: blocks, bytes and
seconds of each load and dump batch are counted under the tier's name, dumps a tier
refused as dropped writes, and the tier's usage is sampled every
:data:`USAGE_SECONDS`. The wrapped backend is otherwise used unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ucm.integration.vllm.stats import StatsRecorder
from ucm.store.base import Backend, BlockKey, KeyIndex, Segments, Task, Usage, segments_nbytes

if TYPE_CHECKING:
    from typing import Self

    from ucm.config import TierConfig

USAGE_SECONDS = 10.0
"""Least seconds between two samples of a tier's usage."""


class MeteredBackend(Backend):
    """Forwards every call to a backend and records its transfers."""

    def __init__(self, inner: Backend, name: str, recorder: StatsRecorder) -> None:
        """Wrap a backend.

        Args:
            inner: The backend doing the work.
            name: The tier's name in the stats (``<index>:<backend>``).
            recorder: Where the stats go.
        """
        self.inner = inner
        self.capabilities = inner.capabilities  # type: ignore[misc]
        self._name = name
        self._recorder = recorder
        self._next_usage = 0.0

    @classmethod
    def from_tier(cls, tier: TierConfig) -> Self:
        """Not used: wrap a built backend with the constructor instead."""
        raise TypeError("MeteredBackend wraps a backend; build it with MeteredBackend(...)")

    def lookup(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Forward to the wrapped backend."""
        return self.inner.lookup(keys)

    def lookup_prefix(self, keys: Sequence[BlockKey]) -> int:
        """Forward to the wrapped backend."""
        return self.inner.lookup_prefix(keys)

    def load(self, keys: Sequence[BlockKey], payloads: Sequence[Segments]) -> Task:
        """Load through the wrapped backend; count the blocks and bytes it filled."""
        start = time.perf_counter()
        task = self.inner.load(keys, payloads)
        results = task.wait()
        self._record("load", start, results, payloads)
        return task

    def dump(self, keys: Sequence[BlockKey], payloads: Sequence[Segments]) -> Task:
        """Dump through the wrapped backend; count stored blocks and refused ones."""
        start = time.perf_counter()
        task = self.inner.dump(keys, payloads)
        results = task.wait()
        self._record("save", start, results, payloads)
        self._recorder.count("errors|write_dropped", results.count(False))
        return task

    def delete(self, keys: Sequence[BlockKey]) -> None:
        """Forward to the wrapped backend."""
        self.inner.delete(keys)

    def usage(self) -> Usage:
        """Forward to the wrapped backend."""
        return self.inner.usage()

    def key_index(self) -> KeyIndex | None:
        """Forward to the wrapped backend."""
        return self.inner.key_index()

    def close(self) -> None:
        """Close the wrapped backend."""
        self.inner.close()

    def __repr__(self) -> str:
        return f"MeteredBackend({self.inner!r})"

    def _record(
        self, direction: str, start: float, results: list[bool], payloads: Sequence[Segments]
    ) -> None:
        recorder, name = self._recorder, self._name
        recorder.sample(f"{direction}_seconds|{name}", time.perf_counter() - start)
        recorder.count(f"{direction}_blocks|{name}", results.count(True))
        moved = sum(segments_nbytes(p) for p, ok in zip(payloads, results, strict=True) if ok)
        recorder.count(f"{direction}_bytes|{name}", moved)
        now = time.monotonic()
        if now >= self._next_usage:
            self._next_usage = now + USAGE_SECONDS
            recorder.gauge(f"used_bytes|{name}", self.inner.usage().used_bytes)
