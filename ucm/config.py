"""ucm's configuration: typed, frozen objects and the one function that parses them.

Settings come from vLLM's ``kv_connector_extra_config`` (inline keys) and, optionally,
a YAML file named by its ``UCM_CONFIG_FILE`` key; inline keys override the file's.
Every mistake (an unknown key, a wrong type, a bad size, an unknown backend, an
unwritable path) raises :class:`ConfigError` naming the key and the value.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from ucm.eviction import DEFAULT_POLICY, POLICIES

CONFIG_FILE_KEY = "UCM_CONFIG_FILE"
"""The inline key whose value is the path of a YAML configuration file."""

_FLAGS = {"in_place": True, "async_load": False, "async_save": False}
"""Boolean settings and their defaults."""
_TOP_LEVEL_KEYS = frozenset({"tiers", "model_id", "max_pending_write_bytes", "io_threads", *_FLAGS})
_DEFAULT_MAX_PENDING_WRITE_BYTES = 512 << 20
_DEFAULT_IO_THREADS = 4
_TIER_COMMON_KEYS = frozenset({"backend", "capacity", "eviction"})
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the key and the value."""


@dataclass(frozen=True)
class TierConfig:
    """One storage tier, as configured."""

    backend: str
    """Registered backend name (``dram``, ``posix``, or a third-party one)."""
    capacity: int
    """Byte capacity of the tier; the backend evicts to stay within it."""
    options: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))
    """Backend-specific options, already checked against the backend's ``option_types``."""
    eviction: str = DEFAULT_POLICY
    """Eviction policy: ``lru`` (least recently used first) or ``s3fifo`` (resists
    scans of blocks used once)."""


@dataclass(frozen=True)
class UCMConfig:
    """Everything ucm needs to know beyond what vLLM's own config says."""

    tiers: tuple[TierConfig, ...]
    """Storage tiers from fastest (first) to slowest (last)."""
    model_id: str | None = None
    """Model identity mixed into every key. ``None`` uses the model name or path that
    vLLM was given; set it to share a store between engines that load the same
    weights from different paths."""
    max_pending_write_bytes: int = _DEFAULT_MAX_PENDING_WRITE_BYTES
    """Saved bytes that may wait for a background write (per worker); a step waits for
    writes only when this much is pending."""
    io_threads: int = _DEFAULT_IO_THREADS
    """Threads per worker that read blocks from the tiers in parallel (and as many
    that write blocks in the background)."""
    in_place: bool = True
    """Let stores read and write vLLM's KV pages directly where each page is contiguous
    host memory; False copies every block through staging memory, as on a GPU."""
    async_load: bool = False
    """Load requests whose stored prefix comes (partly) from a persistent tier in the
    background: vLLM keeps scheduling other requests and resumes the request once its
    blocks are in place. Needs vLLM to call the connector's ``get_finished``, which it
    does when ``kv_connector`` is ``UCMConnector``; leave it off under a wrapper
    connector that does not forward ``get_finished`` (such a request would never
    resume)."""
    async_save: bool = False
    """Write saved blocks to persistent tiers straight from vLLM's KV pages in the
    background, with no copy out of the pages within the step: vLLM keeps a finished
    request's blocks until their writes are done (``request_finished`` returns True and
    ``get_finished`` reports the request), and a preempted request's blocks are reused
    only once their writes are done (``handle_preemptions``). Needs vLLM to call those
    two hooks, which it does when ``kv_connector`` is ``UCMConnector``; leave it off
    under a wrapper connector that does not forward them (blocks would never be freed)."""


def default_cache_dir() -> Path:
    """Return the default ``posix`` directory: ``$XDG_CACHE_HOME/ucm`` or ``~/.cache/ucm``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ucm"


def default_settings() -> dict[str, Any]:
    """Return the embedded default settings: a DRAM tier over a ``posix`` tier."""
    return {
        "tiers": [
            {"backend": "dram", "capacity": "1GiB"},
            {"backend": "posix", "path": str(default_cache_dir()), "capacity": "16GiB"},
        ]
    }


def parse_size(value: object, key: str) -> int:
    """Parse a byte size such as ``1048576``, ``"512MiB"`` or ``"1.5GB"``.

    Args:
        value: An integer number of bytes or a string with an optional unit.
        key: The configuration key, for error messages.

    Returns:
        The size in bytes (positive).

    Raises:
        ConfigError: The value is not a positive size.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size such as 1073741824 or '1GiB', got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (match := _SIZE_RE.match(value)):
        number, unit = match.groups()
        if unit.lower() not in _SIZE_UNITS:
            raise ConfigError(f"{key}: unknown size unit {unit!r} in {value!r}")
        size = int(float(number) * _SIZE_UNITS[unit.lower()])
    else:
        raise ConfigError(f"{key}: expected a size such as 1073741824 or '1GiB', got {value!r}")
    if size <= 0:
        raise ConfigError(f"{key}: size must be positive, got {value!r}")
    return size


def load_settings(extra_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """Merge the YAML file named by ``UCM_CONFIG_FILE`` with the inline settings.

    Args:
        extra_config: vLLM's ``kv_connector_extra_config`` (may be empty or None).

    Returns:
        The merged raw settings; the embedded default when there are none at all.

    Raises:
        ConfigError: The file cannot be read or is not a YAML mapping.
    """
    inline = dict(extra_config or {})
    settings: dict[str, Any] = {}
    if CONFIG_FILE_KEY in inline:
        path = Path(os.path.expanduser(str(inline.pop(CONFIG_FILE_KEY))))
        try:
            loaded = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"{CONFIG_FILE_KEY}: cannot read {str(path)!r}: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{CONFIG_FILE_KEY}: {str(path)!r} must hold a mapping")
        settings.update(loaded or {})
    settings.update(inline)
    return settings or default_settings()


def parse_config(extra_config: Mapping[str, Any] | None) -> UCMConfig:
    """Parse and validate ucm's settings; the one place configuration is read.

    Args:
        extra_config: vLLM's ``kv_connector_extra_config``.

    Returns:
        The validated, frozen configuration.

    Raises:
        ConfigError: Any key or value is wrong; the message names it.
    """
    settings = load_settings(extra_config)
    unknown = sorted(set(settings) - _TOP_LEVEL_KEYS)
    if unknown:
        raise ConfigError(
            f"unknown key {unknown[0]!r} (value {settings[unknown[0]]!r}); "
            f"known keys: {sorted(_TOP_LEVEL_KEYS | {CONFIG_FILE_KEY})}"
        )
    model_id = settings.get("model_id")
    if model_id is not None and not isinstance(model_id, str):
        raise ConfigError(f"model_id: expected a string, got {model_id!r}")
    raw_tiers = settings.get("tiers", default_settings()["tiers"])
    if not isinstance(raw_tiers, list) or not raw_tiers:
        raise ConfigError(f"tiers: expected a non-empty list of tiers, got {raw_tiers!r}")
    tiers = tuple(_parse_tier(raw, f"tiers[{index}]") for index, raw in enumerate(raw_tiers))
    pending = settings.get("max_pending_write_bytes", _DEFAULT_MAX_PENDING_WRITE_BYTES)
    io_threads = settings.get("io_threads", _DEFAULT_IO_THREADS)
    if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1:
        raise ConfigError(f"io_threads: expected a positive integer, got {io_threads!r}")
    flags = {name: settings.get(name, default) for name, default in _FLAGS.items()}
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: expected true or false, got {value!r}")
    return UCMConfig(
        tiers=tiers,
        **flags,
        model_id=model_id,
        max_pending_write_bytes=parse_size(pending, "max_pending_write_bytes"),
        io_threads=io_threads,
    )


def _parse_tier(raw: object, key: str) -> TierConfig:
    from ucm.store.registry import BackendImportError, UnknownBackendError, backend_class

    if not isinstance(raw, dict):
        raise ConfigError(f"{key}: expected a mapping with 'backend' and 'capacity', got {raw!r}")
    name = raw.get("backend")
    if not isinstance(name, str):
        raise ConfigError(f"{key}.backend: expected a backend name, got {name!r}")
    try:
        cls = backend_class(name)
    except (UnknownBackendError, BackendImportError) as exc:
        raise ConfigError(f"{key}.backend: {exc}") from exc
    if "capacity" not in raw:
        raise ConfigError(f"{key}.capacity: missing (e.g. '2GiB')")
    capacity = parse_size(raw["capacity"], f"{key}.capacity")
    eviction = raw.get("eviction", DEFAULT_POLICY)
    if eviction not in POLICIES:
        raise ConfigError(f"{key}.eviction: expected one of {sorted(POLICIES)}, got {eviction!r}")
    options: dict[str, object] = {}
    for option, value in raw.items():
        if option in _TIER_COMMON_KEYS:
            continue
        expected = cls.option_types.get(option)
        if expected is None:
            known = sorted(_TIER_COMMON_KEYS | set(cls.option_types))
            raise ConfigError(
                f"{key}.{option}: unknown key for backend {name!r} (value {value!r}); "
                f"known keys: {known}"
            )
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, expected) or (expected is not bool and isinstance(value, bool)):
            raise ConfigError(f"{key}.{option}: expected {expected.__name__}, got {value!r}")
        options[option] = value
    for option in sorted(cls.required_options - set(options)):
        raise ConfigError(f"{key}.{option}: missing (required by backend {name!r})")
    if "path" in options:
        options["path"] = str(_writable_dir(str(options["path"]), f"{key}.path"))
    return TierConfig(
        backend=name, capacity=capacity, eviction=eviction, options=MappingProxyType(options)
    )


def _writable_dir(value: str, key: str) -> Path:
    path = Path(os.path.expanduser(value)).absolute()
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise ConfigError(f"{key}: cannot create directory {str(path)!r}: {exc}") from exc
    if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: directory {str(path)!r} is not writable")
    return path
