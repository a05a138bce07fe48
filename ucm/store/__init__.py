"""ucm's block stores: the :class:`Backend` interface and the registry of backends.

A backend is one storage tier mapping :data:`BlockKey` digests to payload bytes.
Backends are looked up by name with :func:`backend_class` and imported only then:
``dram`` (:mod:`ucm.store.dram`) keeps blocks in process memory, ``posix``
(:mod:`ucm.store.posix`) in a directory shared by many processes, ``redis``
(:mod:`ucm.store.redis`) on a Redis or Valkey server shared by many machines, and
:mod:`ucm.store.tiered` stacks several tiers. Third-party backends register with
:func:`register_backend` or the ``ucm.backends`` entry-point group.
"""

from ucm.store.base import (
    Backend,
    BlockKey,
    Buffer,
    Capabilities,
    CompletedTask,
    Task,
    Usage,
)
from ucm.store.registry import available_backends, backend_class, register_backend

__all__ = [
    "Backend",
    "BlockKey",
    "Buffer",
    "Capabilities",
    "CompletedTask",
    "Task",
    "Usage",
    "available_backends",
    "backend_class",
    "register_backend",
]
