"""Fixtures shared by ucm's test suites."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ucm.testing.servers import MooncakeStore, ServerUnavailableError, ValkeyServer


@pytest.fixture(scope="session")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory for locally built models, shared by the whole session."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A 512 KiB tmpfs mounted for the test, to fill up; skipped where mounting is denied."""
    mount = tmp_path / "small"
    mount.mkdir()
    command = ["mount", "-t", "tmpfs", "-o", "size=512k,mode=0700", "tmpfs", str(mount)]
    try:
        mounted = subprocess.run(command, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        pytest.skip("no mount command: the disk-full tests need a small filesystem")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip()})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def remount(mount: Path, mode: str) -> None:
    """Remount a :func:`small_filesystem` read-only (``ro``) or writable (``rw``)."""
    subprocess.run(["mount", "-o", f"remount,{mode}", str(mount)], check=True)


def started(server: ValkeyServer | MooncakeStore) -> Iterator[Any]:
    """Start a server for a fixture, yield it, and close it afterwards.

    Skipped, with the reason, where the server is not installed, except under CI, whose
    set-up installs it: there a missing server fails the test.
    """
    try:
        server.start()
    except ServerUnavailableError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def valkey_server() -> Iterator[ValkeyServer]:
    """A Valkey server on loopback for the whole session (a 1 GB cache)."""
    yield from started(ValkeyServer())


@pytest.fixture(scope="session")
def mooncake_store() -> Iterator[MooncakeStore]:
    """A Mooncake Store on loopback (master and a 512 MB daemon) for the whole session."""
    yield from started(MooncakeStore())
