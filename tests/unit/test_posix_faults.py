"""Storage faults under a live ``posix`` backend: disk full, read-only, directory removed.

Writes must fail quietly (dropped and counted), reads of what is stored must go on, and
writes must resume once the fault is gone. The disk is a real 512 KiB tmpfs.
"""

from __future__ import annotations

import logging
import shutil
import stat
from pathlib import Path

import pytest

from tests.conftest import remount
from tests.unit.test_store_posix import block_path, loads
from ucm.store.posix import PosixBackend
from ucm.testing.conformance import make_key, make_payload, views

BLOCK = 100 << 10  # Five fit in the 512 KiB filesystem, with their trailers.


def dump(backend: PosixBackend, index: int) -> bool:
    payloads = views([make_payload(index, BLOCK)])
    (stored,) = backend.dump([make_key(index)], payloads).wait()
    return stored


@pytest.mark.parametrize("direct_io", [False, True])
def test_disk_full_drops_writes_then_resumes(
    small_filesystem: Path, caplog: pytest.LogCaptureFixture, direct_io: bool
) -> None:
    root = small_filesystem / "store"
    backend = PosixBackend(root, 64 << 20, direct_io=direct_io)
    with caplog.at_level(logging.WARNING, logger="ucm.store.posix"):
        stored = [dump(backend, index) for index in range(8)]
    assert stored[0] and not all(stored)
    full = stored.index(False)
    assert backend.dropped_writes == stored.count(False)
    assert "No space left on device" in caplog.text
    assert caplog.text.count("cannot write a block") == 1  # Not once per dropped write.
    assert not list(root.rglob("*.tmp")), "a failed write left its temporary file"
    assert backend.usage().used_bytes == full * BLOCK
    assert all(loads(backend, index, BLOCK) for index in range(full))
    backend.delete([make_key(0), make_key(1)])  # Space returns.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ucm.store.posix"):
        assert dump(backend, 100)
    assert "writes resumed" in caplog.text
    assert loads(backend, 100, BLOCK)


@pytest.mark.parametrize("direct_io", [False, True])
def test_read_only_filesystem_drops_writes_and_serves_reads(
    small_filesystem: Path, direct_io: bool
) -> None:
    backend = PosixBackend(small_filesystem / "store", 64 << 20, direct_io=direct_io)
    assert dump(backend, 0)
    remount(small_filesystem, "ro")  # Possible only with no file open for writing.
    try:
        assert not dump(backend, 1)
        assert backend.dropped_writes == 1
        assert loads(backend, 0, BLOCK)
        assert backend.usage().used_bytes == BLOCK
    finally:
        remount(small_filesystem, "rw")
    assert dump(backend, 1)
    assert backend.usage().used_bytes == 2 * BLOCK


def test_removed_store_directory_is_a_miss_then_created_again(tmp_path: Path) -> None:
    root = tmp_path / "store"
    backend = PosixBackend(root, 64 << 20)
    assert dump(backend, 0)
    shutil.rmtree(root)
    assert not loads(backend, 0, BLOCK)
    assert backend.lookup([make_key(0)]) == [False]
    assert dump(backend, 1)
    assert loads(backend, 1, BLOCK)
    for directory in (root, block_path(root, 1).parent):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
