"""The ``redis`` backend: blocks as values on a Redis or Valkey server (or cluster).

Each block is one string value, ``<key_prefix><hex key>``, holding the payload followed
by the trailer of :mod:`ucm.store.blockfile` (key, length, checksum or MAC), checked on
every load: a damaged, truncated or forged value is a miss and is removed. Batches go
through one pipeline per round trip (bounded in bytes); a dump first asks which keys
the server already has and sends only the others. A standalone server's values are sent
straight from the caller's buffers where they are large (vLLM's KV pages, staging
rows), with no copy into one ``bytes`` object first.

The server bounds the store, not ucm: run it as a cache (``maxmemory`` with an
``allkeys-*`` policy), so that any block may vanish at any time. That is a miss, never
an error. Network faults are misses too: after a connection fails the backend answers
every call at once as a miss (dropped write) for ``retry_seconds``, then tries again,
so that a server that went away costs no step more than one ``timeout``.
"""

from __future__ import annotations

import enum
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import redis
import redis.cluster

from ucm.store.base import (
    BlockKey,
    CompletedTask,
    Segments,
    Task,
    Usage,
    scatter,
    segments_nbytes,
)
from ucm.store.blockfile import TRAILER_BYTES, read_secret
from ucm.store.redis_wire import ReplyReader, Segmented, SegmentedSerializer
from ucm.store.remote import COMMON_OPTIONS, RemoteBackend, byte_batches

if TYPE_CHECKING:
    from typing import Self

    from ucm.config import TierConfig

logger = logging.getLogger(__name__)

DEFAULT_KEY_PREFIX = "ucm:"
DEFAULT_TIMEOUT_SECONDS = 2.0
DEFAULT_RETRY_SECONDS = 1.0
PIPELINE_BYTES = 32 << 20
"""Payload bytes sent or expected per pipeline round trip at most."""
_LOOKUP_CHUNK = 256  # Keys per round trip of lookup_prefix.
_ZERO_COPY_BYTES = 64 << 10  # Buffers this large are sent as they are, smaller ones joined.
_CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)


class _Check(enum.Enum):
    """What checking a loaded value found."""

    OK = enum.auto()
    OTHER_SIZE = enum.auto()  # Whole, but not the size the caller expects.
    CORRUPT = enum.auto()
    MISSING = enum.auto()  # Not on the server (or not a string value).


class RedisBackend(RemoteBackend):
    """Blocks stored on a Redis or Valkey server or cluster, bounded by the server."""

    option_types: ClassVar[Mapping[str, type]] = {
        "url": str,
        "cluster": bool,
        "timeout": float,
        "password_env": str,
        **COMMON_OPTIONS,
    }
    required_options: ClassVar[frozenset[str]] = frozenset({"url"})

    def __init__(
        self,
        url: str,
        capacity_bytes: int,
        *,
        cluster: bool = False,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        retry_seconds: float = DEFAULT_RETRY_SECONDS,
        password: str | None = None,
        verify: bool = True,
        secret: bytes | None = None,
    ) -> None:
        """Connect lazily to a server; nothing is sent until the first call.

        Args:
            url: ``redis://[[user]:password@]host:port[/db]``, ``rediss://`` for TLS
                (certificate options as URL query parameters), or ``unix://path``.
            capacity_bytes: The largest payload stored and the capacity reported by
                :meth:`usage`; the server's ``maxmemory`` bounds the store itself.
            cluster: ``url`` names one node of a Redis Cluster.
            key_prefix: Prepended to every key, so that stores can share a server.
            timeout: Seconds a connection attempt or a round trip may take.
            retry_seconds: Seconds to answer misses at once after a connection failure.
            password: The server's password, instead of one in ``url``.
            verify: Check each loaded payload against its checksum; without it only
                the trailer is checked (a secret is always checked).
            secret: Sign every block with a MAC under this key and load only blocks
                whose MAC verifies; None stores plain checksums.

        Raises:
            ValueError: The URL is malformed, or a number is out of range.
        """
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must not be negative, got {capacity_bytes}")
        if timeout <= 0 or retry_seconds < 0:
            raise ValueError(
                f"redis backend: timeout must be positive and retry_seconds not negative, "
                f"got {timeout} and {retry_seconds}"
            )
        settings: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
        if password is not None:
            settings["password"] = password
        self._zero_copy = not cluster  # A cluster client drops custom connection settings.
        if self._zero_copy:  # RESP2 replies, which ReplyReader reads (no push messages).
            settings.update(command_packer=SegmentedSerializer(), protocol=2)
        try:
            if cluster:
                self._client: Any = redis.cluster.RedisCluster.from_url(url, **settings)
            else:
                self._client = redis.Redis.from_url(url, **settings)
        except (ValueError, redis.RedisError) as exc:
            raise ValueError(f"redis backend: cannot use url {_redacted(url)!r}: {exc}") from exc
        super().__init__(_redacted(url), secret, verify)
        self._url = _redacted(url)
        self._capacity = capacity_bytes
        self._prefix = key_prefix.encode()
        self._retry_seconds = retry_seconds
        self._down_until = 0.0

    @classmethod
    def from_tier(cls, tier: TierConfig) -> Self:
        """Build the backend from its tier configuration.

        Args:
            tier: The tier's settings; option ``url`` is required; ``cluster``,
                ``key_prefix``, ``timeout``, ``retry_seconds``, ``password_env`` (an
                environment variable holding the password, which keeps it out of the
                logged configuration), ``verify`` and one of ``secret_file`` or
                ``secret_env`` are optional.

        Raises:
            ValueError: ``url`` is missing or unusable, the password's variable is
                unset, or the secret cannot be read.
        """
        options = tier.options
        if "url" not in options:
            raise ValueError("redis backend: the 'url' option is required")
        timeout = options.get("timeout", DEFAULT_TIMEOUT_SECONDS)
        retry_seconds = options.get("retry_seconds", DEFAULT_RETRY_SECONDS)
        assert isinstance(timeout, float) and isinstance(retry_seconds, float)
        password = None
        if "password_env" in options:
            variable = str(options["password_env"])
            password = os.environ.get(variable)
            if password is None:
                raise ValueError(f"redis backend: password_env: variable {variable!r} is unset")
        return cls(
            str(options["url"]),
            tier.capacity,
            cluster=options.get("cluster") is True,
            key_prefix=str(options.get("key_prefix", DEFAULT_KEY_PREFIX)),
            timeout=timeout,
            retry_seconds=retry_seconds,
            password=password,
            verify=options.get("verify") is not False,
            secret=read_secret(options, "redis"),
        )

    def lookup(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Report which keys the server holds (one round trip).

        Args:
            keys: The keys to check.

        Returns:
            One flag per key; False for every key while the server is unreachable.
        """
        if not keys:
            return []
        replies = self._pipelined("exists", [(self._name(key),) for key in keys])
        return [reply == 1 for reply in replies] if replies else [False] * len(keys)

    def lookup_prefix(self, keys: Sequence[BlockKey]) -> int:
        """Return how many leading keys are stored, asking in chunks until a miss.

        Args:
            keys: Keys of consecutive blocks, in prefix order.
        """
        for start in range(0, len(keys), _LOOKUP_CHUNK):
            hits = self.lookup(keys[start : start + _LOOKUP_CHUNK])
            if not all(hits):
                return start + hits.index(False)
        return len(keys)

    def load(self, keys: Sequence[BlockKey], payloads: Sequence[Segments]) -> Task:
        """Read values and copy their checked payloads into the caller's buffers.

        Args:
            keys: The keys to read.
            payloads: Writable segments per key, together exactly the size of its payload.

        Returns:
            A finished task: per key, whether its segments were filled (False for a
            missing, damaged or wrongly sized value, or an unreachable server).
        """
        sizes = [segments_nbytes(segments) for segments in payloads]
        results = [False] * len(keys)
        fetch = self._get_into if self._zero_copy else self._get
        for batch in byte_batches(sizes, PIPELINE_BYTES):
            checks = fetch([keys[i] for i in batch], [payloads[i] for i in batch])
            if checks is None:
                continue
            corrupt = []
            for i, check in zip(batch, checks, strict=True):
                results[i] = check is _Check.OK
                if check is _Check.CORRUPT:
                    corrupt.append(keys[i])
            if corrupt:
                self._remove_corrupt(corrupt)
        return CompletedTask(results)

    def dump(self, keys: Sequence[BlockKey], payloads: Sequence[Segments]) -> Task:
        """Store payloads the server lacks (``SET NX``), each sealed with its trailer.

        Args:
            keys: The keys to write; a key already stored keeps its value.
            payloads: Segments per key whose concatenation is its payload.

        Returns:
            A finished task: per key, whether the server now holds it (False for a
            payload larger than ``capacity``, a full server or an unreachable one).
        """
        sizes = [segments_nbytes(segments) for segments in payloads]
        results = self.lookup(keys)
        missing = [i for i, held in enumerate(results) if not held and sizes[i] <= self._capacity]
        for batch in byte_batches([sizes[i] for i in missing], PIPELINE_BYTES):
            indices = [missing[j] for j in batch]
            replies = self._pipelined(
                "set",
                [(self._name(keys[i]), self._sealed(keys[i], payloads[i])) for i in indices],
                nx=True,
            )
            if replies is not None:
                for i, reply in zip(indices, replies, strict=True):
                    # True: stored; None: SET NX found the key (another writer was first).
                    results[i] = reply is True or reply is None
        self._count_dropped(
            sum(1 for i, ok in enumerate(results) if not ok and sizes[i] <= self._capacity)
        )
        return CompletedTask(results)

    def delete(self, keys: Sequence[BlockKey]) -> None:
        """Remove keys from the server (``UNLINK``); errors are logged, not raised.

        Args:
            keys: The keys to remove.
        """
        if keys:
            self._pipelined("unlink", [(self._name(key),) for key in keys])

    def usage(self) -> Usage:
        """Return the server's memory in use and its key count (all of the database's).

        Zero while the server is unreachable.
        """
        unknown = Usage(used_bytes=0, capacity_bytes=self._capacity, num_blocks=0)
        if time.monotonic() < self._down_until:
            return unknown
        try:
            memory = self._client.info("memory")
            count = self._client.dbsize()
        except (redis.RedisError, OSError):
            return unknown
        used = memory.get("used_memory", 0) if isinstance(memory, dict) else 0
        if not isinstance(count, int):  # A cluster answers per node.
            count = sum(count.values()) if isinstance(count, dict) else 0
        return Usage(used_bytes=int(used), capacity_bytes=self._capacity, num_blocks=count)

    def close(self) -> None:
        """Close the connections."""
        self._client.close()

    def __repr__(self) -> str:
        return f"RedisBackend({self._url!r})"

    def _name(self, key: BlockKey) -> bytes:
        return self._prefix + key.hex().encode()

    def _sealed(self, key: BlockKey, segments: Segments) -> bytes | Segmented:
        trailer = self._sealer.seal(key, segments).pack()
        if self._zero_copy and all(segment.nbytes >= _ZERO_COPY_BYTES for segment in segments):
            return Segmented(segments, trailer)
        return b"".join([*segments, trailer])

    def _get(self, keys: Sequence[BlockKey], payloads: Sequence[Segments]) -> list[_Check] | None:
        """Fetch values through redis-py (one pipeline) and copy their payloads out.

        Returns:
            Per key, what checking its value found; None when the pipeline failed.
        """
        values = self._pipelined("get", [(self._name(key),) for key in keys])
        if values is None:
            return None
        return [
            self._unseal(key, value, segments) if isinstance(value, bytes) else _Check.MISSING
            for key, value, segments in zip(keys, values, payloads, strict=True)
        ]

    def _get_into(
        self, keys: Sequence[BlockKey], payloads: Sequence[Segments]
    ) -> list[_Check] | None:
        """Fetch values with pipelined ``GET``s read from the socket straight into the
        payloads' buffers (a standalone server: one connection answers them all).

        Returns:
            Per key, what checking its value found; None when the connection failed.
        """
        if time.monotonic() < self._down_until:
            return None
        pool = self._client.connection_pool
        try:
            connection = pool.get_connection()
        except (redis.RedisError, OSError) as exc:
            self._failed(exc)
            return None
        try:
            commands = [("GET", self._name(key)) for key in keys]
            connection.send_packed_command(connection.pack_commands(commands))
            reader = ReplyReader(connection._sock)
            tail = memoryview(bytearray(TRAILER_BYTES))
            checks = []
            for key, segments in zip(keys, payloads, strict=True):
                try:
                    value = reader.read_value(segments, tail)
                except redis.ResponseError:  # This key alone (a wrong type): a miss.
                    value = None
                if value is None:
                    checks.append(_Check.MISSING)
                elif isinstance(value, bytes):
                    checks.append(self._unseal(key, value, segments))
                else:
                    whole = self._sealer.check(key, tail, segments, self._verify)
                    checks.append(_Check.OK if whole else _Check.CORRUPT)
            return checks
        except (redis.RedisError, OSError, ValueError) as exc:
            connection.disconnect()  # Out of step with its replies: never reused as is.
            self._failed(exc)
            return None
        finally:
            pool.release(connection)

    def _unseal(self, key: BlockKey, value: bytes, segments: Segments) -> _Check:
        """Check a value and copy its payload into ``segments``."""
        payload = self._sealer.open(key, memoryview(value), self._verify)
        if payload is None:
            return _Check.CORRUPT
        if payload.nbytes != segments_nbytes(segments):
            return _Check.OTHER_SIZE
        scatter(payload, segments)
        return _Check.OK

    def _pipelined(
        self, command: str, calls: Sequence[tuple[Any, ...]], **options: Any
    ) -> list[Any] | None:
        """Run one command per argument tuple in one pipeline.

        Returns:
            The replies, in order, or None when the pipeline failed (or the server is
            considered down). A command that failed alone (a full server) has its
            exception as its reply.
        """
        if time.monotonic() < self._down_until:
            return None
        try:
            with self._client.pipeline(transaction=False) as pipe:
                for args in calls:
                    getattr(pipe, command)(*args, **options)
                return list(pipe.execute(raise_on_error=False))
        except (redis.RedisError, OSError) as exc:
            self._failed(exc)
        return None

    def _failed(self, exc: Exception) -> None:
        """Log a failed round trip; after a connection failure, answer misses for a while."""
        if isinstance(exc, _CONNECTION_ERRORS):
            self._down_until = time.monotonic() + self._retry_seconds
            self._warn(
                "ucm: redis server %s unreachable (%s); blocks are misses, retrying in %g s",
                self._url,
                exc,
                self._retry_seconds,
            )
        else:
            self._warn("ucm: redis server %s failed: %s; blocks are misses", self._url, exc)


def _redacted(url: str) -> str:
    """Return ``url`` without its password, for logs and error messages."""
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not sep or not at:
        return url
    user = credentials.partition(":")[0]
    return f"{scheme}://{user}:***@{host}"
