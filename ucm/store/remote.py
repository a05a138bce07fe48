"""What the backends on remote servers (``redis``, ``mooncake``) share.

Their values are a block's payload followed by the trailer of :mod:`ucm.store.blockfile`,
so that a damaged, truncated, misplaced or forged value is found on load, removed and
counted; writes a server refuses are counted as dropped; and server faults are logged at
most once a minute.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import ClassVar

from ucm.store.base import Backend, BlockKey, Capabilities
from ucm.store.blockfile import Sealer
from ucm.store.throttled import ThrottledWarning

logger = logging.getLogger(__name__)


COMMON_OPTIONS: Mapping[str, type] = {
    "key_prefix": str,
    "retry_seconds": float,
    "verify": bool,
    "secret_file": str,
    "secret_env": str,
}
"""Tier options every remote backend takes (see the README's configuration reference)."""


class RemoteBackend(Backend):
    """Sealed values, fault counters and throttled warnings for a server's backend."""

    capabilities: ClassVar[Capabilities] = Capabilities(
        persistent=True, shared=True, bounded=False, lossy=True, medium="remote"
    )

    def __init__(self, server: str, secret: bytes | None, verify: bool) -> None:
        """Set up sealing and the counters.

        Args:
            server: The server as logs name it (no password).
            secret: Sign blocks with a MAC under this key and load only verified ones;
                None stores plain checksums.
            verify: Check each loaded payload against its checksum (a MAC is always
                checked).
        """
        self._server = server
        self._sealer = Sealer(secret)
        self._verify = verify
        self._warn = ThrottledWarning(logger)
        self._counts = threading.Lock()
        self.dropped_writes = 0
        """Blocks the server refused or could not be sent (full, unreachable) since start."""
        self.corrupt_blocks = 0
        """Values that failed their check on load (and were removed) since start."""

    def _count_dropped(self, count: int) -> None:
        with self._counts:
            self.dropped_writes += count

    def _remove_corrupt(self, keys: Sequence[BlockKey]) -> None:
        """Count, log and delete values that failed their check."""
        with self._counts:
            self.corrupt_blocks += len(keys)
        logger.warning("ucm: %d damaged blocks on %s removed", len(keys), self._server)
        self.delete(keys)


def byte_batches(sizes: Sequence[int], limit: int) -> Iterator[list[int]]:
    """Split indices into consecutive runs of at most ``limit`` bytes (one per round trip).

    A value larger than ``limit`` gets a run of its own.

    Args:
        sizes: Bytes of each value, in order.
        limit: Bytes one run may hold.
    """
    batch: list[int] = []
    total = 0
    for index, size in enumerate(sizes):
        if batch and total + size > limit:
            yield batch
            batch, total = [], 0
        batch.append(index)
        total += size
    if batch:
        yield batch
