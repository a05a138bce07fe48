"""A warning logged at most once per interval: storage faults repeat every step, and a
log line per failed call would bury everything else."""

from __future__ import annotations

import logging
import threading
import time

DEFAULT_SECONDS = 60.0
"""Least seconds between two warnings of one :class:`ThrottledWarning`."""


class ThrottledWarning:
    """Logs through ``logger.warning`` at most once every ``seconds``."""

    def __init__(self, logger: logging.Logger, seconds: float = DEFAULT_SECONDS) -> None:
        """Set up the throttle.

        Args:
            logger: Where the warnings go.
            seconds: Least seconds between two warnings.
        """
        self._logger = logger
        self._seconds = seconds
        self._last = -seconds
        self._lock = threading.Lock()

    def __call__(self, message: str, *args: object) -> None:
        """Log the warning unless one was logged within the interval.

        Args:
            message: A ``%``-style format string.
            args: Its arguments.
        """
        now = time.monotonic()
        with self._lock:
            if now - self._last < self._seconds:
                return
            self._last = now
        self._logger.warning(message, *args)
