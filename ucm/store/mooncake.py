"""The ``mooncake`` backend: blocks in a Mooncake Store cluster (master + memory daemons).

Each block is one object, ``<key_prefix><hex key>``, holding the payload followed by the
trailer of :mod:`ucm.store.blockfile` (key, length, checksum or MAC), checked on every
load: a damaged or forged object is a miss and is removed. Transfers are zero-copy
batches (``batch_put_from`` / ``batch_get_into``) between the store and staging buffers
registered with Mooncake's transfer engine once, at start; a batch moves through one
staging buffer (:data:`DEFAULT_STAGING_BYTES` by default), several run at once.

Engines are clients that contribute no memory by default (``segment_bytes: 0``): the
memory lives in long-running ``mooncake_client`` daemons, so an engine that exits
takes no block with it. The master evicts when the pool is full: like a cache server,
any block may vanish at any time, which is a miss, never an error.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

import numpy

from ucm.store.base import (
    BlockKey,
    CompletedTask,
    Segments,
    Task,
    Usage,
    gather,
    scatter,
    segments_nbytes,
)
from ucm.store.blockfile import TRAILER_BYTES, read_secret
from ucm.store.remote import COMMON_OPTIONS, RemoteBackend, byte_batches

if TYPE_CHECKING:
    from typing import Self

    from ucm.config import TierConfig

logger = logging.getLogger(__name__)

DEFAULT_KEY_PREFIX = "ucm:"
DEFAULT_STAGING_BYTES = 32 << 20
"""Bytes of one registered staging buffer: the most one batch (or one block) moves."""
DEFAULT_STAGING_BUFFERS = 4
"""Staging buffers, hence batches in flight at once."""
DEFAULT_LOCAL_BUFFER_BYTES = 16 << 20
DEFAULT_RETRY_SECONDS = 5.0
RPC_FAILED = -900
"""Mooncake's status for a call that could not reach the master."""


class MooncakeBackend(RemoteBackend):
    """Blocks stored in a Mooncake Store, bounded by the store's own eviction."""

    option_types: ClassVar[Mapping[str, type]] = {
        "master": str,
        "local_hostname": str,
        "protocol": str,
        "device_name": str,
        "metadata_server": str,
        "segment_bytes": int,
        "staging_bytes": int,
        "staging_buffers": int,
        **COMMON_OPTIONS,
    }
    required_options: ClassVar[frozenset[str]] = frozenset({"master"})

    def __init__(
        self,
        master: str,
        capacity_bytes: int,
        *,
        local_hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        metadata_server: str = "P2PHANDSHAKE",
        segment_bytes: int = 0,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        staging_buffers: int = DEFAULT_STAGING_BUFFERS,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        retry_seconds: float = DEFAULT_RETRY_SECONDS,
        verify: bool = True,
        secret: bytes | None = None,
    ) -> None:
        """Connect to the store's master and register the staging buffers.

        Args:
            master: The master's ``host:port``.
            capacity_bytes: The largest payload stored and the capacity reported by
                :meth:`usage`; the store's memory daemons bound the store itself.
            local_hostname: This host's address as the other store members reach it.
            protocol: ``tcp``, or ``rdma`` where the machines have RDMA devices.
            device_name: RDMA device names (empty for ``tcp``).
            metadata_server: Where transfer-engine metadata is exchanged.
            segment_bytes: Memory this process contributes to the store (0: none, the
                daemons hold the blocks; what a process contributes dies with it).
            staging_bytes: Size of each registered staging buffer.
            staging_buffers: Number of staging buffers (batches in flight).
            key_prefix: Prepended to every key, so that stores can share a cluster.
            retry_seconds: While the master is unreachable, every call is a miss at
                once, and a background probe asks again this often.
            verify: Check each loaded payload against its checksum.
            secret: Sign blocks with a MAC under this key and load only verified ones.

        Raises:
            ValueError: The Mooncake client is not installed or cannot join the store.
        """
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise ValueError(
                f"mooncake backend: cannot import Mooncake ({exc}); install "
                "`mooncake-transfer-engine-non-cuda` (and Debian's libibverbs1)"
            ) from exc
        if staging_bytes <= TRAILER_BYTES or staging_buffers < 1 or segment_bytes < 0:
            raise ValueError(
                f"mooncake backend: staging_bytes, staging_buffers and segment_bytes out of "
                f"range: {staging_bytes}, {staging_buffers}, {segment_bytes}"
            )
        self._store: Any = MooncakeDistributedStore()
        status = self._store.setup(
            local_hostname,
            metadata_server,
            segment_bytes,
            DEFAULT_LOCAL_BUFFER_BYTES,
            protocol,
            device_name,
            master,
        )
        if status != 0:
            raise ValueError(f"mooncake backend: cannot join the store at {master!r} ({status})")
        super().__init__(f"Mooncake {master}", secret, verify)
        self._master = master
        self._capacity = capacity_bytes
        self._prefix = key_prefix
        self._staging_bytes = staging_bytes
        self._arenas = [numpy.zeros(staging_bytes, numpy.uint8) for _ in range(staging_buffers)]
        self._free: queue.SimpleQueue[numpy.ndarray] = queue.SimpleQueue()
        for arena in self._arenas:
            if self._store.register_buffer(arena.ctypes.data, staging_bytes) != 0:
                raise ValueError("mooncake backend: cannot register a staging buffer")
            self._free.put(arena)
        self._lock = threading.Lock()
        self._retry = retry_seconds
        self._down = threading.Event()  # Set while the master is unreachable.
        self._closed = threading.Event()

    @classmethod
    def from_tier(cls, tier: TierConfig) -> Self:
        """Build the backend from its tier configuration.

        Args:
            tier: The tier's settings; option ``master`` is required.

        Raises:
            ValueError: The store cannot be joined, or the secret cannot be read.
        """
        options = tier.options

        def text(name: str, default: str) -> str:
            return str(options.get(name, default))

        def seconds(name: str, default: float) -> float:
            value = options.get(name, default)
            assert isinstance(value, float)
            return value

        def number(name: str, default: int) -> int:
            value = options.get(name, default)
            assert isinstance(value, int)
            return value

        return cls(
            text("master", ""),
            tier.capacity,
            local_hostname=text("local_hostname", "127.0.0.1"),
            protocol=text("protocol", "tcp"),
            device_name=text("device_name", ""),
            metadata_server=text("metadata_server", "P2PHANDSHAKE"),
            segment_bytes=number("segment_bytes", 0),
            staging_bytes=number("staging_bytes", DEFAULT_STAGING_BYTES),
            staging_buffers=number("staging_buffers", DEFAULT_STAGING_BUFFERS),
            key_prefix=text("key_prefix", DEFAULT_KEY_PREFIX),
            retry_seconds=seconds("retry_seconds", DEFAULT_RETRY_SECONDS),
            verify=options.get("verify") is not False,
            secret=read_secret(options, "mooncake"),
        )

    def lookup(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Report which keys the store holds (one round trip to the master).

        Args:
            keys: The keys to check.
        """
        if not keys:
            return []
        found = self._call("batch_is_exist", [self._name(key) for key in keys])
        return [flag == 1 for flag in found] if found else [False] * len(keys)

    def load(self, keys: Sequence[BlockKey], payloads: Sequence[Segments]) -> Task:
        """Read objects into staging, check them and copy their payloads out.

        Args:
            keys: The keys to read.
            payloads: Writable segments per key, together exactly the size of its payload.

        Returns:
            A finished task: per key, whether its segments were filled.
        """
        sizes = [segments_nbytes(segments) + TRAILER_BYTES for segments in payloads]
        results = [False] * len(keys)
        first = _first_of_each(keys)  # The store fills only one buffer per key and batch.
        fitting = [i for i in first.values() if sizes[i] <= self._staging_bytes]
        for batch in byte_batches([sizes[i] for i in fitting], self._staging_bytes):
            batch = [fitting[j] for j in batch]
            with self._arena() as arena:
                offsets = _offsets([sizes[i] for i in batch])
                base = arena.ctypes.data
                read = self._call(
                    "batch_get_into",
                    [self._name(keys[i]) for i in batch],
                    [base + offset for offset in offsets],
                    [sizes[i] for i in batch],
                )
                view = arena.data.cast("B")
                corrupt = []
                for i, offset, got in zip(batch, offsets, read or [], strict=False):
                    if got != sizes[i]:
                        continue  # Missing (or another size): a miss.
                    value = view[offset : offset + sizes[i]]
                    if self._unseal(keys[i], value, payloads[i]):
                        results[i] = True
                    else:
                        corrupt.append(keys[i])
            if corrupt:
                self._remove_corrupt(corrupt)
        for i, key in enumerate(keys):  # Repeated keys: copy what the first one got.
            j = first[key]
            if j != i and results[j] and sizes[i] == sizes[j]:
                results[i] = _copy_segments(payloads[j], payloads[i])
        return CompletedTask(results)

    def dump(self, keys: Sequence[BlockKey], payloads: Sequence[Segments]) -> Task:
        """Store payloads the store lacks, each sealed with its trailer.

        Args:
            keys: The keys to write; a key already stored keeps its object.
            payloads: Segments per key whose concatenation is its payload.

        Returns:
            A finished task: per key, whether the store now holds it.
        """
        sizes = [segments_nbytes(segments) + TRAILER_BYTES for segments in payloads]
        results = self.lookup(keys)
        first = _first_of_each(keys)
        fits = self._staging_bytes
        missing = [
            i
            for i in first.values()
            if not results[i] and sizes[i] - TRAILER_BYTES <= self._capacity and sizes[i] <= fits
        ]
        for batch in byte_batches([sizes[i] for i in missing], self._staging_bytes):
            indices = [missing[j] for j in batch]
            with self._arena() as arena:
                offsets = _offsets([sizes[i] for i in indices])
                view = arena.data.cast("B")
                for i, offset in zip(indices, offsets, strict=True):
                    self._seal_into(keys[i], payloads[i], view[offset : offset + sizes[i]])
                status = self._call(
                    "batch_put_from",
                    [self._name(keys[i]) for i in indices],
                    [arena.ctypes.data + offset for offset in offsets],
                    [sizes[i] for i in indices],
                )
            if status is not None:
                for i, code in zip(indices, status, strict=True):
                    results[i] = code == 0
        for i, key in enumerate(keys):  # Repeated keys share the first one's fate.
            results[i] = results[first[key]]
        self._count_dropped(results.count(False))
        return CompletedTask(results)

    def delete(self, keys: Sequence[BlockKey]) -> None:
        """Remove keys from the store, even while leased to readers.

        Args:
            keys: The keys to remove.
        """
        if keys:
            self._call("batch_remove", [self._name(key) for key in keys], True)

    def usage(self) -> Usage:
        """Return the configured capacity; the store does not report its use to clients."""
        return Usage(used_bytes=0, capacity_bytes=self._capacity, num_blocks=0)

    def close(self) -> None:
        """Leave the store and release the staging buffers."""
        self._closed.set()
        for arena in self._arenas:
            self._store.unregister_buffer(arena.ctypes.data)
        self._store.close()

    def __repr__(self) -> str:
        return f"MooncakeBackend({self._master!r})"

    def _name(self, key: BlockKey) -> str:
        return self._prefix + key.hex()

    @contextmanager
    def _arena(self) -> Iterator[numpy.ndarray]:
        arena = self._free.get()
        try:
            yield arena
        finally:
            self._free.put(arena)

    def _seal_into(self, key: BlockKey, segments: Segments, target: memoryview) -> None:
        offset = gather(segments, target)
        trailer = self._sealer.seal(key, [target[:offset]])
        target[offset:] = trailer.pack()

    def _unseal(self, key: BlockKey, value: memoryview, segments: Segments) -> bool:
        payload = self._sealer.open(key, value, self._verify)
        if payload is not None:
            scatter(payload, segments)
        return payload is not None

    def _call(self, method: str, *args: Any) -> list[int] | None:
        """Call a batch method of the store; None where it failed as a whole.

        While the master is unreachable every call answers None at once; a background
        probe finds out when it is back (a call to an unreachable master may take
        seconds).
        """
        if self._down.is_set():
            return None
        try:
            result = getattr(self._store, method)(*args)
        except Exception as exc:  # noqa: BLE001 - a store fault is a miss, never an error
            self._warn(
                "ucm: Mooncake %s: %s failed: %s; blocks are misses", self._master, method, exc
            )
            return None
        codes = [result] if isinstance(result, int) else list(result)
        if RPC_FAILED in codes:
            self._went_down(method)
            return None
        return None if isinstance(result, int) else codes

    def _went_down(self, method: str) -> None:
        with self._lock:
            if self._down.is_set():
                return
            self._down.set()
        self._warn(
            "ucm: Mooncake %s unreachable; blocks are misses, probing every %g s",
            self._master,
            self._retry,
        )
        threading.Thread(target=self._probe, name="ucm-mooncake-probe", daemon=True).start()

    def _probe(self) -> None:
        probe = [self._prefix + "probe"]
        while not self._closed.wait(self._retry):
            try:
                codes = list(self._store.batch_is_exist(probe))
            except Exception:  # noqa: BLE001 - still down
                continue
            if RPC_FAILED not in codes:
                logger.info("ucm: Mooncake %s is reachable again", self._master)
                self._down.clear()
                return


def _first_of_each(keys: Sequence[BlockKey]) -> dict[BlockKey, int]:
    """Return each key's first index, in order of first occurrence."""
    first: dict[BlockKey, int] = {}
    for index, key in enumerate(keys):
        first.setdefault(key, index)
    return first


def _copy_segments(source: Segments, target: Segments) -> bool:
    """Copy one payload's segments into another's (of equal total size); return True."""
    joined = memoryview(b"".join(segment.cast("B") for segment in source))
    scatter(joined, target)
    return True


def _offsets(sizes: Sequence[int]) -> list[int]:
    """Return where each value starts when packed back to back."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += size
    return offsets
