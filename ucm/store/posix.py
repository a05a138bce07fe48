"""The ``posix`` backend: one file per block in a directory shared by many processes.

Blocks live at ``root/v2/<first 3 hex digits>/<hex key>.blk`` in the format of
:mod:`ucm.store.blockfile` (payload, then a trailer with the key, length and a checksum
or MAC). Blocks are written to a private ``.tmp`` file and renamed into place, so other
processes see whole blocks or none. Every read is verified against the trailer; a
damaged, torn or forged block is a miss and its file is removed, so that it can be
written again. Capacity holds for the directory as a whole: writers reserve room in a
ledger shared by every process (:mod:`ucm.store.posix_ledger`) before publishing a
block, evicting the least recently used blocks they know of (their own, those found at
start-up and those others wrote lately) until the block fits.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from ucm.eviction import DEFAULT_POLICY, make_policy
from ucm.store.base import (
    Backend,
    BlockKey,
    Capabilities,
    CompletedTask,
    KeyIndex,
    Segments,
    Task,
    Usage,
    segments_nbytes,
)
from ucm.store.blockfile import (
    FORMAT_VERSION,
    MAX_KEY_BYTES,
    TRAILER_BYTES,
    Sealer,
    parse_trailer,
    read_secret,
)
from ucm.store.posix_direct import DirectTransfers, probe
from ucm.store.posix_files import (
    block_file_key,
    list_blocks,
    publish,
    tmp_name,
    totals_of,
    transfer,
)
from ucm.store.posix_index import ChangedSubdirs, DirectoryIndex
from ucm.store.posix_ledger import Ledger, make_private_dirs

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from typing import Self

    from ucm.config import TierConfig


DEFAULT_INDEX_REFRESH_SECONDS = 1.0
"""Default seconds between refreshes of the scheduler's in-memory view of the store."""
_RECOUNT_SECONDS = 60.0  # Least time between two recounts of a full store's ledger.
_FAILURE_LOG_SECONDS = 60.0  # Least time between two warnings about failing writes.


class PosixBackend(Backend):
    """A directory of block files on local disk or NFS, bounded by an LRU byte capacity.

    Keys are at most 32 bytes; every method raises ValueError for a longer one.
    """

    capabilities: ClassVar[Capabilities] = Capabilities(persistent=True, shared=True, medium="disk")
    option_types: ClassVar[Mapping[str, type]] = {
        "path": str,
        "fsync": bool,
        "direct_io": bool,
        "index_refresh_seconds": float,
        "verify": bool,
        "secret_file": str,
        "secret_env": str,
    }
    required_options: ClassVar[frozenset[str]] = frozenset({"path"})

    def __init__(
        self,
        root: Path,
        capacity_bytes: int,
        *,
        fsync: bool = False,
        direct_io: bool = False,
        index_refresh_seconds: float = DEFAULT_INDEX_REFRESH_SECONDS,
        verify: bool = True,
        secret: bytes | None = None,
        eviction: str = DEFAULT_POLICY,
    ) -> None:
        """Open (creating if needed) a block directory and index the blocks already in it.

        Args:
            root: The directory; blocks go under ``root/v2``.
            capacity_bytes: The most payload bytes this process keeps in the directory.
            fsync: Flush each block's data to stable storage before renaming it into place.
            direct_io: Read and write block files with ``O_DIRECT``, bypassing the page
                cache (:mod:`ucm.store.posix_direct`).
            index_refresh_seconds: Seconds between refreshes of the in-memory view that
                :meth:`key_index` opens; 0 opens none (every lookup asks the filesystem).
            verify: Check each loaded payload against its trailer's checksum; without
                it only the trailer is checked (a secret is always checked).
            secret: Sign every block with a MAC under this key and load only blocks
                whose MAC verifies; None stores plain checksums.
            eviction: The eviction policy's name (:data:`ucm.eviction.POLICIES`).

        Raises:
            ValueError: ``capacity_bytes`` or ``index_refresh_seconds`` is negative,
                ``root`` is not a writable directory, its filesystem lacks ``O_DIRECT``
                while ``direct_io`` is set, or the secret is too short.
        """
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must not be negative, got {capacity_bytes}")
        if index_refresh_seconds < 0:
            raise ValueError(
                f"posix backend: index_refresh_seconds must not be negative, "
                f"got {index_refresh_seconds}"
            )
        self._index_refresh_seconds = index_refresh_seconds
        self._sealer = Sealer(secret)
        self._verify = verify or secret is not None
        self._dir = Path(root) / f"v{FORMAT_VERSION}"
        try:
            self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"posix backend: cannot create {str(root)!r}: {exc}") from exc
        if not os.access(self._dir, os.W_OK | os.X_OK):
            raise ValueError(f"posix backend: directory {str(root)!r} is not writable")
        self._capacity = capacity_bytes
        self._fsync = fsync
        self._direct: DirectTransfers | None = None
        if direct_io:
            probe(self._dir)
            self._direct = DirectTransfers()
            logger.info("ucm: posix tier %s: direct I/O (O_DIRECT)", self._dir)
        self._sizes: dict[BlockKey, int] = {}  # Payload size of each block known here.
        self._policy = make_policy(eviction)
        self._lock = threading.Lock()
        self.dropped_writes = 0
        """Blocks whose write failed (disk full, read-only, directory gone) since start."""
        self._dropped_since_ok = 0
        self._last_failure_log = -_FAILURE_LOG_SECONDS
        # Blocks other processes write count against this process's capacity too.
        self._changes = ChangedSubdirs(self._dir)
        self._changes.poll()  # Before the scan: later writes show as changes.
        self._sync_seconds = index_refresh_seconds or DEFAULT_INDEX_REFRESH_SECONDS
        self._next_sync = time.monotonic() + self._sync_seconds
        self._sync_lock = threading.Lock()
        self._next_recount = 0.0
        found = list_blocks(self._dir, remove_stale_tmp=True)
        with self._lock:
            for _, key, size in found:
                self._remember(key, size)
        try:
            self._ledger = Ledger(self._dir, lambda: totals_of(found or list_blocks(self._dir)))
        except OSError as exc:
            message = f"posix backend: cannot open the usage ledger in {str(root)!r}: {exc}"
            raise ValueError(message) from exc
        found = []  # Later recounts list the directory again.

    @classmethod
    def from_tier(cls, tier: TierConfig) -> Self:
        """Build the backend from its tier configuration.

        Args:
            tier: The tier's settings; option ``path`` is required; ``fsync``,
                ``direct_io``, ``index_refresh_seconds``, ``verify`` and one of
                ``secret_file`` (a file holding the signing secret) or ``secret_env``
                (an environment variable holding it) are optional.

        Raises:
            ValueError: The ``path`` option is missing, the directory is unusable, or
                the secret cannot be read.
        """
        options = tier.options
        if "path" not in options:
            raise ValueError("posix backend: the 'path' option is required")
        refresh = options.get("index_refresh_seconds", DEFAULT_INDEX_REFRESH_SECONDS)
        assert isinstance(refresh, float)
        return cls(
            Path(str(options["path"])),
            tier.capacity,
            fsync=options.get("fsync") is True,
            direct_io=options.get("direct_io") is True,
            index_refresh_seconds=refresh,
            verify=options.get("verify") is not False,
            secret=read_secret(options, "posix"),
            eviction=tier.eviction,
        )

    def lookup(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Report which keys have a block file (a hit counts as a use), whoever wrote it.

        Args:
            keys: The keys to check.

        Returns:
            One flag per key, True where a block file exists.
        """
        return [self._stat(key) is not None for key in keys]

    def load(self, keys: Sequence[BlockKey], payloads: Sequence[Segments]) -> Task:
        """Read block files straight into the caller's buffers (one vectored read each).

        Args:
            keys: The keys to read.
            payloads: Writable segments per key, together exactly the size of its payload.

        Returns:
            A finished task: per key, whether its segments were filled with a valid block.
        """
        return CompletedTask(
            [self._load_one(key, segments) for key, segments in zip(keys, payloads, strict=True)]
        )

    def dump(self, keys: Sequence[BlockKey], payloads: Sequence[Segments]) -> Task:
        """Write blocks atomically, evicting least recently used known blocks to make room.

        Args:
            keys: The keys to write; a key whose file exists only counts as a use.
            payloads: Segments per key whose concatenation is its payload.

        Returns:
            A finished task: per key, whether it is now stored.
        """
        return CompletedTask(
            [self._dump_one(key, segments) for key, segments in zip(keys, payloads, strict=True)]
        )

    def delete(self, keys: Sequence[BlockKey]) -> None:
        """Remove block files; missing ones (or ones that cannot be removed) are ignored.

        Args:
            keys: The keys to remove.
        """
        with self._ledger.locked() as totals:
            for key in keys:
                self._forget(key)
                freed = self._remove(key)
                if freed is not None:
                    totals.used_bytes -= freed
                    totals.blocks -= 1

    def close(self) -> None:
        """Release this process's hold on the store's ledger."""
        self._ledger.close()

    def key_index(self) -> KeyIndex | None:
        """Open an in-memory view of every block file in the directory, whoever wrote it.

        Returns:
            A :class:`DirectoryIndex` refreshed every ``index_refresh_seconds``, or None
            when that setting is 0.
        """
        if not self._index_refresh_seconds:
            return None
        return DirectoryIndex(self._dir, block_file_key, self._index_refresh_seconds)

    def usage(self) -> Usage:
        """Return the payload bytes and blocks in the directory, by the shared ledger."""
        totals = self._ledger.read()
        return Usage(totals.used_bytes, self._capacity, totals.blocks)

    def _path(self, key: BlockKey) -> Path:
        if len(key) > MAX_KEY_BYTES:
            raise ValueError(f"posix backend: keys are at most {MAX_KEY_BYTES} bytes, got {key!r}")
        name = key.hex()
        return self._dir / name[:3] / f"{name}.blk"

    def _remove(self, key: BlockKey) -> int | None:
        """Remove ``key``'s file; return its payload size, or None if it was not there.

        The caller holds the ledger and subtracts what this returns.
        """
        path = self._path(key)
        try:
            size = os.stat(path).st_size - TRAILER_BYTES
            os.unlink(path)
        except OSError:
            return None
        return max(size, 0)

    def _count_new_blocks_of_others(self) -> None:
        """Index the block files other processes wrote lately, so that this process's
        evictions keep the whole directory within capacity.

        Runs at most once per refresh interval (and never more than a tenth of the time),
        on one thread at a time. Blocks others removed stay counted until this process
        fails to find them, which only makes it evict sooner.
        """
        if time.monotonic() < self._next_sync or not self._sync_lock.acquire(blocking=False):
            return
        try:
            started = time.monotonic()
            found: list[tuple[float, BlockKey, int]] = []
            for subdir in self._changes.poll()[0]:
                with contextlib.suppress(OSError):
                    for name in os.listdir(self._dir / subdir):
                        key = block_file_key(subdir, name)
                        if key is None or key in self._sizes:
                            continue
                        with contextlib.suppress(OSError):
                            stat = os.stat(self._dir / subdir / name)
                            found.append((stat.st_mtime, key, stat.st_size - TRAILER_BYTES))
            with self._lock:
                for _, key, size in sorted(found):
                    if key not in self._sizes and size >= 0:
                        self._remember(key, size)
            elapsed = time.monotonic() - started
            self._next_sync = time.monotonic() + max(self._sync_seconds, 10 * elapsed)
        finally:
            self._sync_lock.release()

    def _stat(self, key: BlockKey) -> int | None:
        """Return the payload size of ``key``'s file, or None; mark the key used if it exists."""
        try:
            size = os.stat(self._path(key)).st_size - TRAILER_BYTES
        except OSError:
            size = -1
        if size < 0:  # Missing, or too short to be a block.
            self._forget(key)
            return None
        with self._lock:
            self._remember(key, size)
        return size

    def _load_one(self, key: BlockKey, segments: Segments) -> bool:
        try:
            fd = os.open(self._path(key), os.O_RDONLY | (self._direct.flag if self._direct else 0))
        except OSError as exc:
            if isinstance(exc, FileNotFoundError):
                self._forget(key)
            return False
        try:
            whole = self._read_verified(fd, key, segments)
            if whole:  # The file's time is its last use: restarts and `ucm gc` evict by it.
                with contextlib.suppress(OSError):
                    os.utime(fd)
        except OSError:
            return False
        finally:
            os.close(fd)
        if whole is None:  # Damaged, torn or forged: remove it so that it can be rewritten.
            self.delete([key])
            return False
        if whole:
            with self._lock:
                self._remember(key, segments_nbytes(segments))
        return whole

    def _read_verified(self, fd: int, key: BlockKey, segments: Segments) -> bool | None:
        """Read ``key``'s open block file into ``segments`` and check it.

        Returns:
            True for a verified block; False for a whole block of another size than
            ``segments`` (the caller's mistake: the file stays); None for a bad file.
        """
        size = segments_nbytes(segments)
        raw: bytes | bytearray = bytearray(TRAILER_BYTES)
        file_size = os.fstat(fd).st_size
        if file_size != size + TRAILER_BYTES:  # Only read the trailer.
            if self._direct:  # At an unaligned offset: through the page cache.
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~self._direct.flag)
            read = os.preadv(fd, [raw], max(file_size - TRAILER_BYTES, 0))
            trailer = parse_trailer(raw) if read == TRAILER_BYTES else None
            whole = trailer and trailer.key == key and trailer.length + TRAILER_BYTES == file_size
            return False if whole else None
        if self._direct:
            read, raw = self._direct.read(fd, segments, file_size)
        else:
            read = transfer(os.preadv, fd, [*segments, memoryview(raw)])
        if read != file_size:
            return None  # Cut short while being read.
        trailer = parse_trailer(raw)
        if trailer is None or trailer.key != key or trailer.length != size:
            return None
        if self._verify and not self._sealer.verify(trailer, segments):
            return None
        return True

    def _dump_one(self, key: BlockKey, segments: Segments) -> bool:
        size = segments_nbytes(segments)
        if size > self._capacity:
            return False
        existing = self._stat(key)
        if existing == size:
            return True
        if existing is not None:  # A block of another size under this key: damaged.
            self.delete([key])
        self._count_new_blocks_of_others()
        if not self._reserve(size):
            return False
        published = self._write(key, segments, size)
        if published is not True:  # Failed, or another process stored the key first.
            self._ledger.add(-size, -1)
        if published is False:
            return False
        with self._lock:
            self._remember(key, size)
        return True

    def _reserve(self, size: int) -> bool:
        """Count ``size`` more bytes in the ledger, evicting known blocks to make room.

        Returns:
            Whether the room was found (else the write is dropped).
        """
        with self._ledger.locked() as totals:
            if not self._ledger.writable:
                self._write_failed(OSError(errno.EROFS, os.strerror(errno.EROFS)))
                return False
            while totals.used_bytes + size > self._capacity:
                with self._lock:
                    if not self._sizes:
                        break
                    victim = self._policy.evict()
                    if victim is None:
                        break
                    del self._sizes[victim]
                freed = self._remove(victim)
                if freed is not None:
                    totals.used_bytes -= freed
                    totals.blocks -= 1
            now = time.monotonic()
            if totals.used_bytes + size > self._capacity and now >= self._next_recount:
                # Nothing left to evict, yet full: the ledger may count blocks that were
                # removed behind its back, or writes of killed processes. Count the disk.
                self._next_recount = now + _RECOUNT_SECONDS
                fresh = totals_of(list_blocks(self._dir))
                totals.used_bytes, totals.blocks = fresh.used_bytes, fresh.blocks
            if totals.used_bytes + size > self._capacity:
                return False
            totals.used_bytes += size
            totals.blocks += 1
        return True

    def _write(self, key: BlockKey, segments: Segments, size: int) -> bool | None:
        """Write a temporary file and publish it under ``key``'s name.

        Returns:
            True once published; None if another process published the key first
            (its block stays); False if the write failed.
        """
        path = self._path(key)
        tmp = path.with_name(tmp_name(key, os.getpid()))
        trailer = self._sealer.seal(key, segments).pack()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (self._direct.flag if self._direct else 0)
        try:
            make_private_dirs(path.parent)  # The store may have been removed.
            fd = os.open(tmp, flags, 0o600)
            try:
                if self._direct:
                    written = self._direct.write(fd, segments, trailer)
                else:
                    written = transfer(os.pwritev, fd, [*segments, memoryview(trailer)])
                if written != size + TRAILER_BYTES:
                    raise OSError(f"short write to {tmp}")
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            published = publish(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            self._write_failed(exc)
            return False
        if self._dropped_since_ok:  # Unlocked peek: almost always 0.
            with self._lock:
                resumed, self._dropped_since_ok = self._dropped_since_ok, 0
                self._last_failure_log = -_FAILURE_LOG_SECONDS
            if resumed:
                logger.warning(
                    "ucm: posix tier %s: writes resumed (%d dropped)", self._dir, resumed
                )
        return published

    def _write_failed(self, exc: OSError) -> None:
        """Count a dropped write; log the first of a run of failures, then once a minute."""
        with self._lock:
            self.dropped_writes += 1
            self._dropped_since_ok += 1
            now = time.monotonic()
            if now - self._last_failure_log < _FAILURE_LOG_SECONDS:
                return
            self._last_failure_log = now
        logger.warning(
            "ucm: posix tier %s: cannot write a block (%s); dropping writes until it "
            "works again (%d dropped so far)",
            self._dir,
            exc.strerror or exc,
            self.dropped_writes,
        )

    def _remember(self, key: BlockKey, size: int) -> None:
        """Record a block written, found or read; the caller holds the lock."""
        if key in self._sizes:
            self._policy.access(key)
        else:
            self._policy.insert(key)
        self._sizes[key] = size

    def _forget(self, key: BlockKey) -> None:
        with self._lock:
            self._sizes.pop(key, None)
            self._policy.remove(key)
