"""Tests of the ``posix`` backend's direct I/O (``O_DIRECT``): same files, no page cache."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from ucm.config import TierConfig
from ucm.store.base import Backend, BlockKey, Buffer
from ucm.store.blockfile import TRAILER_BYTES
from ucm.store.posix import PosixBackend
from ucm.store.posix_direct import ALIGN, aligned_buffer, is_aligned
from ucm.testing.conformance import BackendConformance
from ucm.testing.pagecache import resident_bytes, resident_fraction


class TestPosixDirectConformance(BackendConformance):
    def make_backend(self, capacity_bytes: int, tmp_path: Path) -> Backend:
        return PosixBackend(tmp_path / "store", capacity_bytes, direct_io=True)


def keys(count: int, seed: int = 0) -> list[BlockKey]:
    return [BlockKey(bytes([seed, index]) * 8) for index in range(count)]


def block_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.blk"))


def drop_from_page_cache(paths: list[Path]) -> None:
    os.sync()  # Dirty pages cannot be dropped.
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def in_page_cache(paths: list[Path]) -> bool:
    """Return True for files (almost) wholly cached, False for files not cached at all."""
    fraction = resident_fraction(paths)
    assert fraction == 0.0 or fraction > 0.9, fraction
    return fraction > 0.9


def aligned_segments(blocks: int, pages: int) -> tuple[list[list[Buffer]], list[Buffer]]:
    """Return per-block lists of ``pages`` page-aligned 4 KiB segments, and the buffers."""
    buffers = [aligned_buffer(pages * ALIGN) for _ in range(blocks)]
    segments = [[b[i * ALIGN : (i + 1) * ALIGN] for i in range(pages)] for b in buffers]
    return segments, buffers


@pytest.mark.parametrize("size", [1, 100, ALIGN - TRAILER_BYTES, ALIGN, 3 * ALIGN + 17, 1 << 20])
def test_direct_and_buffered_read_each_others_files(tmp_path: Path, size: int) -> None:
    direct = PosixBackend(tmp_path, 1 << 30, direct_io=True)
    buffered = PosixBackend(tmp_path, 1 << 30)
    rows = torch.randint(0, 255, (4, size), dtype=torch.uint8)
    segments = [[memoryview(row.numpy())] for row in rows]
    written_direct, written_buffered = keys(2, 1), keys(2, 2)
    assert direct.dump(written_direct, segments[:2]).wait() == [True, True]
    assert buffered.dump(written_buffered, segments[2:]).wait() == [True, True]
    sizes = {path.stat().st_size for path in block_files(tmp_path)}
    assert sizes == {size + TRAILER_BYTES}  # Padding is cut off: one format.
    for reader in (direct, buffered):
        out = torch.zeros_like(rows)
        dest = [[memoryview(row.numpy())] for row in out]
        assert all(reader.load(written_direct + written_buffered, dest).wait())
        assert torch.equal(out, rows)


def test_aligned_segments_are_transferred_in_place(tmp_path: Path) -> None:
    backend = PosixBackend(tmp_path, 1 << 30, direct_io=True)
    segments, buffers = aligned_segments(3, 4)
    assert all(is_aligned(segment) for block in segments for segment in block)
    for index, buffer in enumerate(buffers):
        buffer[:] = bytes([index + 1]) * buffer.nbytes
    assert all(backend.dump(keys(3), segments).wait())
    out_segments, out = aligned_segments(3, 4)
    assert all(backend.load(keys(3), out_segments).wait())
    assert [bytes(b) for b in out] == [bytes(b) for b in buffers]
    assert not is_aligned(buffers[0][1 : ALIGN + 1])
    assert not is_aligned(buffers[0][: ALIGN - 1])


def test_direct_transfers_bypass_the_page_cache(tmp_path: Path) -> None:
    """Buffered I/O leaves a block in the page cache; direct I/O does not (the control)."""
    rows = torch.randint(0, 255, (8, 1 << 18), dtype=torch.uint8)
    segments = [[memoryview(row.numpy())] for row in rows]
    for direct_io in (False, True):
        root = tmp_path / str(direct_io)
        backend = PosixBackend(root, 1 << 30, direct_io=direct_io)
        assert all(backend.dump(keys(8), segments).wait())
        assert in_page_cache(block_files(root)) == (not direct_io)
        drop_from_page_cache(block_files(root))
        assert resident_fraction(block_files(root)) == 0.0
        out = torch.zeros_like(rows)
        assert all(backend.load(keys(8), [[memoryview(r.numpy())] for r in out]).wait())
        assert torch.equal(out, rows)
        assert in_page_cache(block_files(root)) == (not direct_io)


def test_resident_bytes_counts_pages_read(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_bytes(os.urandom(64 * ALIGN))
    drop_from_page_cache([path])
    assert resident_bytes(path) == 0
    with path.open("rb") as file:
        file.read(ALIGN)
    assert 0 < resident_bytes(path) <= path.stat().st_size


def test_from_tier_reads_the_option(tmp_path: Path) -> None:
    tier = TierConfig("posix", 1 << 20, {"path": str(tmp_path), "direct_io": True})
    backend = PosixBackend.from_tier(tier)
    assert backend.dump(keys(1), [[memoryview(os.urandom(ALIGN))]]).wait() == [True]
    assert resident_fraction(block_files(tmp_path)) == 0.0


def test_filesystem_without_direct_io_is_named_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def no_direct_open(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", no_direct_open)
    with pytest.raises(ValueError, match=rf"direct_io.*{tmp_path}.*O_DIRECT"):
        PosixBackend(tmp_path, 1 << 20, direct_io=True)
    assert not list(tmp_path.rglob(".direct-io-probe*"))
    PosixBackend(tmp_path, 1 << 20)  # Without direct_io the same directory is fine.
