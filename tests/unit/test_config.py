"""Configuration: one parse point, typed results, errors that name the key and value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ucm.config import ConfigError, default_cache_dir, parse_config, parse_size


@pytest.mark.parametrize(
    ("value", "size"),
    [(1024, 1024), ("512MiB", 512 << 20), ("2GiB", 2 << 30), ("1.5GB", 1_500_000_000), ("10", 10)],
)
def test_sizes(value: object, size: int) -> None:
    assert parse_size(value, "k") == size


@pytest.mark.parametrize("value", [0, -1, "lots", "5 parsecs", True, 1.5, None])
def test_bad_sizes_name_the_key(value: object) -> None:
    with pytest.raises(ConfigError, match="tiers\\[0\\].capacity"):
        parse_size(value, "tiers[0].capacity")


def test_embedded_default_is_dram_over_posix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config = parse_config({})
    assert [tier.backend for tier in config.tiers] == ["dram", "posix"]
    assert config.tiers[1].options["path"] == str(default_cache_dir())
    assert default_cache_dir() == tmp_path / "ucm"


def test_float_options_accept_integers(tmp_path: Path) -> None:
    tier = {"backend": "posix", "capacity": 1, "path": str(tmp_path), "index_refresh_seconds": 2}
    (parsed,) = parse_config({"tiers": [tier]}).tiers
    assert parsed.options["index_refresh_seconds"] == 2.0
    assert isinstance(parsed.options["index_refresh_seconds"], float)


def test_inline_keys_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "ucm.yaml"
    path.write_text(
        "model_id: from-file\n"
        f"tiers:\n  - {{backend: posix, path: {tmp_path / 's'}, capacity: 1GiB, fsync: true}}\n"
    )
    config = parse_config({"UCM_CONFIG_FILE": str(path), "model_id": "inline"})
    assert config.model_id == "inline"
    (tier,) = config.tiers
    assert tier.capacity == 1 << 30 and tier.options["fsync"] is True
    assert tier.options["path"] == str(tmp_path / "s")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"tierz": []}, "unknown key 'tierz'"),
        ({"tiers": []}, "tiers: expected a non-empty list"),
        ({"tiers": [{"backend": "tape", "capacity": 1}]}, "tiers\\[0\\].backend: .*'tape'"),
        ({"tiers": [{"backend": "dram"}]}, "tiers\\[0\\].capacity: missing"),
        (
            {"tiers": [{"backend": "dram", "capacity": 1, "path": "/x"}]},
            "tiers\\[0\\].path: unknown",
        ),
        (
            {"tiers": [{"backend": "posix", "capacity": 1, "path": 7}]},
            "tiers\\[0\\].path: expected str",
        ),
        (
            {"tiers": [{"backend": "posix", "capacity": 1, "path": "/tmp", "fsync": "yes"}]},
            "tiers\\[0\\].fsync: expected bool",
        ),
        (
            {
                "tiers": [
                    {
                        "backend": "posix",
                        "capacity": 1,
                        "path": "/tmp",
                        "index_refresh_seconds": "1",
                    }
                ]
            },
            "tiers\\[0\\].index_refresh_seconds: expected float",
        ),
        ({"model_id": 3}, "model_id: expected a string"),
        ({"io_threads": 0}, "io_threads: expected a positive integer, got 0"),
        ({"in_place": "no"}, "in_place: expected true or false, got 'no'"),
        ({"async_save": 1}, "async_save: expected true or false, got 1"),
        ({"io_threads": "4"}, "io_threads: expected a positive integer, got '4'"),
        ({"UCM_CONFIG_FILE": "/nonexistent/ucm.yaml"}, "UCM_CONFIG_FILE: cannot read"),
    ],
)
def test_errors_name_key_and_value(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(settings)


def test_unwritable_path_is_an_error_naming_it(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    settings = {"tiers": [{"backend": "posix", "capacity": "1GiB", "path": str(blocker / "s")}]}
    with pytest.raises(ConfigError, match="tiers\\[0\\].path: cannot create directory .*file/s"):
        parse_config(settings)
