"""The ``posix`` backend: one file per block in a directory shared by many processes.

Blocks live at ``root/v2/<first 3 hex digits>/<hex key>.blk`` in the format of
:mod:`ucm.store.blockfile` (payload, then a trailer with the key, length and a checksum
or MAC). Blocks are written to a private ``.tmp`` file and renamed into place, so other
processes see whole blocks or none. Every read is verified against the trailer; a
damaged, torn or forged block is a miss and its file is removed, so that it can be
written again. Each process evicts the least recently used blocks it knows of to stay
within its capacity.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from ucm.store.base import (
    Backend,
    BlockKey,
    Buffer,
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
    MIN_SECRET_BYTES,
    TRAILER_BYTES,
    Sealer,
    parse_trailer,
)
from ucm.store.posix_index import DirectoryIndex

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from typing import Self

    from ucm.config import TierConfig

DEFAULT_INDEX_REFRESH_SECONDS = 1.0
"""Default seconds between refreshes of the scheduler's in-memory view of the store."""
_FAILURE_LOG_SECONDS = 60.0  # Least time between two warnings about failing writes.
_STALE_TMP_SECONDS = 3600.0  # Age at which a leftover .tmp file is removed in any case.
_IOV_MAX = 512  # Buffers per vectored call; POSIX guarantees at least 16, Linux 1024.
_HOST_TAG = hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()


class PosixBackend(Backend):
    """A directory of block files on local disk or NFS, bounded by an LRU byte capacity.

    Keys are at most 32 bytes; every method raises ValueError for a longer one.
    """

    capabilities: ClassVar[Capabilities] = Capabilities(persistent=True, shared=True)
    option_types: ClassVar[Mapping[str, type]] = {
        "path": str,
        "fsync": bool,
        "index_refresh_seconds": float,
        "verify": bool,
        "secret_file": str,
        "secret_env": str,
    }

    def __init__(
        self,
        root: Path,
        capacity_bytes: int,
        *,
        fsync: bool = False,
        index_refresh_seconds: float = DEFAULT_INDEX_REFRESH_SECONDS,
        verify: bool = True,
        secret: bytes | None = None,
    ) -> None:
        """Open (creating if needed) a block directory and index the blocks already in it.

        Args:
            root: The directory; blocks go under ``root/v1``.
            capacity_bytes: The most payload bytes this process keeps in the directory.
            fsync: Flush each block's data to stable storage before renaming it into place.
            index_refresh_seconds: Seconds between refreshes of the in-memory view that
                :meth:`key_index` opens; 0 opens none (every lookup asks the filesystem).
            verify: Check each loaded payload against its trailer's checksum; without
                it only the trailer is checked (a secret is always checked).
            secret: Sign every block with a MAC under this key and load only blocks
                whose MAC verifies; None stores plain checksums.

        Raises:
            ValueError: ``capacity_bytes`` or ``index_refresh_seconds`` is negative,
                ``root`` is not a writable directory, or the secret is too short.
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
        self._index: OrderedDict[BlockKey, int] = OrderedDict()  # Key -> payload size, LRU first.
        self._used = self._reserved = 0  # Payload bytes indexed; bytes of writes in flight.
        self._lock = threading.Lock()
        self.dropped_writes = 0
        """Blocks whose write failed (disk full, read-only, directory gone) since start."""
        self._dropped_since_ok = 0
        self._last_failure_log = -_FAILURE_LOG_SECONDS
        self._scan()

    @classmethod
    def from_tier(cls, tier: TierConfig) -> Self:
        """Build the backend from its tier configuration.

        Args:
            tier: The tier's settings; option ``path`` is required; ``fsync``,
                ``index_refresh_seconds``, ``verify`` and one of ``secret_file`` (a file
                holding the signing secret) or ``secret_env`` (an environment variable
                holding it) are optional.

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
            index_refresh_seconds=refresh,
            verify=options.get("verify") is not False,
            secret=read_secret(options),
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
        for key in keys:
            with contextlib.suppress(OSError):
                os.unlink(self._path(key))
            self._forget(key)

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
        """Return the payload bytes and blocks this process knows to be in the directory."""
        with self._lock:
            return Usage(self._used, self._capacity, len(self._index))

    def _path(self, key: BlockKey) -> Path:
        if len(key) > MAX_KEY_BYTES:
            raise ValueError(f"posix backend: keys are at most {MAX_KEY_BYTES} bytes, got {key!r}")
        name = key.hex()
        return self._dir / name[:3] / f"{name}.blk"

    def _scan(self) -> None:
        """Index the blocks already on disk, oldest first, and remove stale ``.tmp`` files."""
        found: list[tuple[float, BlockKey, int]] = []
        now = time.time()
        for entry in self._dir.glob("*/*"):
            with contextlib.suppress(OSError, ValueError):
                stat = entry.stat()
                if entry.suffix == ".tmp" and is_stale_tmp(entry.name, stat.st_mtime, now):
                    entry.unlink()
                elif entry.suffix == ".blk" and stat.st_size >= TRAILER_BYTES:
                    key = BlockKey(bytes.fromhex(entry.stem))
                    if self._path(key) == entry:  # Else a stray file.
                        found.append((stat.st_mtime, key, stat.st_size - TRAILER_BYTES))
        with self._lock:
            for _, key, size in sorted(found):
                self._remember(key, size)

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
            fd = os.open(self._path(key), os.O_RDONLY)
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
        raw = bytearray(TRAILER_BYTES)
        file_size = os.fstat(fd).st_size
        if file_size != size + TRAILER_BYTES:  # Only read the trailer.
            read = os.preadv(fd, [raw], max(file_size - TRAILER_BYTES, 0))
            trailer = parse_trailer(raw) if read == TRAILER_BYTES else None
            whole = trailer and trailer.key == key and trailer.length + TRAILER_BYTES == file_size
            return False if whole else None
        if _transfer(os.preadv, fd, [*segments, memoryview(raw)]) != file_size:
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
        if self._stat(key) == size:
            return True
        self._forget(key)  # In case a file of another size (a damaged one) is indexed.
        victims = []
        with self._lock:  # Evict known blocks, then reserve room for this one.
            while self._index and self._used + self._reserved + size > self._capacity:
                victims.append(self._index.popitem(last=False))
                self._used -= victims[-1][1]
            if self._used + self._reserved + size > self._capacity:
                return False  # Other threads' writes in flight fill the capacity.
            self._reserved += size
        self.delete([victim for victim, _ in victims])
        stored = self._write(key, segments, size)
        with self._lock:
            self._reserved -= size
            if stored:
                self._remember(key, size)
        return stored

    def _write(self, key: BlockKey, segments: Segments, size: int) -> bool:
        path = self._path(key)
        tmp = path.with_name(_tmp_name(key, os.getpid()))
        trailer = memoryview(self._sealer.seal(key, segments).pack())
        try:
            self._make_dirs(path.parent)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                if _transfer(os.pwritev, fd, [*segments, trailer]) != size + TRAILER_BYTES:
                    raise OSError(f"short write to {tmp}")
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
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
        return True

    def _make_dirs(self, directory: Path) -> None:
        """Create ``directory`` and any missing parent (the store may have been removed)."""
        missing = []
        while not directory.is_dir():
            missing.append(directory)
            directory = directory.parent
        for path in reversed(missing):
            path.mkdir(mode=0o700, exist_ok=True)

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
        """Record ``key`` as most recently used; the caller holds the lock."""
        if key not in self._index:
            self._index[key] = size
            self._used += size
        self._index.move_to_end(key)

    def _forget(self, key: BlockKey) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size


def block_file_key(subdir: str, name: str) -> BlockKey | None:
    """Return the key of the block file ``subdir/name``, or None for any other file."""
    if not name.endswith(".blk") or not name.startswith(subdir):
        return None
    try:
        key = bytes.fromhex(name[:-4])
    except ValueError:
        return None
    return BlockKey(key) if len(key) <= MAX_KEY_BYTES and len(subdir) == 3 else None


def _tmp_name(key: BlockKey, pid: int) -> str:
    """Return a fresh temporary file name for ``key`` written by process ``pid`` here."""
    return f"{key.hex()}.{_HOST_TAG}.{pid}.{secrets.token_hex(4)}.tmp"


def is_stale_tmp(name: str, mtime: float, now: float) -> bool:
    """Return whether a temporary file is old or was left by a dead process on this host."""
    parts = name.split(".")
    if now - mtime > _STALE_TMP_SECONDS:
        return True
    if len(parts) != 5 or parts[1] != _HOST_TAG:  # Another host's pid means nothing here.
        return False
    try:
        os.kill(int(parts[2]), 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError, OverflowError):  # Alive under another user, or no pid.
        pass
    return False


def read_secret(options: Mapping[str, object]) -> bytes | None:
    """Return the signing secret named by a tier's ``secret_file`` or ``secret_env``.

    The secret itself never appears in the configuration (which is logged).

    Raises:
        ValueError: Both options are given, or the file or variable is missing or empty.
    """
    file, env = options.get("secret_file"), options.get("secret_env")
    if file is not None and env is not None:
        raise ValueError("posix backend: give 'secret_file' or 'secret_env', not both")
    if file is not None:
        try:
            secret = Path(str(file)).read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"posix backend: secret_file {str(file)!r}: {exc}") from exc
        where = f"secret_file {str(file)!r}"
    elif env is not None:
        secret = os.environ.get(str(env), "").encode()
        where = f"secret_env: environment variable {env!r}"
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"posix backend: {where} holds {len(secret)} bytes, fewer than 16")
    return secret


def _transfer(
    call: Callable[[int, list[Buffer], int], int], fd: int, buffers: Sequence[Buffer]
) -> int:
    """Run a vectored read or write (``os.preadv``/``os.pwritev``) over ``buffers`` from
    file offset 0, resuming after short transfers; return the bytes moved (fewer only
    at end of file)."""
    pending = [buffer.cast("B") for buffer in buffers if buffer.nbytes]
    moved = 0
    while pending:
        count = call(fd, pending[:_IOV_MAX], moved)
        if count <= 0:
            break
        moved += count
        while pending and count >= pending[0].nbytes:
            count -= pending.pop(0).nbytes
        if count:
            pending[0] = pending[0][count:]
    return moved
