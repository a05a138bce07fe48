"""Tests of the backend registry: built-ins, registration, entry points and errors."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import EntryPoint

import pytest

import ucm.store
from ucm.store import registry
from ucm.store.dram import DramBackend
from ucm.store.posix import PosixBackend
from ucm.store.registry import (
    BackendImportError,
    UnknownBackendError,
    available_backends,
    backend_class,
    register_backend,
)


class OtherDram(DramBackend):
    """A distinct backend class for registration tests."""


@pytest.fixture(autouse=True)
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    yield


def fake_entry_points(*points: EntryPoint) -> object:
    def entry_points(*, group: str) -> list[EntryPoint]:
        return [point for point in points if point.group == group]

    return entry_points


def test_builtins() -> None:
    assert backend_class("dram") is DramBackend
    assert backend_class("posix") is PosixBackend
    assert {"dram", "posix"} <= set(available_backends())
    assert available_backends() == sorted(available_backends())


def test_package_reexports_without_importing_backends() -> None:
    assert ucm.store.backend_class is backend_class
    assert ucm.store.register_backend is register_backend
    assert ucm.store.available_backends is available_backends
    code = (
        "import sys, ucm.store; "
        "sys.exit(sorted(m for m in sys.modules if m.startswith('ucm.store.')) "
        "!= ['ucm.store.base', 'ucm.store.registry'])"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_backend_names_it_and_the_known_ones() -> None:
    with pytest.raises(UnknownBackendError, match=r"'nope'.*dram, mooncake, posix, redis") as info:
        backend_class("nope")
    assert isinstance(info.value, ValueError)


def test_register_class_and_string() -> None:
    register_backend("other", OtherDram)
    register_backend("lazy", f"{__name__}:OtherDram")
    assert backend_class("other") is OtherDram
    assert backend_class("lazy") is OtherDram
    assert {"other", "lazy"} <= set(available_backends())


def test_register_refuses_to_clobber() -> None:
    register_backend("dram", "ucm.store.dram:DramBackend")  # the same target is fine
    register_backend("dram", DramBackend)  # so is the class it names, once imported
    with pytest.raises(ValueError, match="clobber"):
        register_backend("dram", OtherDram)
    register_backend("dram", OtherDram, clobber=True)
    assert backend_class("dram") is OtherDram


def test_register_rejects_malformed_target() -> None:
    with pytest.raises(ValueError, match="module:Class"):
        register_backend("bad", "no_colon_here")


def test_missing_module_suggests_pip_install() -> None:
    register_backend("plugin", "ucm_missing_plugin_xyz.store:Backend")
    with pytest.raises(BackendImportError) as info:
        backend_class("plugin")
    message = str(info.value)
    assert "'plugin'" in message
    assert "ucm_missing_plugin_xyz.store" in message
    assert "pip install ucm_missing_plugin_xyz" in message


def test_missing_class_is_an_import_error() -> None:
    register_backend("plugin", "ucm.store.dram:Nope")
    with pytest.raises(BackendImportError, match="'Nope'"):
        backend_class("plugin")


def test_non_backend_is_rejected() -> None:
    register_backend("plugin", "ucm.store.base:Usage")
    with pytest.raises(TypeError, match="Backend"):
        backend_class("plugin")


def test_entry_points_are_discovered(monkeypatch: pytest.MonkeyPatch) -> None:
    points = (
        EntryPoint("thirdparty", f"{__name__}:OtherDram", "ucm.backends"),
        EntryPoint("elsewhere", f"{__name__}:OtherDram", "other.group"),
    )
    monkeypatch.setattr(registry, "entry_points", fake_entry_points(*points))
    assert "thirdparty" in available_backends()
    assert "elsewhere" not in available_backends()
    assert backend_class("thirdparty") is OtherDram


def test_registered_names_win_over_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    point = EntryPoint("dram", f"{__name__}:OtherDram", "ucm.backends")
    monkeypatch.setattr(registry, "entry_points", fake_entry_points(point))
    assert backend_class("dram") is DramBackend
