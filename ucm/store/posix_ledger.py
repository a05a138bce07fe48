"""The usage ledger of a ``posix`` store, shared by every process that writes it.

Capacity must hold for the directory as a whole, whatever number of engines, ranks
and restarts write to it. The ledger is a 16-byte file (payload bytes, block count)
next to the blocks, read and updated only under an exclusive ``flock``: a writer
reserves a block's bytes in the ledger (evicting first, under the same lock) before
it publishes the block, and whoever removes a block file subtracts it. So the
published blocks never exceed the capacity, and the ledger never counts less than
the directory holds.

A process killed between reserving and publishing leaves its reservation counted:
the ledger then over-counts, which only makes writers evict sooner. Every process
holds a shared lock on a second file for as long as it has the store open; one that
starts while no other process holds it is alone, and recounts the ledger from disk.
On a read-only filesystem the ledger lives in memory and reports itself not
writable until the file can be written again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

_RECORD = struct.Struct("<QQ")  # Payload bytes, blocks.
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)
LEDGER_NAME = "usage"
"""File name of the ledger inside the store's version directory."""
USERS_NAME = "users"
"""File name of the lock every process that has the store open holds shared."""


@dataclass
class Totals:
    """What the ledger says the directory holds."""

    used_bytes: int
    """Payload bytes of the published blocks and the reservations in flight."""
    blocks: int
    """Blocks published or reserved."""


class Ledger:
    """Usage totals of one store directory, consistent across processes."""

    def __init__(self, directory: Path, recount: Callable[[], Totals]) -> None:
        """Open the ledger of ``directory``, recounting it if this process is alone.

        Args:
            directory: The store's version directory.
            recount: Returns the totals of the block files on disk; called when this
                process is the only one with the store open, or the ledger is unreadable.

        Raises:
            OSError: The ledger cannot be opened, for another reason than a read-only
                filesystem.
        """
        self._thread_lock = threading.Lock()  # flock does not exclude this process's threads.
        self._directory = directory
        self._recount = recount
        self._memory = Totals(0, 0)  # The totals while the file cannot be written.
        self.writable = True
        """Whether the last use reached the ledger file (false on a read-only disk)."""
        self._users: int | None = None
        with contextlib.suppress(FileNotFoundError), _open_rdonly(directory / USERS_NAME) as fd:
            self._users = os.dup(fd)
        alone = False
        if self._users is not None:
            try:
                fcntl.flock(self._users, fcntl.LOCK_EX | fcntl.LOCK_NB)
                alone = True
            except BlockingIOError:
                pass
        if alone:
            with self.locked() as totals:
                fresh = recount()
                totals.used_bytes, totals.blocks = fresh.used_bytes, fresh.blocks
        if self._users is not None:
            fcntl.flock(self._users, fcntl.LOCK_SH)

    def read(self) -> Totals:
        """Return the current totals."""
        with self.locked() as totals:
            return Totals(totals.used_bytes, totals.blocks)

    @contextlib.contextmanager
    def locked(self) -> Iterator[Totals]:
        """Hold the ledger exclusively; what the block changes in the totals is stored.

        The file is opened for each use, so that no file stays open for writing (a
        filesystem with such files cannot be remounted read-only) and a store that was
        removed gets a new ledger. Where it cannot be opened for writing, the block
        works on totals kept in memory and :attr:`writable` turns false.

        Yields:
            The totals, to read and change.
        """
        with self._thread_lock:
            try:
                make_private_dirs(self._directory)  # It may have been removed.
                fd = os.open(self._directory / LEDGER_NAME, os.O_RDWR | os.O_CREAT, 0o600)
            except OSError as exc:
                if exc.errno not in _READ_ONLY:
                    raise
                if self.writable:  # Just became unwritable: start from the disk's totals.
                    self.writable = False
                    self._memory = self._recount()
                yield self._memory
                return
            self.writable = True
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                raw = os.pread(fd, _RECORD.size, 0)
                if len(raw) == _RECORD.size:
                    totals = Totals(*_RECORD.unpack(raw))
                else:  # New or damaged: count what is on disk.
                    totals = self._recount()
                before = (totals.used_bytes, totals.blocks)
                yield totals
                after = (max(totals.used_bytes, 0), max(totals.blocks, 0))
                if after != before or len(raw) != _RECORD.size:
                    os.pwrite(fd, _RECORD.pack(*after), 0)
            finally:
                os.close(fd)  # Releases the lock too.

    def add(self, nbytes: int, blocks: int) -> None:
        """Add to the totals (negative numbers subtract)."""
        with self.locked() as totals:
            totals.used_bytes += nbytes
            totals.blocks += blocks

    def close(self) -> None:
        """Stop counting as a user of the store."""
        if self._users is not None:
            with contextlib.suppress(OSError):
                os.close(self._users)
            self._users = None


def make_private_dirs(directory: Path) -> None:
    """Create ``directory`` and its missing parents, each with owner-only permissions."""
    missing = []
    while not directory.is_dir():
        missing.append(directory)
        directory = directory.parent
    for path in reversed(missing):
        path.mkdir(mode=0o700, exist_ok=True)


@contextlib.contextmanager
def _open_rdonly(path: Path) -> Iterator[int]:
    """Open ``path`` for reading, creating it (empty) where the filesystem allows."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o600)
    except OSError as exc:
        if exc.errno not in _READ_ONLY:
            raise
        fd = os.open(path, os.O_RDONLY)
    try:
        yield fd
    finally:
        os.close(fd)
