"""Tests of ``ucm fsck`` and ``ucm du`` on real ``posix`` stores."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.unit.test_store_posix import DEAD_PID, SECRET, block_path, dump, loads
from ucm.cli import main
from ucm.store.posix import PosixBackend
from ucm.store.posix_files import tmp_name
from ucm.store.posix_fsck import disk_usage, fsck, trim
from ucm.testing.conformance import make_key


def damaged_store(root: Path) -> dict[str, Path]:
    """Five blocks: one torn, one with a flipped bit; a dead writer's file; a stray."""
    backend = PosixBackend(root, 10_000)
    for index in range(5):
        dump(backend, index)
    torn, flipped = block_path(root, 1), block_path(root, 2)
    os.truncate(torn, 50)
    data = bytearray(flipped.read_bytes())
    data[10] ^= 1
    flipped.write_bytes(data)
    tmp = block_path(root, 0).parent / tmp_name(make_key(9), DEAD_PID)
    tmp.write_bytes(b"partial")
    stray = block_path(root, 0).parent / "notes.txt"
    stray.write_text("not a block")
    (root / "v1").mkdir()
    return {"torn": torn, "flipped": flipped, "tmp": tmp, "stray": stray}


def test_fsck_finds_damage_and_repairs_it(tmp_path: Path) -> None:
    files = damaged_store(tmp_path)
    report = fsck(tmp_path)
    assert (report.blocks, report.payload_bytes) == (3, 300)
    assert sorted(report.damaged) == sorted([files["torn"], files["flipped"]])
    assert report.stale_tmp == [files["tmp"]]
    assert report.stray == [files["stray"]]
    assert report.other_versions == [tmp_path / "v1"]
    assert not report.clean and report.removed == 0
    repaired = fsck(tmp_path, repair=True)
    assert repaired.removed == 3
    assert not files["torn"].exists() and not files["tmp"].exists()
    assert files["stray"].exists()  # Not ucm's to remove.
    assert fsck(tmp_path).clean
    backend = PosixBackend(tmp_path, 10_000)
    assert [loads(backend, index) for index in range(5)] == [True, False, False, True, True]


def test_fsck_checks_signatures(tmp_path: Path) -> None:
    dump(PosixBackend(tmp_path, 10_000, secret=SECRET), 0)
    dump(PosixBackend(tmp_path, 10_000), 1)  # Unsigned: a forgery in a signed store.
    report = fsck(tmp_path, secret=SECRET)
    assert report.blocks == 1 and report.damaged == [block_path(tmp_path, 1)]


def test_fsck_and_du_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    damaged_store(tmp_path)
    assert main(["du", str(tmp_path)]) == 0
    assert "5 blocks" in capsys.readouterr().out
    assert main(["fsck", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert "3 blocks verified" in out and "damaged block" in out and "--repair" in out
    assert main(["fsck", str(tmp_path), "--repair"]) == 1
    assert main(["fsck", str(tmp_path)]) == 0
    assert main(["du", str(tmp_path)]) == 0
    assert "3 blocks" in capsys.readouterr().out


def test_fsck_with_secret_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    dump(PosixBackend(tmp_path, 10_000, secret=SECRET), 0)
    assert main(["fsck", str(tmp_path)]) == 2  # Without the secret the MAC cannot verify.
    monkeypatch.setenv("UCM_FSCK_SECRET", SECRET.decode())
    assert main(["fsck", str(tmp_path), "--secret-env", "UCM_FSCK_SECRET"]) == 0
    assert "1 blocks verified" in capsys.readouterr().out


def test_bad_paths_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing"
    assert main(["fsck", str(missing)]) == 2
    assert main(["du", str(missing)]) == 2
    assert capsys.readouterr().out.count(str(missing)) == 2


def test_gc_trims_least_recently_used_blocks_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    backend = PosixBackend(tmp_path, 10_000)
    for index in range(6):
        dump(backend, index)
        os.utime(block_path(tmp_path, index), (1000.0 + index, 1000.0 + index))
    assert loads(backend, 0)  # A load marks the block used: it is now the newest.
    assert trim(tmp_path, 350) == (3, 300)
    assert [block_path(tmp_path, i).exists() for i in range(6)] == [
        True,
        False,
        False,
        False,
        True,
        True,
    ]
    assert main(["gc", str(tmp_path), "--size", "100"]) == 0
    assert "removed 2 blocks" in capsys.readouterr().out
    assert disk_usage(tmp_path).blocks == 1
    assert main(["gc", str(tmp_path), "--size", "lots"]) == 2
    assert "--size" in capsys.readouterr().out
