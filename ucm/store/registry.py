"""The backend registry: maps backend names to :class:`~ucm.store.base.Backend` classes.

Names map to ``"module:Class"`` strings that are imported only when the backend is
first asked for, so that listing or validating backends never imports their
dependencies. Built-in backends are ``dram``, ``posix``, ``redis`` and ``mooncake``;
third-party packages add theirs with :func:`register_backend` or through the
``ucm.backends`` entry-point group::

    [project.entry-points."ucm.backends"]
    mystore = "mypackage.store:MyStoreBackend"
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from ucm.store.base import Backend

ENTRY_POINT_GROUP = "ucm.backends"
"""The entry-point group that third-party packages register backends under."""

_registry: dict[str, str | type[Backend]] = {
    "dram": "ucm.store.dram:DramBackend",
    "posix": "ucm.store.posix:PosixBackend",
    "redis": "ucm.store.redis:RedisBackend",
    "mooncake": "ucm.store.mooncake:MooncakeBackend",
}


class UnknownBackendError(ValueError):
    """No backend is registered under the requested name."""


class BackendImportError(ImportError):
    """A registered backend's module or class could not be imported."""


def register_backend(name: str, target: str | type[Backend], *, clobber: bool = False) -> None:
    """Register a backend under a name.

    Args:
        name: The name configurations use to select the backend.
        target: The backend class, or a ``"module:Class"`` string imported lazily.
        clobber: Replace an existing registration of ``name`` with a different target.

    Raises:
        ValueError: ``name`` is already registered to another target and ``clobber``
            is False, or ``target`` is a string without a ``:``.
    """
    if isinstance(target, str) and not _is_target(target):
        raise ValueError(f"backend target must look like 'module:Class', got {target!r}")
    current = _registry.get(name)
    if current is not None and _target_name(current) != _target_name(target) and not clobber:
        raise ValueError(
            f"backend {name!r} is already registered to {_target_name(current)!r}; "
            "pass clobber=True to replace it"
        )
    _registry[name] = target


def backend_class(name: str) -> type[Backend]:
    """Return the backend class registered under a name, importing it if needed.

    Args:
        name: A registered name, built-in or from the ``ucm.backends`` entry points.

    Returns:
        The backend class.

    Raises:
        UnknownBackendError: No backend is registered under ``name``.
        BackendImportError: The backend's module or class cannot be imported.
        TypeError: The registered object is not a :class:`Backend` subclass.
    """
    target = _registry.get(name) or _discovered().get(name)
    if target is None:
        raise UnknownBackendError(
            f"unknown backend {name!r}; known backends: {', '.join(available_backends())}"
        )
    if isinstance(target, str):
        target = _import_target(name, target)
    _registry[name] = target
    return target


def available_backends() -> list[str]:
    """Return the names of all known backends, registered or from entry points, sorted."""
    return sorted(set(_registry) | set(_discovered()))


def _discovered() -> dict[str, str]:
    return {
        point.name: f"{point.module}:{point.attr}"
        for point in entry_points(group=ENTRY_POINT_GROUP)
        if point.attr
    }


def _is_target(target: str) -> bool:
    module_name, _, attribute = target.partition(":")
    return bool(module_name) and bool(attribute)


def _target_name(target: str | type[Backend]) -> str:
    """Return ``target`` as a ``"module:Class"`` string."""
    if isinstance(target, str):
        return target
    return f"{target.__module__}:{target.__qualname__}"


def _import_target(name: str, target: str) -> type[Backend]:
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        missing = (exc.name or module_name).split(".")[0]
        raise BackendImportError(
            f"backend {name!r} needs module {module_name!r}, which cannot be imported "
            f"({exc}); install it, e.g. `pip install {missing}`"
        ) from exc
    try:
        cls = getattr(module, attribute)
    except AttributeError as exc:
        raise BackendImportError(
            f"backend {name!r}: module {module_name!r} has no attribute {attribute!r}"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TypeError(f"backend {name!r}: {target!r} is not a ucm.store.base.Backend subclass")
    return cls
