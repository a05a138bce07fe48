"""A copy stream for tests that lags as far behind as its events allow.

:class:`LaggingStream` queues every copy and runs it only when something has to see
its result: an event of the stream is synchronized, or the compute stream is made to
wait for it (on the CPU the compute stream is the calling thread, so the copies run
then). A worker that forgets one of those waits reads staging memory before it is
filled, or lets the forward pass read pages before they are loaded, and gets wrong
bytes, as it would on a GPU whose copy stream runs late: the CPU path's tests catch
ordering bugs of the accelerator path this way. It cannot lag the other way (run a
copy before the forward pass work that :meth:`CopyStream.follow_compute` orders it
after), since on the CPU that work has already run.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from ucm.transfer.streams import CopyEvent, CopyStream


class _Mark:
    """An event of a :class:`LaggingStream`: the copies queued before it."""

    def __init__(self, stream: LaggingStream, position: int) -> None:
        self._stream = stream
        self._position = position

    def synchronize(self) -> None:
        """Run the stream's copies up to this event (in the calling thread)."""
        self._stream.catch_up(self._position)


class LaggingStream(CopyStream):
    """Queues copies and runs them, in order, only when an event forces it."""

    def __init__(self, compute_waits: bool = True) -> None:
        """Create an empty stream.

        Args:
            compute_waits: Whether :meth:`make_compute_wait` runs the copies it waits
                for. False breaks the stream on purpose (a negative control): the
                forward pass then reads pages whose loads have not run.
        """
        self._compute_waits = compute_waits
        self._queue: deque[Callable[[], None]] = deque()
        self._issued = 0  # Copies issued so far; the first ``ran`` of them ran.
        self._lock = threading.Lock()  # Held while copies run: they run one at a time.
        self.ran = 0
        """Copies that ran, each later than it was issued."""

    def follow_compute(self) -> None:
        """Do nothing: the forward pass's work before this call has already run."""

    def run(self, copy: Callable[[], None]) -> None:
        """Queue ``copy``."""
        with self._lock:
            self._queue.append(copy)
            self._issued += 1

    def record(self) -> CopyEvent:
        """Return an event after every copy queued so far."""
        with self._lock:
            return _Mark(self, self._issued)

    def make_compute_wait(self, event: CopyEvent) -> None:
        """Run the copies before ``event`` now, unless broken on purpose."""
        if self._compute_waits:
            event.synchronize()

    def catch_up(self, position: int) -> None:
        """Run the queued copies issued before ``position`` that have not run yet."""
        with self._lock:
            while self.ran < position:
                self._queue.popleft()()
                self.ran += 1
