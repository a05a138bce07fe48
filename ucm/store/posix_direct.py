"""Direct I/O (``O_DIRECT``) for ``posix`` block files: transfers that bypass the page cache.

With ``O_DIRECT`` the kernel moves data between the disk and the caller's memory without
keeping a copy in the page cache, so saving a large KV working set neither evicts other
data from the cache nor doubles its memory, and loads measure the storage itself. The
kernel requires every buffer address, length and file offset to be a multiple of the
device's logical block size; :data:`ALIGN` (4 KiB) is a multiple of every common one.

The file format does not change (:mod:`ucm.store.blockfile`): the payload starts at offset
0, the 64-byte trailer follows it, and readers without direct I/O read the same files.
A block is written as payload, trailer and zero padding up to the next :data:`ALIGN`
bytes, then cut back to its real length. Where every segment of a payload is aligned,
the segments themselves are transferred; otherwise the block goes through a per-thread
aligned bounce buffer (one memory copy, as a buffered transfer would make into the
page cache).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy

from ucm.store.base import Buffer, Segments, gather, scatter, segments_nbytes
from ucm.store.posix_files import transfer

ALIGN = 4096
"""Alignment of every direct transfer's addresses, lengths and offsets, in bytes."""
_BOUNCE_GRANULE = 1 << 20  # Bounce buffers grow in steps of this many bytes.


def direct_flag() -> int:
    """Return ``os.O_DIRECT``.

    Raises:
        ValueError: The platform has no ``O_DIRECT``.
    """
    flag: int | None = getattr(os, "O_DIRECT", None)
    if flag is None:
        raise ValueError("posix backend: direct_io needs O_DIRECT, which this platform lacks")
    return flag


def probe(directory: Path) -> None:
    """Check that files in ``directory`` can be written and read with ``O_DIRECT``.

    Raises:
        ValueError: Direct I/O is not available there; the message names the directory.
    """
    flag = direct_flag()
    path = directory / f".direct-io-probe.{os.getpid()}.{secrets.token_hex(4)}"
    buffer = aligned_buffer(ALIGN)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | flag, 0o600)
        try:
            if os.pwritev(fd, [buffer], 0) != ALIGN or os.preadv(fd, [buffer], 0) != ALIGN:
                raise OSError("short transfer")
        finally:
            os.close(fd)
    except OSError as exc:
        raise ValueError(
            f"posix backend: direct_io is set but the filesystem of {str(directory)!r} "
            f"does not support O_DIRECT ({exc.strerror or exc}); unset direct_io"
        ) from exc
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


def aligned_buffer(nbytes: int) -> Buffer:
    """Return ``nbytes`` of zeroed memory starting on a page boundary (anonymous ``mmap``)."""
    return memoryview(mmap.mmap(-1, nbytes))


def is_aligned(buffer: Buffer) -> bool:
    """Return whether ``buffer`` starts and ends on :data:`ALIGN` boundaries."""
    if buffer.nbytes % ALIGN:
        return False
    address = numpy.frombuffer(buffer, numpy.uint8).ctypes.data
    return address % ALIGN == 0


def padded(nbytes: int) -> int:
    """Return ``nbytes`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-nbytes // ALIGN) * ALIGN


class DirectTransfers:
    """Reads and writes whole block files opened with ``O_DIRECT``.

    Thread-safe: each thread has its own bounce buffer and trailer page.
    """

    def __init__(self) -> None:
        """Set up per-thread buffers (allocated on first use)."""
        self.flag = direct_flag()
        """The flag to add to ``os.open`` for files this object transfers."""
        self._local = threading.local()

    def write(self, fd: int, segments: Segments, trailer: bytes) -> int:
        """Write ``segments`` then ``trailer`` from offset 0 of a new file, and cut the file
        to their length.

        Args:
            fd: A file opened for writing with :attr:`flag`.
            segments: The payload.
            trailer: The trailer to follow it.

        Returns:
            The bytes the file now holds (payload plus trailer unless a write was short).

        Raises:
            OSError: A write failed.
        """
        size = segments_nbytes(segments)
        length = size + len(trailer)
        if all(is_aligned(segment) for segment in segments):
            tail = self._tail()
            tail[: len(trailer)] = trailer
            tail[len(trailer) :] = bytes(ALIGN - len(trailer))
            iovecs = [*segments, tail[: padded(len(trailer))]]
        else:
            bounce = self._bounce(padded(length))
            gather(segments, bounce)
            bounce[size:length] = trailer
            bounce[length:] = bytes(len(bounce) - length)
            iovecs = [bounce]
        written = _transfer(os.pwritev, fd, iovecs)
        os.ftruncate(fd, min(written, length))
        return min(written, length)

    def read(self, fd: int, segments: Segments, file_size: int) -> tuple[int, bytes]:
        """Read a whole block file of ``file_size`` bytes: the payload into ``segments``.

        Args:
            fd: The file, opened for reading with :attr:`flag`.
            segments: Writable buffers for the payload (``file_size`` minus the trailer).
            file_size: The file's size.

        Returns:
            The bytes read (``file_size`` unless the file was cut meanwhile) and the
            trailer's bytes.

        Raises:
            OSError: A read failed.
        """
        size = segments_nbytes(segments)
        if all(is_aligned(segment) for segment in segments):
            tail = self._tail()
            read = _transfer(os.preadv, fd, [*segments, tail[: padded(file_size - size)]])
            return read, bytes(tail[: max(read - size, 0)])
        bounce = self._bounce(padded(file_size))
        read = _transfer(os.preadv, fd, [bounce])
        if read >= size:
            scatter(bounce[:size], segments)
        return read, bytes(bounce[size : max(read, size)])

    def _tail(self) -> Buffer:
        tail = getattr(self._local, "tail", None)
        if tail is None:
            tail = self._local.tail = aligned_buffer(ALIGN)
        return tail

    def _bounce(self, nbytes: int) -> Buffer:
        bounce: Buffer | None = getattr(self._local, "bounce", None)
        if bounce is None or bounce.nbytes < nbytes:
            bounce = self._local.bounce = aligned_buffer(
                -(-nbytes // _BOUNCE_GRANULE) * _BOUNCE_GRANULE
            )
        return bounce[:nbytes]


def _transfer(
    call: Callable[[int, list[Buffer], int], int], fd: int, iovecs: Sequence[Buffer]
) -> int:
    """Run a direct vectored transfer from offset 0; a short transfer can only resume at
    an aligned offset, so an unaligned one ends it (the caller sees the short count)."""
    return transfer(call, fd, iovecs, stop_unaligned=ALIGN)
