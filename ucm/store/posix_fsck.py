"""Offline tools for a ``posix`` store: ``ucm fsck``, ``ucm du`` and ``ucm gc``.

:func:`fsck` reads every block file of a store, verifies its trailer and digest, and
counts what it finds; with ``repair`` it removes damaged blocks and the temporary files
of writers that died. :func:`disk_usage` only lists files, for a quick size report.
:func:`trim` removes the least recently used blocks (by file time, which every load
updates) until the store fits a size. All are safe to run while engines use the store:
block files are replaced atomically, a reader of a removed block sees a miss, and a
temporary file is removed only once its writer is gone.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ucm.store.blockfile import FORMAT_VERSION, TRAILER_BYTES, Sealer, parse_trailer
from ucm.store.posix_files import block_file_key, is_stale_tmp, list_blocks, totals_of
from ucm.store.posix_ledger import LEDGER_NAME, USERS_NAME, Ledger


@dataclass
class FsckReport:
    """What :func:`fsck` found in a store."""

    blocks: int = 0
    """Block files that verified."""
    payload_bytes: int = 0
    """Payload bytes of the blocks that verified."""
    damaged: list[Path] = field(default_factory=list)
    """Block files that did not verify (torn, corrupted, misnamed or forged)."""
    stale_tmp: list[Path] = field(default_factory=list)
    """Temporary files of writers that died (or of an hour ago)."""
    stray: list[Path] = field(default_factory=list)
    """Files in the store that are neither blocks nor temporary files."""
    other_versions: list[Path] = field(default_factory=list)
    """Directories of other block format versions (never read by this version)."""
    removed: int = 0
    """Files removed by the repair."""

    @property
    def clean(self) -> bool:
        """Whether nothing needs repair."""
        return not (self.damaged or self.stale_tmp)


@dataclass(frozen=True)
class DiskUsage:
    """The size of a store, from its file listing."""

    blocks: int
    """Block files."""
    file_bytes: int
    """Bytes of block files, trailers included."""
    tmp_files: int
    """Temporary files (writes in flight or left by dead writers)."""


def fsck(root: Path, *, secret: bytes | None = None, repair: bool = False) -> FsckReport:
    """Verify every block of the ``posix`` store at ``root``.

    Args:
        root: The store's ``path`` option (the directory holding ``v2``).
        secret: The store's signing secret, if it signs blocks.
        repair: Remove damaged blocks and stale temporary files.

    Returns:
        The counts and the paths of whatever needs attention.

    Raises:
        ValueError: ``root`` is not a directory.
    """
    if not Path(root).is_dir():
        raise ValueError(f"fsck: {str(root)!r} is not a directory")
    report = FsckReport()
    sealer = Sealer(secret)
    now = time.time()
    report.other_versions = sorted(
        path for path in Path(root).glob("v*") if path.name != f"v{FORMAT_VERSION}"
    )
    for path in _files(Path(root)):
        if path.parent.name == f"v{FORMAT_VERSION}" and path.name in (LEDGER_NAME, USERS_NAME):
            continue
        if path.suffix == ".tmp":
            with contextlib.suppress(OSError):
                if is_stale_tmp(path.name, path.stat().st_mtime, now):
                    report.stale_tmp.append(path)
            continue
        key = block_file_key(path.parent.name, path.name)
        if key is None:
            report.stray.append(path)
            continue
        try:
            data = memoryview(path.read_bytes())
        except FileNotFoundError:  # Evicted since it was listed.
            continue
        trailer = parse_trailer(data[-TRAILER_BYTES:])
        payload = data[:-TRAILER_BYTES]
        if (
            trailer is None
            or trailer.key != key
            or trailer.length != payload.nbytes
            or not sealer.verify(trailer, [payload])
        ):
            report.damaged.append(path)
        else:
            report.blocks += 1
            report.payload_bytes += payload.nbytes
    if repair:
        with _ledger(Path(root)) as ledger, ledger.locked() as totals:
            for path in report.damaged + report.stale_tmp:
                with contextlib.suppress(FileNotFoundError):
                    size = path.stat().st_size - TRAILER_BYTES
                    path.unlink()
                    report.removed += 1
                    if path.suffix == ".blk" and size >= 0:
                        totals.used_bytes -= size
                        totals.blocks -= 1
    return report


def disk_usage(root: Path) -> DiskUsage:
    """Sum the block files of the ``posix`` store at ``root`` without reading them.

    Raises:
        ValueError: ``root`` is not a directory.
    """
    if not Path(root).is_dir():
        raise ValueError(f"du: {str(root)!r} is not a directory")
    blocks = file_bytes = tmp_files = 0
    for path in _files(Path(root)):
        with contextlib.suppress(FileNotFoundError):
            if path.suffix == ".blk":
                file_bytes += path.stat().st_size
                blocks += 1
            elif path.suffix == ".tmp":
                tmp_files += 1
    return DiskUsage(blocks, file_bytes, tmp_files)


def trim(root: Path, max_bytes: int) -> tuple[int, int]:
    """Remove least recently used blocks until their payloads total at most ``max_bytes``.

    Args:
        root: The store's ``path`` option.
        max_bytes: Payload bytes to keep at most (the tier's ``capacity`` semantics).

    Returns:
        The blocks removed and the payload bytes left.

    Raises:
        ValueError: ``root`` is not a directory or ``max_bytes`` is negative.
    """
    if not Path(root).is_dir():
        raise ValueError(f"gc: {str(root)!r} is not a directory")
    if max_bytes < 0:
        raise ValueError(f"gc: the size must not be negative, got {max_bytes}")
    blocks: list[tuple[float, Path, int]] = []
    for path in _files(Path(root)):
        if path.suffix == ".blk":
            with contextlib.suppress(FileNotFoundError):
                stat = path.stat()
                blocks.append((stat.st_mtime, path, max(stat.st_size - TRAILER_BYTES, 0)))
    blocks.sort()
    total = sum(size for _, _, size in blocks)
    removed = 0
    with _ledger(Path(root)) as ledger, ledger.locked() as totals:
        for _, path, size in blocks:
            if total <= max_bytes:
                break
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed += 1
                totals.used_bytes -= size
                totals.blocks -= 1
            total -= size
    return removed, total


@contextlib.contextmanager
def _ledger(root: Path) -> Iterator[Ledger]:
    """Open the store's usage ledger, to subtract what a repair or a trim removes."""
    directory = root / f"v{FORMAT_VERSION}"
    ledger = Ledger(directory, lambda: totals_of(list_blocks(directory)))
    try:
        yield ledger
    finally:
        ledger.close()


def _files(root: Path) -> list[Path]:
    """List the files under ``root/v<FORMAT_VERSION>``, in name order."""
    files: list[Path] = []
    for top, _, names in os.walk(root / f"v{FORMAT_VERSION}"):
        files.extend(Path(top) / name for name in names)
    return sorted(files)
