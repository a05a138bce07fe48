"""Tests of the ``posix`` backend: conformance, sharing, damaged, torn and forged files."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ucm.config import TierConfig
from ucm.store.base import Backend
from ucm.store.blockfile import TRAILER_BYTES, Sealer, parse_trailer
from ucm.store.posix import PosixBackend
from ucm.store.posix_files import tmp_name
from ucm.testing.conformance import (
    BackendConformance,
    make_buffer,
    make_key,
    make_payload,
    views,
)

DEAD_PID = 10**9  # Above the kernel's pid_max, so no process ever has it.


class TestPosixConformance(BackendConformance):
    def make_backend(self, capacity_bytes: int, tmp_path: Path) -> Backend:
        return PosixBackend(tmp_path / "store", capacity_bytes)


class TestPosixS3FIFOConformance(BackendConformance):
    def make_backend(self, capacity_bytes: int, tmp_path: Path) -> Backend:
        return PosixBackend(tmp_path / "store", capacity_bytes, eviction="s3fifo")


def block_path(root: Path, index: int) -> Path:
    name = make_key(index).hex()
    return root / "v2" / name[:3] / f"{name}.blk"


def dump(backend: Backend, index: int, size: int = 100) -> None:
    assert backend.dump([make_key(index)], views([make_payload(index, size)])).wait() == [True]


SECRET = b"0123456789abcdef-secret"


def loads(backend: Backend, index: int, size: int = 100) -> bool:
    buffers = [make_buffer(size)]
    (loaded,) = backend.load([make_key(index)], views(buffers)).wait()
    assert not loaded or buffers == [make_payload(index, size)]  # A failed load may write.
    return loaded


def test_capabilities_and_options() -> None:
    assert PosixBackend.capabilities.persistent
    assert PosixBackend.capabilities.shared
    assert PosixBackend.option_types == {
        "path": str,
        "fsync": bool,
        "direct_io": bool,
        "index_refresh_seconds": float,
        "verify": bool,
        "secret_file": str,
        "secret_env": str,
    }


def test_from_tier(tmp_path: Path) -> None:
    tier = TierConfig("posix", 5000, {"path": str(tmp_path / "s"), "fsync": True})
    backend = PosixBackend.from_tier(tier)
    dump(backend, 0)
    assert loads(backend, 0)
    assert backend.usage().capacity_bytes == 5000


def test_from_tier_requires_path() -> None:
    with pytest.raises(ValueError, match="path"):
        PosixBackend.from_tier(TierConfig("posix", 5000))


def test_unwritable_root_names_the_path(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    root = tmp_path / "file" / "sub"
    with pytest.raises(ValueError, match=str(root)):
        PosixBackend(root, 1000)


def test_long_keys_are_rejected(tmp_path: Path) -> None:
    backend = PosixBackend(tmp_path, 1000)
    with pytest.raises(ValueError, match="32 bytes"):
        backend.lookup([make_key(0) + b"x"])  # type: ignore[list-item]


def test_files_are_private(tmp_path: Path) -> None:
    backend = PosixBackend(tmp_path / "store", 1000)
    dump(backend, 0)
    path = block_path(tmp_path / "store", 0)
    for item in (path, path.parent, tmp_path / "store" / "v2"):
        assert stat.S_IMODE(item.stat().st_mode) & 0o077 == 0
    assert path.stat().st_size == 100 + TRAILER_BYTES


def test_blocks_persist_across_instances(tmp_path: Path) -> None:
    first = PosixBackend(tmp_path, 10_000)
    for index in range(3):
        dump(first, index)
    first.close()
    second = PosixBackend(tmp_path, 10_000)
    assert second.usage().num_blocks == 3
    assert second.usage().used_bytes == 300
    assert second.lookup([make_key(i) for i in range(4)]) == [True, True, True, False]
    assert all(loads(second, index) for index in range(3))


def test_second_instance_sees_blocks_written_after_it_started(tmp_path: Path) -> None:
    writer, reader = PosixBackend(tmp_path, 10_000), PosixBackend(tmp_path, 10_000)
    dump(writer, 0)
    dump(writer, 1)
    assert reader.lookup([make_key(0)]) == [True]
    assert loads(reader, 1)
    assert reader.usage().num_blocks == 2
    assert reader.dump([make_key(0)], views([make_payload(0, 100)])).wait() == [True]


def test_block_deleted_by_another_instance_is_a_miss(tmp_path: Path) -> None:
    first, second = PosixBackend(tmp_path, 10_000), PosixBackend(tmp_path, 10_000)
    dump(first, 0)
    dump(first, 1)
    second.delete([make_key(0), make_key(1)])
    assert first.lookup([make_key(0)]) == [False]
    assert not loads(first, 1)
    assert first.usage().num_blocks == 0
    assert first.usage().used_bytes == 0


def test_evicts_at_startup_known_blocks_first(tmp_path: Path) -> None:
    first = PosixBackend(tmp_path, 10_000)
    for index in range(3):
        dump(first, index)
        os.utime(block_path(tmp_path, index), (1000.0 + index, 1000.0 + index))
    second = PosixBackend(tmp_path, 300)
    dump(second, 3)
    assert second.lookup([make_key(i) for i in range(4)]) == [False, True, True, True]


def corrupt_truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 1)


def corrupt_extend(path: Path) -> None:
    with path.open("ab") as file:
        file.write(b"\0")


def corrupt_byte(offset: int) -> Callable[[Path], None]:
    """Flip the bits of one byte; a negative offset counts from the end of the file."""

    def corrupt(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[offset] ^= 0xFF
        path.write_bytes(data)

    return corrupt


def corrupt_wrong_key(path: Path) -> None:
    other = path.with_name("other.blk")
    backend = PosixBackend(path.parents[2], 10_000)
    backend.dump([make_key(1)], views([make_payload(0, 100)])).wait()
    os.replace(block_path(path.parents[2], 1), other)
    os.replace(other, path)


@pytest.mark.parametrize(
    "corrupt",
    [
        corrupt_truncate,
        corrupt_extend,
        corrupt_wrong_key,
        corrupt_byte(0),  # first payload byte
        corrupt_byte(99),  # last payload byte
        corrupt_byte(-TRAILER_BYTES),  # digest
        corrupt_byte(-TRAILER_BYTES + 16),  # first key byte
        corrupt_byte(-16),  # payload length
        corrupt_byte(-8),  # key length
        corrupt_byte(-7),  # flags
        corrupt_byte(-6),  # format version
        corrupt_byte(-1),  # magic
    ],
)
@pytest.mark.parametrize("direct_io", [False, True])
def test_damaged_block_is_a_miss_and_is_removed(
    tmp_path: Path, corrupt: Callable[[Path], None], direct_io: bool
) -> None:
    backend = PosixBackend(tmp_path, 10_000, direct_io=direct_io)
    dump(backend, 0)
    corrupt(block_path(tmp_path, 0))
    assert not loads(PosixBackend(tmp_path, 10_000, direct_io=direct_io), 0)
    assert backend.lookup([make_key(0)]) == [False]
    assert not loads(backend, 0)
    dump(backend, 0)
    assert loads(backend, 0)


def test_wrong_size_destination_keeps_the_block(tmp_path: Path) -> None:
    backend = PosixBackend(tmp_path, 10_000)
    dump(backend, 0)
    assert not loads(backend, 0, size=99)
    assert loads(backend, 0)


def test_stale_temporary_files_are_removed_at_startup(tmp_path: Path) -> None:
    shard = block_path(tmp_path, 0).parent
    shard.mkdir(parents=True)
    dead = shard / tmp_name(make_key(0), DEAD_PID)
    old = shard / tmp_name(make_key(1), os.getpid())
    live = shard / tmp_name(make_key(2), os.getpid())
    foreign = shard / f"{make_key(3).hex()}.otherhost.{DEAD_PID}.abcd.tmp"
    for path in (dead, old, live, foreign):
        path.write_bytes(b"partial")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    backend = PosixBackend(tmp_path, 10_000)
    assert sorted(shard.iterdir()) == sorted([live, foreign])
    assert backend.lookup([make_key(i) for i in range(4)]) == [False] * 4
    assert backend.usage().num_blocks == 0


def test_no_temporary_file_is_left_behind(tmp_path: Path) -> None:
    backend = PosixBackend(tmp_path, 350)
    for index in range(10):
        dump(backend, index)
    assert not list(tmp_path.rglob("*.tmp"))
    assert len(list(tmp_path.rglob("*.blk"))) == 3


def test_payload_damage_goes_unnoticed_without_verify(tmp_path: Path) -> None:
    backend = PosixBackend(tmp_path, 10_000)
    dump(backend, 0)
    corrupt_byte(0)(block_path(tmp_path, 0))
    buffers = [make_buffer(100)]
    unverified = PosixBackend(tmp_path, 10_000, verify=False)
    assert unverified.load([make_key(0)], views(buffers)).wait() == [True]
    assert buffers != [make_payload(0, 100)]  # The check that verify does is needed.
    assert not loads(backend, 0)


def test_trailer_describes_the_block(tmp_path: Path) -> None:
    dump(PosixBackend(tmp_path, 10_000), 3)
    data = block_path(tmp_path, 3).read_bytes()
    trailer = parse_trailer(data[-TRAILER_BYTES:])
    assert trailer is not None
    assert (trailer.key, trailer.length, trailer.flags) == (make_key(3), 100, 0)
    assert Sealer().verify(trailer, [memoryview(data[:-TRAILER_BYTES])])
    assert not Sealer(SECRET).verify(trailer, [memoryview(data[:-TRAILER_BYTES])])


def test_signed_blocks_load_only_with_the_same_secret(tmp_path: Path) -> None:
    signed = PosixBackend(tmp_path, 10_000, secret=SECRET)
    dump(signed, 0)
    dump(signed, 1)
    assert loads(PosixBackend(tmp_path, 10_000, secret=SECRET), 0)
    assert not loads(PosixBackend(tmp_path, 10_000, secret=SECRET + b"x"), 0)
    assert not loads(PosixBackend(tmp_path, 10_000), 1)  # A reader without the key.
    assert not block_path(tmp_path, 1).exists()  # Refused blocks are removed.


def test_writer_without_the_secret_cannot_get_its_blocks_served(tmp_path: Path) -> None:
    forger = PosixBackend(tmp_path, 10_000)
    signed = PosixBackend(tmp_path, 10_000, secret=SECRET)
    dump(forger, 0)  # A well-formed block with a valid checksum, but no MAC.
    assert not loads(signed, 0)
    # Nor can it turn off verification in the signing reader.
    assert not loads(PosixBackend(tmp_path, 10_000, secret=SECRET, verify=False), 0)


def test_secret_from_file_or_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET + b"\n")
    monkeypatch.setenv("UCM_TEST_SECRET", SECRET.decode())
    store = str(tmp_path / "s")
    by_file = PosixBackend.from_tier(
        TierConfig("posix", 5000, {"path": store, "secret_file": str(secret_file)})
    )
    by_env = PosixBackend.from_tier(
        TierConfig("posix", 5000, {"path": store, "secret_env": "UCM_TEST_SECRET"})
    )
    dump(by_file, 0)
    assert loads(by_env, 0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"secret_file": "missing"}, "secret_file 'missing'"),
        ({"secret_env": "UCM_TEST_UNSET"}, "UCM_TEST_UNSET"),
        ({"secret_env": "UCM_TEST_SHORT"}, "fewer than 16"),
        ({"secret_env": "UCM_TEST_SHORT", "secret_file": "x"}, "not both"),
    ],
)
def test_bad_secret_settings_name_the_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: dict[str, str], message: str
) -> None:
    monkeypatch.delenv("UCM_TEST_UNSET", raising=False)
    monkeypatch.setenv("UCM_TEST_SHORT", "short")
    with pytest.raises(ValueError, match=message):
        PosixBackend.from_tier(TierConfig("posix", 5000, {"path": str(tmp_path), **options}))
