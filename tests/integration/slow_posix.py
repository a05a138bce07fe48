"""A ``posix`` backend whose writes start late, registered as ``slow-posix``.

Imported into an engine process (``EngineSpec.imports``) it keeps background writes in
flight for many engine steps, so that a block reused before its write is done would
show in the store.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from ucm.store.base import BlockKey, Segments, Task
from ucm.store.posix import PosixBackend
from ucm.store.registry import register_backend

WRITE_DELAY_SECONDS = 0.5
"""How long every write waits before it reads its payloads."""


class SlowPosixBackend(PosixBackend):
    """A :class:`PosixBackend` whose every ``dump`` first sleeps."""

    def dump(self, keys: Sequence[BlockKey], payloads: Sequence[Segments]) -> Task:
        """Sleep, then write the blocks as ``posix`` does."""
        time.sleep(WRITE_DELAY_SECONDS)
        return super().dump(keys, payloads)


register_backend("slow-posix", SlowPosixBackend)
