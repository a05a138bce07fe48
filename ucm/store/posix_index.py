"""An in-memory view of the block files in a ``posix`` store, kept fresh in the background.

The scheduler asks, for every new request, which of its blocks are stored; asking the
filesystem means one ``stat`` per block (about 12 µs each locally, far more on NFS) on
the scheduler's hot path. :class:`DirectoryIndex` answers from a set in memory instead.
A background thread keeps the set close to the directory by re-listing only the
subdirectories whose modification time changed since it last listed them (creating,
renaming or removing a file changes its directory's time), so a refresh costs one
``stat`` per subdirectory plus a listing of the changed ones.

The view is eventually consistent: a block written or removed by any process shows
up within about one refresh interval (longer on NFS, where clients cache directory
attributes). Both kinds of staleness are safe: a block missing from the view is
recomputed, and a block in the view whose file has gone fails to load and is then
recomputed as well.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ucm.store.base import BlockKey, KeyIndex

logger = logging.getLogger(__name__)

_RECENT_NS = 2_000_000_000
"""A directory modified less than this long ago is listed again at every refresh:
filesystem timestamps are coarse (a few ms locally, a second on some NFS servers),
so a later change in the same tick would leave its time unchanged."""


class ChangedSubdirs:
    """Tells which subdirectories of a directory changed since it was last asked."""

    def __init__(self, root: Path) -> None:
        """Watch the subdirectories of ``root`` (nothing is listed until asked)."""
        self._root = root
        self._mtimes: dict[str, int] = {}

    def poll(self) -> tuple[list[str], list[str]]:
        """Return the subdirectories changed (or new) and those gone since the last poll.

        A subdirectory modified within the last two seconds counts as changed at every
        poll, since a later change in the same timestamp tick would not show.
        """
        now = time.time_ns()
        try:
            with os.scandir(self._root) as entries:
                subdirs = [entry for entry in entries if entry.is_dir(follow_symlinks=False)]
        except OSError:
            subdirs = []  # The directory vanished: every block went with it.
        changed, present = [], set()
        for subdir in subdirs:
            try:
                mtime = subdir.stat(follow_symlinks=False).st_mtime_ns
            except OSError:
                continue
            present.add(subdir.name)
            if self._mtimes.get(subdir.name) != mtime or now - mtime <= _RECENT_NS:
                changed.append(subdir.name)
                self._mtimes[subdir.name] = mtime
        gone = list(self._mtimes.keys() - present)
        for name in gone:
            del self._mtimes[name]
        return changed, gone


class DirectoryIndex(KeyIndex):
    """The keys of a two-level block directory (``root/<subdir>/<file>``), in memory."""

    def __init__(
        self,
        root: Path,
        parse: Callable[[str, str], BlockKey | None],
        refresh_seconds: float,
    ) -> None:
        """List the directory once, then keep listing what changes in a daemon thread.

        Args:
            root: The directory whose subdirectories hold the block files.
            parse: Maps a subdirectory name and a file name to the file's key, or to
                None for a file that is not a block.
            refresh_seconds: Seconds between two refreshes (must be positive).

        Raises:
            ValueError: ``refresh_seconds`` is not positive.
        """
        if refresh_seconds <= 0:
            raise ValueError(f"refresh_seconds must be positive, got {refresh_seconds}")
        self._root = root
        self._parse = parse
        self._keys: set[BlockKey] = set()
        self._listed: dict[str, frozenset[BlockKey]] = {}  # Subdir -> its keys.
        self._changes = ChangedSubdirs(root)
        self._lock = threading.Lock()  # Serializes refreshes; lookups need no lock.
        self._stop = threading.Event()
        self.refresh()
        self._thread = threading.Thread(
            target=self._refresh_until_closed,
            args=(refresh_seconds,),
            name="ucm-posix-index",
            daemon=True,
        )
        self._thread.start()

    def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Return, per key, whether its block file was present at the last refresh.

        Args:
            keys: The keys to check.
        """
        return list(map(self._keys.__contains__, keys))

    def __len__(self) -> int:
        """Return how many blocks the view holds."""
        return len(self._keys)

    def refresh(self) -> None:
        """Bring the view up to date with the directory now (the thread does it regularly)."""
        with self._lock:
            changed, gone = self._changes.poll()
            for name in changed:
                self._replace(name, self._list(name))
            for name in gone:
                self._replace(name, frozenset())
                self._listed.pop(name, None)

    def close(self) -> None:
        """Stop the refresh thread."""
        self._stop.set()
        self._thread.join()

    def _list(self, subdir: str) -> frozenset[BlockKey]:
        try:
            names = os.listdir(self._root / subdir)
        except OSError:
            return frozenset()
        parse = self._parse
        return frozenset(key for name in names if (key := parse(subdir, name)) is not None)

    def _replace(self, subdir: str, keys: frozenset[BlockKey]) -> None:
        old = self._listed.get(subdir, frozenset())
        self._keys.difference_update(old - keys)
        self._keys.update(keys - old)
        self._listed[subdir] = keys

    def _refresh_until_closed(self, refresh_seconds: float) -> None:
        while not self._stop.wait(refresh_seconds):
            try:
                self.refresh()
            except Exception:  # Keep serving the last view; the next refresh may work.
                logger.exception("ucm: refreshing the posix index of %s failed", self._root)
        self._keys.clear()  # Closed: answer misses, free the memory.
