"""File-level pieces of the ``posix`` store: names, listing, publishing, vectored I/O.

A block of key ``k`` lives at ``<store>/v2/<first 3 hex digits of k>/<hex k>.blk``;
writers stage it in ``<hex k>.<host>.<pid>.<random>.tmp`` beside it, so that the
temporary files of dead writers can be told apart and removed. The signing secret
comes from a file or an environment variable, never from the configuration itself.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ucm.store.base import BlockKey, Buffer
from ucm.store.blockfile import MAX_KEY_BYTES, TRAILER_BYTES
from ucm.store.posix_ledger import Totals

BlockEntry = tuple[float, BlockKey, int]
"""A block file's modification time, key and payload size."""
_STALE_TMP_SECONDS = 3600.0  # Age at which a leftover .tmp file is removed in any case.
_IOV_MAX = 512  # Buffers per vectored call; POSIX guarantees at least 16, Linux 1024.
_HOST_TAG = hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()


def block_file_key(subdir: str, name: str) -> BlockKey | None:
    """Return the key of the block file ``subdir/name``, or None for any other file."""
    if not name.endswith(".blk") or not name.startswith(subdir):
        return None
    try:
        key = bytes.fromhex(name[:-4])
    except ValueError:
        return None
    return BlockKey(key) if len(key) <= MAX_KEY_BYTES and len(subdir) == 3 else None


def list_blocks(
    directory: Path, remove_stale_tmp: bool = False
) -> list[tuple[float, BlockKey, int]]:
    """Return (time, key, payload size) of every block file in a store, oldest first.

    Args:
        directory: The store's version directory.
        remove_stale_tmp: Also remove temporary files that dead writers left.
    """
    found: list[BlockEntry] = []
    now = time.time()
    for entry in directory.glob("*/*"):
        with contextlib.suppress(OSError, ValueError):
            stat = entry.stat()
            if entry.suffix == ".tmp":
                if remove_stale_tmp and is_stale_tmp(entry.name, stat.st_mtime, now):
                    entry.unlink()
            elif stat.st_size >= TRAILER_BYTES:
                key = block_file_key(entry.parent.name, entry.name)
                if key is not None:
                    found.append((stat.st_mtime, key, stat.st_size - TRAILER_BYTES))
    return sorted(found)


def totals_of(blocks: Sequence[BlockEntry]) -> Totals:
    """Sum the (time, key, payload size) entries of :func:`list_blocks`."""
    return Totals(sum(size for _, _, size in blocks), len(blocks))


def publish(tmp: Path, path: Path) -> bool | None:
    """Give the written file ``tmp`` the name ``path`` unless a block already has it.

    Returns:
        True once published; None when ``path`` existed (``tmp`` is removed either way).

    Raises:
        OSError: Publishing failed.
    """
    try:
        os.link(tmp, path)  # Atomic, and never replaces another writer's block.
    except FileExistsError:
        published = None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        os.replace(tmp, path)  # No hard links here: the last writer's copy wins.
        return True
    else:
        published = True
    with contextlib.suppress(OSError):
        os.unlink(tmp)
    return published


def tmp_name(key: BlockKey, pid: int) -> str:
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


def transfer(
    call: Callable[[int, list[Buffer], int], int],
    fd: int,
    buffers: Sequence[Buffer],
    stop_unaligned: int = 1,
) -> int:
    """Run a vectored read or write (``os.preadv``/``os.pwritev``) over ``buffers`` from
    file offset 0, resuming after short transfers; return the bytes moved (fewer only
    at end of file, or where a transfer stopped short of a multiple of
    ``stop_unaligned``, from which direct I/O cannot resume)."""
    pending = [buffer.cast("B") for buffer in buffers if buffer.nbytes]
    moved = 0
    while pending:
        count = call(fd, pending[:_IOV_MAX], moved)
        if count <= 0:
            break
        moved += count
        if moved % stop_unaligned:
            break
        while pending and count >= pending[0].nbytes:
            count -= pending.pop(0).nbytes
        if count:
            pending[0] = pending[0][count:]
    return moved
