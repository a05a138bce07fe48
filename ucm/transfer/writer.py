"""Write-behind: store writes run on a bounded background thread pool.

The worker copies a step's blocks out of vLLM's paged buffer into staging memory
within the step (on an accelerator, queued on a copy stream that a write waits for
first), so vLLM may reuse those blocks at once; writing the staging memory to its
tiers then happens here, off the step's critical path. Pending
bytes are bounded (a step waits only when the bound is reached), a read of a key
first waits for that key's pending write, and ``flush`` waits for everything.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from ucm.store.base import Backend, BlockKey, Segments, segments_nbytes

logger = logging.getLogger(__name__)
_LOG_SECONDS = 60.0  # Least time between two warnings about failed writes.


class BackgroundWriter:
    """Runs ``Backend.dump`` calls on background threads, with bounded pending bytes."""

    def __init__(self, max_pending_bytes: int, threads: int = 2) -> None:
        """Start the pool.

        Args:
            max_pending_bytes: Bytes that may wait to be written before ``submit`` blocks.
            threads: Concurrent writes.
        """
        self._max_pending = max_pending_bytes
        self._pending_bytes = 0
        self._pending: dict[BlockKey, Future[int]] = {}
        self._done = threading.Condition()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ucm-writer")
        self.failed_blocks = 0
        """Blocks whose background write failed since start (they are future misses)."""
        self._last_log = -_LOG_SECONDS

    def submit(
        self,
        backend: Backend,
        keys: Sequence[BlockKey],
        payloads: Sequence[Segments],
        on_done: Callable[[], None],
        ready: Callable[[], None] | None = None,
    ) -> None:
        """Write blocks in the background; the payloads must stay valid until ``on_done``.

        Blocks (backpressure) while more than ``max_pending_bytes`` are waiting.

        Args:
            backend: The tier to write.
            keys: The keys to write.
            payloads: Segments per key whose concatenation is its payload.
            on_done: Called on a writer thread once the write finished, failed or not.
            ready: Called on the writer thread before the write, to wait until the
                payloads hold their bytes (copies into them may still be queued).
        """
        nbytes = sum(segments_nbytes(segments) for segments in payloads)
        with self._done:
            self._done.wait_for(lambda: self._pending_bytes == 0 or self._fits(nbytes))
            self._pending_bytes += nbytes
            future = self._pool.submit(self._write, backend, list(keys), list(payloads), ready)
            for key in keys:
                self._pending[key] = future
        future.add_done_callback(lambda _: self._finish(keys, future, nbytes, on_done))

    def wait_for(self, keys: Sequence[BlockKey]) -> None:
        """Block until no write of any of ``keys`` is pending."""
        with self._done:
            futures = {self._pending[key] for key in keys if key in self._pending}
        for future in futures:
            future.exception()  # Waits; failures were already counted and logged.

    def flush(self) -> None:
        """Block until every submitted write has finished."""
        with self._done:
            self._done.wait_for(lambda: self._pending_bytes == 0)

    def close(self) -> None:
        """Finish pending writes and stop the threads."""
        self._pool.shutdown(wait=True)

    def _fits(self, nbytes: int) -> bool:
        return self._pending_bytes + nbytes <= self._max_pending

    @staticmethod
    def _write(
        backend: Backend,
        keys: list[BlockKey],
        payloads: list[Segments],
        ready: Callable[[], None] | None,
    ) -> int:
        """Write one batch once its payloads are ready; return how many blocks failed."""
        if ready is not None:
            ready()
        return backend.dump(keys, payloads).wait().count(False)

    def _finish(
        self,
        keys: Sequence[BlockKey],
        future: Future[int],
        nbytes: int,
        on_done: Callable[[], None],
    ) -> None:
        error = future.exception()
        failed = len(keys) if error is not None else future.result()
        on_done()
        with self._done:
            self.failed_blocks += failed
            now = time.monotonic()
            log = failed and now - self._last_log >= _LOG_SECONDS
            if log:
                self._last_log = now
            for key in keys:
                if self._pending.get(key) is future:
                    del self._pending[key]
            self._pending_bytes -= nbytes
            self._done.notify_all()
        if log:
            logger.warning(
                "ucm: %d background block writes failed since start (lately %d of %d: %s); "
                "they will be misses",
                self.failed_blocks,
                failed,
                len(keys),
                "the tier refused them" if error is None else repr(error),
            )
