"""How much of a file the page cache holds (``mincore``): tells cached I/O from direct I/O."""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterable
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_bytes(path: Path) -> int:
    """Return how many bytes of ``path`` are in the page cache, in whole pages.

    Mapping the file does not read it, so the answer is not disturbed by asking.

    Raises:
        OSError: The file cannot be opened or mapped.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            pages = -(-size // mmap.PAGESIZE)
            vector = ctypes.create_string_buffer(pages)
            if _libc.mincore(address, size, vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            return sum(byte & 1 for byte in vector.raw) * mmap.PAGESIZE
        finally:
            _libc.munmap(address, size)
    finally:
        os.close(fd)


def resident_fraction(paths: Iterable[Path]) -> float:
    """Return the fraction of the files' bytes (rounded up to pages) in the page cache."""
    resident = total = 0
    for path in paths:
        resident += resident_bytes(path)
        total += -(-path.stat().st_size // mmap.PAGESIZE) * mmap.PAGESIZE
    return resident / total if total else 0.0
