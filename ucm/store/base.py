"""The storage backend interface every ucm tier implements.

A backend maps fixed keys (:data:`BlockKey`) to opaque byte payloads. Callers own
all memory: ``dump`` copies out of caller buffers and ``load`` copies into them, so
a backend never allocates the payload a caller ends up holding. A payload is given
as :data:`Segments`, a list of buffers whose concatenation it is, so that a block
moves straight between a store and the scattered pages of vLLM's KV cache. Transfers return a
:class:`Task` so that a backend may run them asynchronously; a backend that works
synchronously returns an already finished task.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, NewType

import numpy

if TYPE_CHECKING:
    from typing import Self

    from ucm.config import TierConfig

BlockKey = NewType("BlockKey", bytes)
"""A content key: the digest that names one stored block (see :mod:`ucm.keys`)."""

Buffer = memoryview
"""Caller-owned, C-contiguous, byte-addressable memory (``memoryview`` of format ``B``)."""

Segments = Sequence[Buffer]
"""One key's payload as caller-owned buffers, in order: the payload is their concatenation."""


_GIL_FREE_COPY_BYTES = 64 << 10  # Copies this large run without the GIL (through numpy).


def segments_nbytes(segments: Segments) -> int:
    """Return the payload size that ``segments`` hold together."""
    return sum(segment.nbytes for segment in segments)


def copy_bytes(dst: Buffer, src: Buffer) -> None:
    """Copy ``src`` into ``dst`` (byte views of equal size).

    Large copies release the GIL, so that several threads copy in parallel.
    """
    if dst.nbytes >= _GIL_FREE_COPY_BYTES:
        numpy.copyto(numpy.frombuffer(dst, numpy.uint8), numpy.frombuffer(src, numpy.uint8))
    else:
        dst[:] = src


def gather(segments: Segments, target: Buffer) -> int:
    """Copy ``segments`` back to back into the start of ``target``; return the bytes copied."""
    offset = 0
    for segment in segments:
        copy_bytes(target[offset : offset + segment.nbytes], segment.cast("B"))
        offset += segment.nbytes
    return offset


def scatter(source: Buffer, segments: Segments) -> None:
    """Copy ``source`` into ``segments``, which together hold exactly its size."""
    offset = 0
    for segment in segments:
        copy_bytes(segment.cast("B"), source[offset : offset + segment.nbytes])
        offset += segment.nbytes


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, declared instead of raising ``NotImplementedError``."""

    persistent: bool
    """Stored blocks survive the process that wrote them."""
    shared: bool
    """Several processes may read and write the same store at once."""
    supports_delete: bool = True
    """``delete`` removes blocks (otherwise it is a no-op)."""
    bounded: bool = True
    """The backend itself keeps its payload within ``capacity``, evicting by its policy.
    False where a server bounds the store instead (a Redis server's ``maxmemory``)."""
    lossy: bool = False
    """Blocks may vanish at any moment, e.g. evicted by a cache server: a lookup hit is
    likely, not certain, and a load may miss."""
    medium: Literal["memory", "disk", "remote"] = "memory"
    """Where the blocks live: host memory, a (local or shared) filesystem, or a server
    reached over the network (for metrics: where a hit came from)."""


@dataclass(frozen=True)
class Usage:
    """A snapshot of how full a backend is."""

    used_bytes: int
    """Payload bytes currently stored (as far as this process knows)."""
    capacity_bytes: int
    """The configured byte capacity."""
    num_blocks: int
    """Number of blocks currently stored (as far as this process knows)."""


class Task(abc.ABC):
    """A handle on a batch transfer: one result per key, in request order."""

    @abc.abstractmethod
    def done(self) -> bool:
        """Return whether the transfer has finished, without blocking."""

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> list[bool]:
        """Block until the transfer finishes.

        Args:
            timeout: Seconds to wait at most; ``None`` waits for ever.

        Returns:
            For each key of the batch, whether it was transferred completely.

        Raises:
            TimeoutError: The transfer did not finish within ``timeout``.
        """


class CompletedTask(Task):
    """A task that finished when it was created (for synchronous backends)."""

    def __init__(self, results: list[bool]) -> None:
        self._results = results

    def done(self) -> bool:
        """Return True: the transfer already finished."""
        return True

    def wait(self, timeout: float | None = None) -> list[bool]:
        """Return the per-key results at once."""
        return list(self._results)


class KeyIndex(abc.ABC):
    """An in-memory view of the keys a store holds, for lookups without I/O.

    The view may lag behind the store (other processes write and delete), so callers
    must treat a hit as likely, not certain: a load can still miss.
    """

    @abc.abstractmethod
    def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Return, per key, whether the view holds it (no I/O).

        Args:
            keys: The keys to check.
        """

    @abc.abstractmethod
    def refresh(self) -> None:
        """Bring the view up to date with the store now (it also refreshes on its own)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop keeping the view fresh and release it."""


class Backend(abc.ABC):
    """One storage tier: a bounded map from :data:`BlockKey` to payload bytes.

    Implementations must be thread-safe. A missing key is never an error: ``lookup``
    answers False and ``load`` reports False for it. Storage faults during a
    transfer are reported per key as False, never raised, so that callers can
    fall back to recomputation.
    """

    capabilities: ClassVar[Capabilities]
    """What this backend supports."""
    option_types: ClassVar[Mapping[str, type]] = {}
    """Tier settings this backend accepts beyond ``backend`` and ``capacity``, with their
    types; the config parser rejects any other key."""
    required_options: ClassVar[frozenset[str]] = frozenset()
    """Keys of ``option_types`` that every tier of this backend must set."""

    @classmethod
    @abc.abstractmethod
    def from_tier(cls, tier: TierConfig) -> Self:
        """Build the backend from its validated tier configuration.

        Args:
            tier: The tier's settings; ``tier.options`` holds only keys of ``option_types``.
        """

    @abc.abstractmethod
    def lookup(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Report which keys are stored.

        Args:
            keys: The keys to check.

        Returns:
            One flag per key, True where the key is stored.
        """

    def lookup_prefix(self, keys: Sequence[BlockKey]) -> int:
        """Return how many leading keys are all stored.

        Args:
            keys: Keys of consecutive blocks, in prefix order.

        Returns:
            The length of the longest prefix of ``keys`` that is stored.
        """
        for index, hit in enumerate(self.lookup(keys)):
            if not hit:
                return index
        return len(keys)

    @abc.abstractmethod
    def load(self, keys: Sequence[BlockKey], payloads: Sequence[Segments]) -> Task:
        """Copy stored payloads into caller-owned buffers.

        A key that fails may have had its buffers partly overwritten.

        Args:
            keys: The keys to read.
            payloads: Writable segments per key; together they must be exactly the
                size of the stored payload, otherwise that key fails.

        Returns:
            A task whose result says, per key, whether its buffer was filled.
        """

    @abc.abstractmethod
    def dump(self, keys: Sequence[BlockKey], payloads: Sequence[Segments]) -> Task:
        """Store payloads copied from caller-owned buffers.

        A key that is already stored keeps its payload (blocks are immutable:
        equal keys mean equal contents). The caller may reuse the buffers once
        the task is done.

        Args:
            keys: The keys to write.
            payloads: Segments per key whose concatenation is its payload.

        Returns:
            A task whose result says, per key, whether it is now stored.
        """

    @abc.abstractmethod
    def delete(self, keys: Sequence[BlockKey]) -> None:
        """Remove keys; keys that are not stored are ignored.

        Args:
            keys: The keys to remove.
        """

    @abc.abstractmethod
    def usage(self) -> Usage:
        """Return how full the backend is."""

    def key_index(self) -> KeyIndex | None:
        """Open a live in-memory view of the stored keys, if the backend offers one.

        Lookups through ``lookup`` are exact but may cost I/O; the view costs none.
        The caller closes the view.

        Returns:
            The view, or None when this backend has none (the default).
        """
        return None

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release resources; the backend must not be used afterwards."""
